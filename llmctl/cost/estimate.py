"""What a run will cost before it starts: FLOPs → device-hours → wall time → $ per offer.

    N            = parameters without the input embedding (a lookup: no FLOPs)
    FLOPs/token  = 6·N + 12·L·H·Q·T          (PaLM app. B; nanoGPT; torchtitan)
    tokens       = steps · batch · seq_len   (global batch)
    wall         = overhead + tokens / throughput + val_passes · val_pass_s
    $            = wall_h · $/h of the whole job (catalog $/h per node × nodes, or price_per_gpu_hour × GPUs)

Throughput (and overhead, val time) come from the best evidence, which the estimate names:
1. measured: the newest FINISHED run in MLflow with the same shape (model, seq_len, dtype, kernels,
   tp, ac) on the same accelerator (``llmctl.shape`` / ``llmctl.accelerator`` tags), scaled by nodes;
2. prior: ``MFU_PRIOR`` of the accelerator's dense peak (GPU), or ``CPU_GFLOPS_PER_CORE`` (CPU).

Pure arithmetic apart from ``hardware_of``/``prices_for`` (which ask the backend and SkyPilot's
offline catalog); stdlib only at module level.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from llmctl.cost.peaks import peak_for

MFU_PRIOR = 0.40  # torchtitan Llama-3.1-8B on 8xH100: 34-39%; Megatron-LM 41-48%
UNKNOWN_GPU_TFLOPS = 100.0  # a GPU missing from the peak table: a deliberately modest guess
CPU_GFLOPS_PER_CORE = 25.0  # measured order: ~75 GFLOP/s for the smoke model on 2 x86-64 cores
# fixed time billed around the training loop, before any run of this shape was measured
OVERHEAD_PRIOR_S = {"local-cpu": 15.0, "local-gpu": 30.0, "sky": 600.0}  # sky: provision + node install


# ----------------------------------------------------------------------------- model arithmetic


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """Llama's SwiGLU width (same rule as ``workloads.pretrain.model.ffn_hidden_dim``)."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def num_params(model: Mapping[str, Any]) -> int:
    """N: every weight but the input embedding; a tied embedding counts once, as the LM head."""
    dim, layers, heads = int(model["dim"]), int(model["n_layers"]), int(model["n_heads"])
    kv_heads = int(model.get("n_kv_heads") or heads)
    head_dim = dim // heads
    hidden = ffn_hidden_dim(dim, int(model["multiple_of"]), model.get("ffn_dim_multiplier"))
    attention = dim * heads * head_dim + 2 * dim * kv_heads * head_dim + heads * head_dim * dim
    block = attention + 3 * dim * hidden + 2 * dim  # q k v o + SwiGLU w1 w2 w3 + two RMSNorms
    return layers * block + dim + int(model["vocab_size"]) * dim  # + final norm + LM head


