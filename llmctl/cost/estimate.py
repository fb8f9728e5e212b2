"""What a run will cost before it starts: FLOPs → device-hours → wall time → $ per offer.

    N            = parameters without the input embedding (a lookup: no FLOPs)
    FLOPs/token  = 6·N + 12·L·H·Q·T          (PaLM app. B; nanoGPT; torchtitan): model FLOPs
                   LoRA: 4·N + 6·adapter params + 12·L·H·Q·T (the frozen base has no weight gradients)
                   DPO: + 2·N + 4·L·H·Q·T, the reference's forward over the same tokens
    work/token   = FLOPs/token with activation recompute added and FP8's speed-up taken off
                   (``work``: bf16-equivalent FLOPs, what a device's sustained FLOP/s divides)
    tokens       = steps · batch · seq_len   (global batch; DPO: steps · 2 · batch pairs · seq_len)
    wall         = overhead + tokens / throughput + val_passes · val_pass_s
    $            = wall_h · $/h of the whole job (catalog $/h per node × nodes, or price_per_gpu_hour × GPUs)

Throughput (and overhead, val time) come from the best evidence, which the estimate names:
1. measured: the newest FINISHED run in MLflow with the same shape (model, seq_len, dtype, kernels,
   tp, ac) on the same accelerator (``llmctl.shape`` / ``llmctl.accelerator`` tags), scaled by nodes;
2. transferred: no run of this shape, but one of another shape on the same accelerator: its achieved
   FLOP/s (tokens/s x its work/token) at this shape's work/token, its overhead as measured;
3. prior: ``MFU_PRIOR`` of the accelerator's dense peak (GPU), or ``CPU_GFLOPS_PER_CORE`` (CPU), on
   this shape's work/token (the prior is an MFU without recompute or FP8).

Pure arithmetic on plain values: the hardware and the catalog offers come with the plan (each
backend describes what it runs on), the measured history from ``history``; ``planner`` gathers
them. The model's arithmetic is the trainer's (``workloads.protocol.shape``, on the config
as the trainer types it: ``protocol.config.typed``). Stdlib only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from llmctl.cost.work import DPO_SUFFIX, Work, objective_of, regime, work_per_token
from llmctl.plan.devices import Hardware
from workloads.planner.hardware import peak_for
from workloads.protocol.config import ConfigLike, typed
from workloads.protocol.schema import TrainerCfg
from workloads.protocol.shape import hidden_dim, num_params, sequences_per_step

MFU_PRIOR = 0.40  # what well-tuned open trainers reach on dense LLMs; the sources are in docs/cost.md
UNKNOWN_GPU_TFLOPS = 100.0  # a GPU missing from the peak table: a deliberately modest guess
CPU_GFLOPS_PER_CORE = 25.0  # an order of magnitude for an x86-64 core; one short run calibrates it
# fixed time billed around the training loop, before any run of this shape was measured
OVERHEAD_PRIOR_S = {"local-cpu": 15.0, "local-gpu": 30.0, "sky": 600.0}  # sky: provision + node install


# ----------------------------------------------------------------------------- run arithmetic


def val_passes(steps: int, val_every: int) -> int:
    """Validation passes of a fresh run: step 0, every ``val_every`` steps, and the last step."""
    if steps <= 0:
        return 1
    if val_every <= 0:
        return 2
    return 1 + steps // val_every + (1 if steps % val_every else 0)


def shape_key(cfg: ConfigLike, gpu: bool = False) -> str:
    """What makes two runs' tokens/s comparable (tag ``llmctl.shape``): the model, T, dtype (and fp8
    recipe, as ``bf16+fp8rowwise``: no dash, so the key's fields stay put), kernels, tp, ac, and
    ``-dpo`` at the end under ``train.objective=dpo`` (its tokens also run the reference's forward:
    a DPO run's tokens/s is not an lm run's). The dtype as it runs (``train.dtype=auto`` resolved
    for a GPU target or not), so an ``auto`` run and an explicit one of the same dtype compare."""
    tc = typed(cfg)
    m, t, p = tc.model, tc.train, tc.parallel
    fp8 = t.fp8.value
    return (
        f"d{m.dim}-L{m.n_layers}-H{m.n_heads}-KV{m.n_kv_heads or m.n_heads}"
        f"-V{m.vocab_size}-F{hidden_dim(m)}-tie{int(m.tie_embeddings)}-T{t.seq_len}"
        f"-{t.dtype.on('cuda' if gpu else 'cpu')}{'' if fp8 == 'none' else '+fp8' + fp8}"
        f"-{m.kernels.value}{'-compiled' if m.compile else ''}"
        f"-tp{p.tp}-ac{p.ac.value}"
        f"{DPO_SUFFIX if t.objective == 'dpo' else ''}"
    )


# ----------------------------------------------------------------------------- hardware and evidence


# ----------------------------------------------------------------------------- FLOP/s by model size

# The FLOP/s a device sustains on a model grows with its hidden size d (``model.dim``, the inner
# dimension of every block matmul): per token a block's matmuls do ~d² work and the ops between
# them (norms, activations, rotary, residual adds: memory-bound) ~d, and a matmul itself runs nearer
# its peak as it grows. Both give one form, the time per FLOP falling as 1/d:
#     1 / F(d) = a + b / d        (F(d) = F_max · d / (d + d_half), d_half = b / a)
# A transfer from a run of size d0 to size d1 scales its FLOP/s by F(d1) / F(d0). a and b are fitted
# over the FINISHED runs of at least two sizes on the accelerator (``history.find``); with fewer,
# d_half is this prior per kind of device (the d at which it sustains half its large-model FLOP/s):
# CPU from this project's 2-core VMs (a dim-256 model sustained 12-30% more FLOP/s than the dim-128
# one: docs/benchmarks.md, ``estimate_accuracy``), GPU an assumption of the same form (a 1k-wide
# model at about half the MFU of an 8B one), until a fit over two sizes replaces it.
HALF_DIM_PRIOR = {"cpu": 100.0, "gpu": 1024.0}


@dataclass
class SizeFit:
    """``1 / F(d) = a + b / d`` fitted over ``runs`` FINISHED runs of hidden sizes ``dims``."""

    a: float
    b: float
    runs: int
    dims: tuple[int, ...]

    def speed(self, dim: float) -> float:
        """FLOP/s at hidden size ``dim``, in the units of the runs it was fitted on."""
        return 1.0 / (self.a + self.b / dim)


def fit_sizes(points: list[tuple[int, float]]) -> Optional[SizeFit]:
    """Least squares of ``1/F = a + b/d`` over (hidden size, FLOP/s) points; None with fewer than two
    sizes, or a fit that says FLOP/s grows without bound (a <= 0). A fit in which FLOP/s falls with
    size (noise between runs of close sizes) is taken as flat (b = 0)."""
    dims = sorted({d for d, _ in points})
    if len(dims) < 2:
        return None
    xs, ys = [1.0 / d for d, _ in points], [1.0 / f for _, f in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    b = max(b, 0.0)
    a = my - b * mx
    if a <= 0:
        return None
    return SizeFit(a=a, b=b, runs=len(points), dims=tuple(dims))


def hidden_size(shape: str) -> Optional[int]:
    """``model.dim`` from a run's ``llmctl.shape`` tag (``d128-L4-...``; None for another kind of key)."""
    head = shape.split("-", 1)[0]
    return int(head[1:]) if head.startswith("d") and head[1:].isdigit() else None


def size_ratio(theirs: int, mine: int, fit: Optional[SizeFit], gpu: bool) -> tuple[float, str]:
    """F(mine) / F(theirs): how much faster in FLOP/s a model of hidden size ``mine`` runs than the
    measured one of size ``theirs``, and what said so (for the estimate's source line)."""
    if theirs == mine:
        return 1.0, ""
    if fit is not None:
        ratio = fit.speed(mine) / fit.speed(theirs)
        sizes = ", ".join(str(d) for d in fit.dims)
        how = f"fit over {fit.runs} runs of sizes {sizes}: 1/FLOP/s = a + b/d"
        return ratio, f"x{ratio:.2f} for hidden size {mine} against {theirs} ({how})"
    kind = "gpu" if gpu else "cpu"
    half = HALF_DIM_PRIOR[kind]
    ratio = (mine / (mine + half)) / (theirs / (theirs + half))
    how = f"prior: FLOP/s ∝ d/(d+{half:g}) on {kind.upper()}"
    return ratio, f"x{ratio:.2f} for hidden size {mine} against {theirs} ({how})"


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
    flops_per_token: Optional[float] = None  # set when the run is of another shape: transfer its FLOP/s
    shape: Optional[str] = None
    # how FLOP/s moves with the hidden size on this accelerator, fitted over the store's runs (None:
    # fewer than two sizes measured, the prior ``HALF_DIM_PRIOR`` is used)
    size_fit: Optional[SizeFit] = None