def flops_per_token(model: Mapping[str, Any], seq_len: int) -> int:
    """Training FLOPs per token: 6N (fwd+bwd matmuls) + 12·L·H·Q·T (attention scores and values)."""
    heads = int(model["n_heads"])
    return 6 * num_params(model) + 12 * int(model["n_layers"]) * heads * (int(model["dim"]) // heads) * seq_len


def val_passes(steps: int, val_every: int) -> int:
    """Validation passes of a fresh run: step 0, every ``val_every`` steps, and the last step."""
    if steps <= 0:
        return 1
    if val_every <= 0:
        return 2
    return 1 + steps // val_every + (1 if steps % val_every else 0)


def shape_key(cfg: Mapping[str, Any]) -> str:
    """What makes two runs' tokens/s comparable (tag ``llmctl.shape``): the model, T, dtype, kernels, tp, ac."""
    m, t, p = cfg["model"], cfg["train"], cfg["parallel"]
    hidden = ffn_hidden_dim(int(m["dim"]), int(m["multiple_of"]), m.get("ffn_dim_multiplier"))
    return (f"d{m['dim']}-L{m['n_layers']}-H{m['n_heads']}-KV{m.get('n_kv_heads') or m['n_heads']}"
            f"-V{m['vocab_size']}-F{hidden}-tie{int(bool(m['tie_embeddings']))}-T{t['seq_len']}"
            f"-{_plain(t['dtype'])}-{_plain(m['kernels'])}{'-compiled' if m.get('compile') else ''}"
            f"-tp{p.get('tp', 1)}-ac{_plain(p.get('ac', 'none'))}")


def _plain(value: Any) -> str:
    return str(getattr(value, "value", value))


# ----------------------------------------------------------------------------- hardware and evidence


@dataclass(frozen=True)
class Hardware:
    """What the job runs on: ``accelerator`` is the tag value ("cpu", "H100:8": per node)."""

    accelerator: str
    gpu: Optional[str]  # catalog or device name; None on CPU
    gpus_per_node: int
    nodes: int
    cores_per_node: int = 1

    @property
    def devices(self) -> int:
        """Priced devices: GPUs, or one per CPU node."""
        return self.nodes * (self.gpus_per_node or 1)


@dataclass
class Measured:
    """What an earlier FINISHED run measured (see ``history.calibration``)."""

    run_id: str
    tokens_per_s: float  # steady state, whole job
    overhead_s: float  # billed wall time outside train steps and val passes
    val_pass_s: float
    nodes: int
    batch_size: int
    val_batches: int
    steps: int


@dataclass
class Throughput:
    tokens_per_s: float  # whole job
    val_pass_s: float
    overhead_s: float
    kind: str  # "measured" | "prior"
    source: str
    run_id: Optional[str] = None


def measured_throughput(m: Measured, cfg: Mapping[str, Any], hw: Hardware, accelerator: str) -> Throughput:
    """Scale a measured run to this config: tokens/s linearly in nodes, val time in val tokens per node."""
    t = cfg["train"]
    nodes_ratio = hw.nodes / max(1, m.nodes)
    val_ratio = (int(t["val_batches"]) * int(t["batch_size"])) / max(1, m.val_batches * m.batch_size)
    scaled = f", scaled x{nodes_ratio:g} for {hw.nodes} node(s)" if m.nodes != hw.nodes else ""
    return Throughput(
        tokens_per_s=m.tokens_per_s * nodes_ratio,
        val_pass_s=m.val_pass_s * val_ratio / nodes_ratio,
        overhead_s=m.overhead_s,
        kind="measured",
        source=(f"measured: run {m.run_id[:12]} ({m.steps} steps of this shape on {accelerator}):"
                f" {m.tokens_per_s:,.0f} tok/s{scaled}, overhead {m.overhead_s:.1f} s, val pass {m.val_pass_s:.2f} s"),
        run_id=m.run_id,
    )


def prior_throughput(cfg: Mapping[str, Any], hw: Hardware, backend: str) -> Throughput:
    """No measured run: a stated prior per accelerator (MFU of its peak) or per CPU core."""
    t = cfg["train"]
    fpt = flops_per_token(cfg["model"], int(t["seq_len"]))
    dtype = _plain(t["dtype"])
    if hw.gpu:
        peak = peak_for(hw.gpu, dtype)
        peak_note = f"{dtype} peak {peak:g} TFLOP/s" if peak else f"unknown peak, assumed {UNKNOWN_GPU_TFLOPS:g} TFLOP/s"
        flops_s = MFU_PRIOR * (peak or UNKNOWN_GPU_TFLOPS) * 1e12 * hw.devices
        source = f"prior: {MFU_PRIOR:.0%} MFU of {hw.gpu} {peak_note} x {hw.devices} GPU(s)"
        overhead = OVERHEAD_PRIOR_S["sky" if backend == "sky" else "local-gpu"]
    else:
        flops_s = CPU_GFLOPS_PER_CORE * 1e9 * hw.cores_per_node * hw.nodes
        source = (f"prior (rough): CPU at {CPU_GFLOPS_PER_CORE:g} GFLOP/s per core x {hw.cores_per_node} core(s)"
                  f" x {hw.nodes} node(s)")
        overhead = OVERHEAD_PRIOR_S["sky" if backend == "sky" else "local-cpu"]
    val_tokens = int(t["val_batches"]) * int(t["batch_size"]) * int(t["seq_len"])
    return Throughput(tokens_per_s=flops_s / fpt, val_pass_s=val_tokens * fpt / 3 / flops_s, overhead_s=overhead,
                      kind="prior", source=f"{source}; no FINISHED run of this shape on {hw.accelerator} in MLflow"
                      f" (fixed overhead prior {overhead:g} s)")


# ----------------------------------------------------------------------------- prices


@dataclass
class Price:
    """$/h of the whole job (all nodes) for one way of getting the hardware."""

    label: str
    usd_per_hour: float
    spot: bool
    source: str


def catalog_prices(offers_by_mode: Mapping[bool, list[Any]]) -> list[Price]:
    """``sky_rules.Offer`` lists (on-demand: False, spot: True) → prices, cheapest first per mode."""
    out = []
    for spot, found in offers_by_mode.items():
        for o in found:
            out.append(Price(label=f"{o.provider} {o.instance_type} {o.region} {'spot' if spot else 'on-demand'}",
                             usd_per_hour=o.total_hour, spot=spot,
                             source=f"SkyPilot catalog: ${o.per_node_hour:.2f}/h per node x {o.nodes} node(s)"))
    return sorted(out, key=lambda p: (p.spot, p.usd_per_hour))


def configured_price(infra: Mapping[str, Any], hw: Hardware) -> Price:
    """``infra.price_per_gpu_hour`` x GPUs (a CPU node counts as one device): Slurm, local, no catalog row."""
    rate = float(infra.get("price_per_gpu_hour") or 0.0)
    unit = "GPU" if hw.gpus_per_node else "node"
    note = "" if rate else " (0: set infra.price_per_gpu_hour to price this infra)"
    return Price(label=f"{infra['name']} at ${rate:g}/{unit}-h", usd_per_hour=rate * hw.devices,
                 spot=bool(infra.get("use_spot")),
                 source=f"infra.price_per_gpu_hour ${rate:g} x {hw.devices} {unit}(s){note}")


def choose_price(infra: Mapping[str, Any], hw: Hardware, catalog: list[Price]) -> Price:
    """The cheapest catalog offer in the configured mode (what SkyPilot's optimizer picks), else the config."""
    mode = [p for p in catalog if p.spot == bool(infra.get("use_spot"))]
    return mode[0] if mode else configured_price(infra, hw)


# ----------------------------------------------------------------------------- the estimate


@dataclass
class Estimate:
    n_params: int
    flops_per_token: int
    steps: int
    tokens: int
    val_passes: int
    hw: Hardware
    throughput: Throughput
    price: Price
    offers: list[Price] = field(default_factory=list)
    max_cost: Optional[float] = None

    @property
    def flops(self) -> float:
        return float(self.tokens) * self.flops_per_token

    @property
    def train_s(self) -> float:
        return self.tokens / self.throughput.tokens_per_s

    @property
    def wall_s(self) -> float:
        return self.throughput.overhead_s + self.train_s + self.val_passes * self.throughput.val_pass_s

    @property
    def wall_h(self) -> float:
        return self.wall_s / 3600.0

    @property
    def device_hours(self) -> float:
        return self.wall_h * self.hw.devices

    def cost_at(self, price: Price) -> float:
        return self.wall_h * price.usd_per_hour

    @property
    def total_usd(self) -> float:
        return self.cost_at(self.price)

    @property
    def over_budget(self) -> bool:
        return self.max_cost is not None and self.total_usd > self.max_cost

    def describe(self) -> str:
        lines = [
            "# cost estimate",
            f"model:       N = {self.n_params:,} params (no input embedding);"
            f" {self.flops_per_token / 1e6:,.2f} MFLOP/token (6N + 12*L*H*Q*T)",
            f"compute:     {self.tokens:,} tokens x FLOPs/token = {self.flops:.3e} FLOPs",
            f"throughput:  {self.throughput.tokens_per_s:,.0f} tok/s on {self.hw.nodes} node(s) of {self.hw.accelerator}",
            f"  source:    {self.throughput.source}",
            f"wall time:   {_dur(self.wall_s)} = overhead {self.throughput.overhead_s:.0f} s + train {_dur(self.train_s)}"
            f" + {self.val_passes} val pass(es) x {self.throughput.val_pass_s:.2f} s;"
            f" {self.device_hours:,.3f} device-hours",
            f"price:       ${self.price.usd_per_hour:,.2f}/h ({self.price.label}; {self.price.source})",
            f"total:       ${self.total_usd:,.2f} estimated",
        ]
        if self.max_cost is not None:
            verdict = "OVER: launch will refuse" if self.over_budget else "within"
            lines.append(f"max cost:    ${self.max_cost:,.2f} ({verdict}); a running job stops after a checkpoint"
                         " when its spend would pass it")
        if self.offers:
            lines.append(f"{'offer':<52} {'$/h':>9} {'total $':>10}")
            for p in self.offers:
                lines.append(f"{p.label[:52]:<52} {p.usd_per_hour:>9,.2f} {self.cost_at(p):>10,.2f}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "n_params": self.n_params, "flops_per_token": self.flops_per_token, "steps": self.steps,
            "tokens": self.tokens, "flops": self.flops, "val_passes": self.val_passes,
            "hardware": {**asdict(self.hw), "devices": self.hw.devices},
            "throughput": asdict(self.throughput), "train_s": self.train_s, "wall_s": self.wall_s,
            "device_hours": self.device_hours, "price": asdict(self.price), "total_usd": self.total_usd,
            "offers": [{**asdict(p), "total_usd": self.cost_at(p)} for p in self.offers],
            "max_cost": self.max_cost,
        }


def _dur(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def estimate(cfg: Mapping[str, Any], hw: Hardware, backend: str, *, measured: Optional[Measured] = None,
             catalog: Optional[list[Price]] = None, max_cost: Optional[float] = None) -> Estimate:
    """The estimate for a resolved config, from explicit evidence (pure: tests hand-compute it)."""
    t = cfg["train"]
    steps, batch, seq = int(t["steps"]), int(t["batch_size"]), int(t["seq_len"])
    throughput = (measured_throughput(measured, cfg, hw, hw.accelerator) if measured
                  else prior_throughput(cfg, hw, backend))
    catalog = catalog or []
    return Estimate(n_params=num_params(cfg["model"]), flops_per_token=flops_per_token(cfg["model"], seq),
                    steps=steps, tokens=steps * batch * seq, val_passes=val_passes(steps, int(t["val_every"])),
                    hw=hw, throughput=throughput, price=choose_price(cfg["infra"], hw, catalog),
                    offers=catalog, max_cost=max_cost)


# ----------------------------------------------------------------------------- from a plan


def hardware_of(plan: Any) -> Hardware:
    """The plan's accelerator, as the ``llmctl.accelerator`` tag spells it."""
    infra = plan.cfg["infra"]
    if plan.backend == "sky":
        from llmctl.backends.sky_task import node_accelerators

        acc = node_accelerators(infra)
        if acc:
            return Hardware(f"{acc[0]}:{acc[1]}", acc[0], int(acc[1]), int(infra["nodes"]))
        cores = _int_prefix(infra.get("cpus")) or 8
        return Hardware("cpu", None, 0, int(infra["nodes"]), cores)
    from llmctl.backends.local import local_gpu_count

    gpus = local_gpu_count()
    if gpus:
        name = local_gpu_name() or "GPU"
        return Hardware(f"{name}:{gpus}", name, gpus, 1)
    return Hardware("cpu", None, 0, 1, _cpu_cores())


def _int_prefix(value: Any) -> int:
    digits = "".join(ch for ch in str(value or "") if ch.isdigit())
    return int(digits) if digits else 0


def _cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def local_gpu_name() -> Optional[str]:
    """``nvidia-smi``'s name of GPU 0 (e.g. "NVIDIA H100 80GB HBM3"), without importing torch."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()
    return first[0].strip() if first else None


def prices_for(plan: Any, hw: Hardware) -> list[Price]:
    """Catalog offers, on-demand and (where the provider sells it) spot; [] off the catalog (Slurm, local)."""
    infra = plan.cfg["infra"]
    if plan.backend != "sky":
        return []
    from llmctl.backends import sky_rules

    modes = [False] + ([True] if infra.get("supports_spot", True) else [])
    return catalog_prices({spot: sky_rules.offers({**infra, "use_spot": spot}) for spot in modes})


def for_plan(plan: Any, max_cost: Optional[float] = None, lookup: bool = True) -> Estimate:
    """The estimate ``plan`` prints and ``launch`` checks and logs; ``lookup`` asks MLflow for history."""
    hw = hardware_of(plan)
    measured = None
    if lookup:
        from llmctl.cost import history

        measured = history.find(plan.tracking_uri, shape_key(plan.cfg), hw.accelerator, plan.cfg)
    return estimate(plan.cfg, hw, plan.backend, measured=measured, catalog=prices_for(plan, hw), max_cost=max_cost)