@dataclass
class Throughput:
    tokens_per_s: float  # whole job
    val_pass_s: float
    overhead_s: float
    kind: str  # "measured" | "transferred" | "prior"
    source: str
    run_id: Optional[str] = None


def measured_throughput(m: Measured, cfg: ConfigLike, hw: Hardware, accelerator: str) -> Throughput:
    """Scale a measured run to this config: tokens/s linearly in nodes, val time in val tokens per node;
    a run of another shape also by FLOPs per token (the FLOP/s it sustained carries over), and by how
    FLOP/s moves with the hidden size (``size_ratio``: the store's runs fitted, else the prior)."""
    tc = typed(cfg)
    t = tc.train
    nodes_ratio = hw.nodes / max(1, m.nodes)
    # a transferred run's objective is its key's; a measured one has this shape's, so this objective
    theirs_objective = objective_of(m.shape) if m.shape else t.objective.value
    theirs_rows = 2 if theirs_objective == "dpo" else 1  # sequences per batch entry: a DPO pair is two
    val_ratio = (t.val_batches * sequences_per_step(t)) / max(1, m.val_batches * m.batch_size * theirs_rows)
    scaled = f", scaled x{nodes_ratio:g} for {hw.nodes} node(s)" if m.nodes != hw.nodes else ""
    flops_ratio, forward_ratio, kind, what = 1.0, 1.0, "measured", "this shape"
    if m.flops_per_token:
        # its model FLOPs/token (tag) as work: its recompute and FP8 (from its shape key) at this
        # shape's proportions, exact when they match (the ranking prefers such a run)
        mine = work_per_token(tc)
        theirs_ac, theirs_fp8 = regime(m.shape or "")
        as_theirs = work_per_token(tc, theirs_ac, theirs_fp8, theirs_objective)
        theirs = m.flops_per_token * as_theirs.effective / as_theirs.counted
        their_dim = hidden_size(m.shape or "")
        size, said = size_ratio(their_dim, tc.model.dim, m.size_fit, bool(hw.gpu)) if their_dim else (1.0, "")
        flops_ratio, kind = theirs / mine.effective * size, "transferred"
        # a val pass is a forward: nothing recomputed, FP8 on the forward's share only
        forward_ratio = m.flops_per_token * as_theirs.effective_forward / as_theirs.counted / mine.effective_forward
        forward_ratio *= size
        what = f"shape {m.shape}"
        scaled += (
            f"; its {m.tokens_per_s * theirs / 1e9:,.1f} GFLOP/s at"
            f" {mine.effective / 1e6:,.2f} MFLOP/token of work instead of {theirs / 1e6:,.2f}"
        ) + (f", {said}" if said else "")
    return Throughput(
        tokens_per_s=m.tokens_per_s * nodes_ratio * flops_ratio,
        val_pass_s=m.val_pass_s * val_ratio / nodes_ratio / forward_ratio,
        overhead_s=m.overhead_s,
        kind=kind,
        source=(
            f"{kind}: run {m.run_id[:12]} ({m.steps} steps of {what} on {accelerator}):"
            f" {m.tokens_per_s:,.0f} tok/s{scaled}, overhead {m.overhead_s:.1f} s, val pass {m.val_pass_s:.2f} s"
        ),
        run_id=m.run_id,
    )


def prior_throughput(cfg: ConfigLike, hw: Hardware, backend: str) -> Throughput:
    """No measured run: a stated prior per accelerator (MFU of its peak) or per CPU core."""
    tc = typed(cfg)
    t = tc.train
    w = work_per_token(cfg)
    dtype = t.dtype.on("cuda" if hw.gpu else "cpu")  # auto: what the trainer will run
    if hw.gpu:
        peak = peak_for(hw.gpu, dtype)
        peak_note = (
            f"{dtype} peak {peak:g} TFLOP/s" if peak else f"unknown peak, assumed {UNKNOWN_GPU_TFLOPS:g} TFLOP/s"
        )
        flops_s = MFU_PRIOR * (peak or UNKNOWN_GPU_TFLOPS) * 1e12 * hw.devices
        source = f"prior: {MFU_PRIOR:.0%} MFU of {hw.gpu} {peak_note} x {hw.devices} GPU(s)"
        overhead = OVERHEAD_PRIOR_S["sky" if backend == "sky" else "local-gpu"]
    else:
        flops_s = CPU_GFLOPS_PER_CORE * 1e9 * hw.cores_per_node * hw.nodes
        source = (
            f"prior (rough): CPU at {CPU_GFLOPS_PER_CORE:g} GFLOP/s per core x {hw.cores_per_node} core(s)"
            f" x {hw.nodes} node(s)"
        )
        overhead = OVERHEAD_PRIOR_S["sky" if backend == "sky" else "local-cpu"]
    val_tokens = t.val_batches * sequences_per_step(t) * t.seq_len
    return Throughput(
        tokens_per_s=flops_s / w.effective,
        val_pass_s=val_tokens * w.effective_forward / flops_s,
        overhead_s=overhead,
        kind="prior",
        source=f"{source}; no FINISHED run of this shape on {hw.accelerator} in MLflow"
        f" (fixed overhead prior {overhead:g} s)",
    )


# ----------------------------------------------------------------------------- prices


@dataclass
class Price:
    """$/h of the whole job (all nodes) for one way of getting the hardware."""

    label: str
    usd_per_hour: float
    spot: bool
    source: str
    priced: bool = True  # False: nobody said what this infra costs (usd_per_hour is then 0, not a price)


def catalog_prices(offers_by_mode: Mapping[bool, list[Any]]) -> list[Price]:
    """Catalog offers (``Plan.offers``: on-demand under False, spot under True) → prices, cheapest
    first per mode. An offer has ``provider``, ``instance_type``, ``region``, ``per_node_hour``,
    ``nodes`` and ``total_hour`` (``backends.sky_rules.Offer``)."""
    on_demand = {(o.instance_type, o.region): o.total_hour for o in offers_by_mode.get(False, [])}
    out = []
    for spot, found in offers_by_mode.items():
        for o in found:
            # a catalog that lists no spot price repeats the on-demand one (RunPod's): said, not hidden
            same = spot and on_demand.get((o.instance_type, o.region)) == o.total_hour
            mode = ("spot (= on-demand)" if same else "spot") if spot else "on-demand"
            out.append(
                Price(
                    label=f"{o.provider} {o.instance_type} {o.region} {mode}",
                    usd_per_hour=o.total_hour,
                    spot=spot,
                    source=f"SkyPilot catalog: ${o.per_node_hour:.2f}/h per node x {o.nodes} node(s)",
                )
            )
    return sorted(out, key=lambda p: (p.spot, p.usd_per_hour))


UNPRICED_FIX = "set infra.price_per_gpu_hour=<$ per GPU-hour> to price it"


def configured_price(infra: Mapping[str, Any], hw: Hardware) -> Price:
    """``infra.price_per_gpu_hour`` x GPUs (a CPU node counts as one device): Slurm, local, no catalog row.

    Not set: this machine's own CPU costs nothing ($0); anything else (Slurm, local GPUs) is unpriced,
    not $0, so that a budget is never silently unenforceable."""
    unit = "GPU" if hw.gpus_per_node else "node"
    spot = bool(infra.get("use_spot"))
    if infra.get("price_per_gpu_hour") is None:
        if infra.get("kind") == "local" and not hw.gpus_per_node:
            return Price(
                label=f"{infra['name']} (this machine's CPU)",
                usd_per_hour=0.0,
                spot=spot,
                source="your own CPU: $0 (infra.price_per_gpu_hour=<$ per hour> to charge for it)",
            )
        return Price(
            label=str(infra["name"]),
            usd_per_hour=0.0,
            spot=spot,
            priced=False,
            source=f"no catalog price; {UNPRICED_FIX}",
        )
    rate = float(infra["price_per_gpu_hour"])
    return Price(
        label=f"{infra['name']} at ${rate:g}/{unit}-h",
        usd_per_hour=rate * hw.devices,
        spot=spot,
        source=f"infra.price_per_gpu_hour ${rate:g} x {hw.devices} {unit}(s)",
    )


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
    work: Optional[Work] = None  # recompute and FP8, as the throughput assumed them
    lora: bool = False  # model.lora.rank > 0: the frozen base's weight gradients are not computed
    # train.objective=dpo: "batch_size pairs x 2 sequences" per step, and the reference it counted
    # ("frozen copy" / "base with adapters off"); None for lm
    dpo: Optional[str] = None
    batch_size: int = 0
    seq_len: int = 0
    command: Optional[str] = None  # workload=command: the program; its hours come from ``throughput``

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
    def priced(self) -> bool:
        return self.price.priced

    @property
    def total_text(self) -> str:
        """The total as every line shows it: dollars, or ``unpriced``."""
        return f"${self.total_usd:,.2f}" if self.priced else "unpriced"

    @property
    def over_budget(self) -> bool:
        return self.max_cost is not None and self.total_usd > self.max_cost

    def budget_refusal(self) -> Optional[str]:
        """Why ``--max-cost`` cannot be honoured here (None when it can): an unpriced infra has no spend
        to stop at, and a $0 price would turn the in-run guard off without a word."""
        if self.max_cost is None or self.priced:
            return None
        return (
            f"--max-cost ${self.max_cost:,.2f} cannot be enforced: infra '{self.price.label}' is unpriced (no"
            " catalog price, no infra.price_per_gpu_hour), so its spend cannot be tracked."
            " Fix: infra.price_per_gpu_hour=<$ per GPU-hour>"
        )

    def describe(self) -> str:
        if self.command is not None:
            return self._describe_command()
        formula = "4N + 6 x adapter params + 12*L*H*Q*T: LoRA's frozen base" if self.lora else "6N + 12*L*H*Q*T"
        if self.dpo:
            formula += "; + 2N + 4*L*H*Q*T: the DPO reference's forward"
        per_step = f" ({self.steps} steps x {self.batch_size} pairs x 2 sequences x {self.seq_len})" if self.dpo else ""
        lines = [
            "# cost estimate",
            f"model:       N = {self.n_params:,} params (no input embedding);"
            f" {self.flops_per_token / 1e6:,.2f} MFLOP/token ({formula})",
            f"compute:     {self.tokens:,} tokens{per_step} x FLOPs/token = {self.flops:.3e} FLOPs",
            *self._reference_lines(),
            *(f"{label + ':':<12} {text}" for label, text in self.assumed()),
            f"throughput:  {self.throughput.tokens_per_s:,.0f} tok/s"
            f" on {self.hw.nodes} node(s) of {self.hw.accelerator}",
            f"  source:    {self.throughput.source}",
            f"wall time:   {_dur(self.wall_s)} = overhead {self.throughput.overhead_s:.0f} s"
            f" + train {_dur(self.train_s)}"
            f" + {self.val_passes} val pass(es) x {self.throughput.val_pass_s:.2f} s;"
            f" {self.device_hours:,.3f} device-hours",
            *self._price_lines()[:1],
            f"total:       {self.total_text} estimated",
            *self._price_lines()[1:],
        ]
        return "\n".join(lines)

    def _reference_lines(self) -> list[str]:
        """DPO: what the estimate counted for the reference (none for lm)."""
        w = self.work
        if not self.dpo or w is None or not w.reference:
            return []
        return [
            f"reference:   train.objective=dpo: each step also runs the reference's forward ({self.dpo}, no"
            f" gradients) over the same 2 x {self.batch_size} sequences: +{w.reference / 1e6:,.2f} MFLOP/token"
            f" (2N + 4*L*H*Q*T), counted above ({w.counted / w.model:.3f}x the policy's {w.model / 1e6:,.2f})"
        ]

    def _price_lines(self) -> list[str]:
        """The price line, the max-cost verdict and the offers: the same for every workload."""
        lines = [
            (
                f"price:       ${self.price.usd_per_hour:,.2f}/h ({self.price.label}; {self.price.source})"
                if self.priced
                else f"price:       unpriced ({self.price.label}: {self.price.source})"
            )
        ]
        if self.budget_refusal():
            lines.append(f"max cost:    ${self.max_cost:,.2f} (REFUSED: launch will refuse: {self.budget_refusal()})")
        elif self.max_cost is not None:
            verdict = "OVER: launch will refuse" if self.over_budget else "within"
            lines.append(
                f"max cost:    ${self.max_cost:,.2f} ({verdict}); a running job stops after a checkpoint"
                " when its spend would pass it"
            )
        if self.offers:
            lines.append(f"{'offer':<52} {'$/h':>9} {'total $':>10}")
            for p in self.offers:
                lines.append(f"{p.label[:52]:<52} {p.usd_per_hour:>9,.2f} {self.cost_at(p):>10,.2f}")
        return lines

    def _describe_command(self) -> str:
        """A user's program: no model to count, so hours are given (``workload.hours``) or measured
        (an earlier FINISHED run of the same command on the same hardware), and the price is per hour."""
        known = self.throughput.kind != "unknown"
        lines = [
            "# cost estimate",
            f"workload:    {self.command}",
            f"wall time:   {_dur(self.wall_s) if known else 'unknown'} ({self.throughput.source})",
            *self._price_lines()[:1],
            f"total:       {self.total_text + ' estimated' if known else 'unknown: set workload.hours=<hours>'}"
            + (f"; {self.device_hours:,.3f} device-hours" if known else ""),
            *self._price_lines()[1:],
        ]
        return "\n".join(lines)

    def assumed(self) -> list[tuple[str, str]]:
        """Recompute and FP8 as this estimate counts them: a measured run of this shape (its key
        holds both) already paid for them; otherwise the work model's terms and their evidence."""
        w = self.work
        if w is None:
            return []
        if self.throughput.kind == "measured":
            return [
                (
                    "assumes",
                    f"parallel.ac={w.ac}, train.fp8={w.fp8} as the measured run of this shape ran them"
                    " (its tokens/s includes their cost)",
                )
            ]
        return w.assumed()

    def to_json(self) -> dict[str, Any]:
        return {
            "n_params": self.n_params,
            "flops_per_token": self.flops_per_token,
            **({"objective": "dpo", "reference": self.dpo} if self.dpo else {}),
            "work": None if self.work is None else {**asdict(self.work), "effective": self.work.effective},
            "steps": self.steps,
            "tokens": self.tokens,
            "flops": self.flops,
            "val_passes": self.val_passes,
            "hardware": {**asdict(self.hw), "devices": self.hw.devices},
            "throughput": asdict(self.throughput),
            "train_s": self.train_s,
            "wall_s": self.wall_s,
            "device_hours": self.device_hours,
            "price": asdict(self.price),
            "total_usd": self.total_usd if self.priced else None,
            "offers": [{**asdict(p), "total_usd": self.cost_at(p)} for p in self.offers],
            "max_cost": self.max_cost,
        }


def _dur(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def estimate(
    cfg: Mapping[str, Any],
    hw: Hardware,
    backend: str,
    *,
    measured: Optional[Measured] = None,
    catalog: Optional[list[Price]] = None,
    max_cost: Optional[float] = None,
    tc: Optional[TrainerCfg] = None,
) -> Estimate:
    """The estimate for a resolved config (``tc``: its typed view, when the caller holds one), from
    explicit evidence (pure: tests hand-compute it)."""
    tc = typed(cfg) if tc is None else tc
    t, model = tc.train, tc.model
    steps, batch, seq = t.steps, t.batch_size, t.seq_len
    throughput = (
        measured_throughput(measured, tc, hw, hw.accelerator) if measured else prior_throughput(tc, hw, backend)
    )
    catalog = catalog or []
    work = work_per_token(tc)
    dpo = None
    if t.objective == "dpo":
        dpo = "the base with adapters off" if model.lora.rank else "a frozen copy of the starting weights"
    return Estimate(
        n_params=num_params(model),
        flops_per_token=work.counted,  # 6N + 12LHQT (LoRA: 4N + ...); DPO: + the reference's 2N + 4LHQT
        steps=steps,
        tokens=steps * sequences_per_step(t) * seq,
        val_passes=val_passes(steps, t.val_every),
        hw=hw,
        throughput=throughput,
        price=choose_price(cfg["infra"], hw, catalog),
        offers=catalog,
        max_cost=max_cost,
        work=work,
        lora=bool(model.lora.rank),
        dpo=dpo,
        batch_size=batch,
        seq_len=seq,
    )


def command_key(cfg: Mapping[str, Any]) -> str:
    """What makes two command runs' wall times comparable (tag ``llmctl.shape``): the program with
    its arguments (``workload.args`` included: a sweep's trials differ) and the processes per node."""
    from workloads.protocol.command import program

    wl = cfg["workload"]
    return "command:" + " ".join(program(wl)) + f" torchrun={bool(wl.get('torchrun'))}"


def command_estimate(
    cfg: Mapping[str, Any],
    hw: Hardware,
    *,
    measured: Optional[tuple[str, float]] = None,
    catalog: Optional[list[Price]] = None,
    max_cost: Optional[float] = None,
) -> Estimate:
    """The estimate of a command workload: ``workload.hours`` if given, else ``measured`` (run id,
    billed wall seconds of an earlier FINISHED run of the same command on this hardware), else
    unknown (the price per hour stands alone)."""
    from workloads.protocol.command import program

    hours = cfg["workload"].get("hours")
    if hours is not None:
        wall, kind, source = float(hours) * 3600.0, "given", f"workload.hours={hours:g}"
    elif measured is not None:
        wall, kind = measured[1], "measured"
        source = f"measured: FINISHED run {measured[0]} of the same command on {hw.accelerator}"
    else:
        wall, kind, source = 0.0, "unknown", "no workload.hours and no FINISHED run of this command here"
    catalog = catalog or []
    return Estimate(
        n_params=0,
        flops_per_token=0,
        steps=0,
        tokens=0,
        val_passes=0,
        hw=hw,
        throughput=Throughput(1.0, 0.0, wall, kind, source, measured[0] if measured and kind == "measured" else None),
        price=choose_price(cfg["infra"], hw, catalog),
        offers=catalog,
        max_cost=max_cost,
        command=" ".join(program(cfg["workload"])),
    )
