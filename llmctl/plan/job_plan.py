"""The plan: what will run, where, how and tracked where — a plain value, printed by ``plan``.

``launch`` executes exactly the plan that ``plan`` prints, so what a user reviewed is what runs.
A backend fills one in (``Backend.plan``); ``planner.make_plan`` adds the cost estimate.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Optional

from llmctl.config.compose import to_yaml
from llmctl.plan.devices import Hardware
from llmctl.tracking.mlflow_run import redact
from workloads.protocol.config import ConfigLike, typed


def kernel_lines(cfg: ConfigLike, gpu: bool) -> list[str]:
    """The compute dtype, loss kernel and attention the trainer will run, from the config and the
    target alone (the plan imports no torch): what ``train.dtype=auto`` and ``model.loss_kernel``
    resolve to. The trainer's first lines name the kernels it actually got."""
    tc = typed(cfg)  # the plan passes its typed view (returned as it is); tests, partial dicts
    m, dtype = tc.model, tc.train.dtype
    compute = dtype.on("cuda" if gpu else "cpu")
    why = " (train.dtype=auto" + (", TF32 for fp32 matmuls)" if gpu else ")") if dtype == "auto" else ""
    if m.kernels == "reference":
        loss, attention = "full logits + F.cross_entropy (reference kernels)", "explicit softmax (reference kernels)"
    else:
        if tc.parallel.tp > 1:
            loss = "vocab-parallel F.cross_entropy (tensor parallel)"
        elif tc.train.objective == "dpo":  # each token's loss: the fused kernels' scalar cannot carry it
            loss = "per-token chunked CE (DPO: a chunk's logits at a time, recomputed in backward)"
        elif m.loss_kernel == "liger" or (m.loss_kernel == "auto" and gpu):
            loss = "liger (Triton fused linear-CE)"
            if m.loss_kernel == "auto":
                loss += " if liger-kernel imports on the nodes, else chunked"
        else:
            loss = "chunked (PyTorch fused linear-CE)"
        attention = (
            "SDPA; torch picks cuDNN or flash on CUDA at start, the trainer logs which"
            if gpu
            else "SDPA (CPU: its flash kernel)"
        )
    return [f"dtype:       {compute}{why}", f"loss kernel: {loss}", f"attention:   {attention}"]


def count(n: int) -> str:
    """A parameter count as people write it (41.9M, 8.07B), exact below a million: a small model's
    adapter reads ``19,456``, not ``0.0M``."""
    if n < 1_000_000:
        return f"{n:,}"
    return f"{n / 1e6:,.1f}M" if n < 1_000_000_000 else f"{n / 1e9:,.2f}B"


def lora_lines(cfg: ConfigLike, gpu: bool) -> list[str]:
    """What a LoRA run trains and what it freezes, from the config alone (``protocol.shape``, the
    counts the trainer's own LoRA line prints once the model exists): a user sizing an adapter sees
    its parameters and the NF4 base's bytes before paying. None without ``model.lora.rank``."""
    from workloads.protocol import shape

    tc = typed(cfg)
    m = tc.model
    if not m.lora.rank:
        return []
    trainable, total = shape.lora_params(m), shape.lora_total_params(m)
    compute = 2 if tc.train.dtype.on("cuda" if gpu else "cpu") == "bf16" else 4  # NF4 scale factors
    nf4 = shape.nf4_base_bytes(m, compute)
    held = "bf16" if compute == 2 else "fp32"  # the frozen weights' dtype: the compute dtype (lora.hold_frozen_in)
    base = f"targets' weights in nf4: {nf4 / 2**30:.2f} GiB, the rest in {held}" if nf4 else f"unquantized, {held}"
    return [
        f"lora:        rank {m.lora.rank}, alpha {m.lora.alpha:g} on {','.join(m.lora.targets)}:"
        f" {count(trainable)} trainable params ({trainable / total:.2%} of {count(total)}, as PEFT"
        f" counts); base frozen, no gradients or AdamW states ({base})"
    ]


def dpo_lines(cfg: ConfigLike, memory: Any = None) -> list[str]:
    """``train.objective=dpo``: the loss, and what the memory plan and the estimate counted for the
    reference (the memory plan's own figure for a copy, when there is one). None for lm."""
    tc = typed(cfg)
    if tc.train.objective != "dpo":
        return []
    opts = tc.train.dpo
    loss = f"{opts.loss.value}, beta {opts.beta:g}" + (
        f", label smoothing {opts.label_smoothing:g}" if opts.loss == "robust" else ""
    )
    if tc.model.lora.rank:
        reference = "the base with adapters off (LoRA), no second copy"
    else:
        plan = getattr(memory, "plan", None)
        dtype = plan.layout.get("dtype") if plan is not None else "compute dtype"
        reference = f"frozen copy ({dtype}, sharded like the policy)"
        if plan is not None:  # its shards in the compute dtype
            reference += f" +{plan.reference / 2**30:.2f} GiB/device"
    return [
        f"objective:   dpo | {loss} | reference: {reference}; its forward over the same sequences counted in the"
        " estimate"
    ]


@dataclass
class Plan:
    cfg: dict[str, Any]
    choices: dict[str, Optional[str]]
    backend: str
    where: str
    nodes: int
    nproc_per_node: int
    layout: dict[str, int]
    device: str
    command: list[str]
    tracking_uri: str
    hardware: Hardware
    # catalog offers by mode (False: on-demand, True: spot), cheapest first; empty off the catalog
    offers: dict[bool, list[Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # what `launch` would refuse and why (the backend's preflight raises it): shown, not hidden
    refusals: list[str] = field(default_factory=list)
    estimate: Any = None  # llmctl.cost.estimate.Estimate, filled by planner.make_plan
    memory: Any = None  # llmctl.plan.memory_fit.MemoryFit, filled by planner.make_plan
    # what the job runs: "train" (the workload: the trainer or a user's program), or "score" (lm-eval
    # on one checkpoint: ``llmctl eval RUN --tasks`` as a job on the run's infra, attached to the run)
    job: str = "train"
    parallelize: bool = False  # a "score" job: the model spread over the node's GPUs (lm-eval's parallelize)
    # the trainer's typed view of ``cfg`` (``Composed.typed`` with the backend's resolved layout): what the
    # memory plan, the estimate and the checks read; ``set_values`` changes both together
    typed: Any = None
    # ``infra.candidates``: every provider the run may land on (``llmctl.plan.candidates.Candidate``),
    # the index of the one SkyPilot tries first (whose hardware, memory plan and estimate the plan's
    # own are) and how SkyPilot picks (``infra.pick``); empty for a one-provider plan
    candidates: list[Any] = field(default_factory=list)
    first_candidate: int = 0
    pick: str = "ordered"

    def set_values(self, section: str, **values: Any) -> None:
        """Keys of one section changed in ``cfg`` and in ``typed`` at once (nothing is typed again)."""
        from workloads.protocol.config import with_values

        self.cfg = {**self.cfg, section: {**self.cfg[section], **values}}
        self.typed = with_values(self.typed, section, **values)

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def describe(self) -> str:
        """Human summary (no secrets): the resolved config and how it would run."""
        from llmctl.config.notify import masked
        from llmctl.config.workload import is_command, shown

        lay = self.layout
        checkpoint = self.cfg["checkpoint"]["dir"] or "llmctl-runs/<run-id>/checkpoints"
        lines = [
            "# resolved config",
            to_yaml(shown(masked(self.cfg))).rstrip(),
            "",
            "# plan",
            f"where:       {self.where}",
            f"processes:   {self.nodes} node(s) x {self.nproc_per_node} = {self.world_size} on {self.device}",
        ]
        if is_command(self.cfg):
            from workloads.protocol.command import program

            wl = self.cfg["workload"]
            how = "under torchrun, one per process" if wl.get("torchrun") else "one per node"
            lines.append(f"program:     {redact(shlex.join(program(wl)))} ({how}, from the launch directory)")
        else:
            lines += [
                f"mesh:        dp_replicate={lay['dp_replicate']} dp_shard={lay['dp_shard']} tp={lay['tp']}",
                *kernel_lines(self.typed, bool(self.hardware.gpus_per_node)),
                *lora_lines(self.typed, bool(self.hardware.gpus_per_node)),
                *dpo_lines(self.typed, self.memory),
                *benchmark_lines(self.cfg),
                tokens_line(self.typed),
            ]
        lines += [
            f"command:     {redact(shlex.join(self.command))}",
            f"tracking:    {redact(self.tracking_uri)} (experiment '{self.cfg['tracking']['experiment']}')",
            f"checkpoints: {redact(checkpoint)}",
        ]
        lines += [f"note:        {n}" for n in self.notes]
        lines += [f"refused:     `llmctl launch` will refuse: {r}" for r in self.refusals]
        if self.candidates:
            from llmctl.plan.candidates import lines as candidate_lines

            lines += ["", *candidate_lines(self)]
        if self.memory is not None:
            lines += ["", self.memory.describe()]
        if self.estimate is not None:
            lines += ["", self.estimate.describe()]
        return "\n".join(lines)


def tokens_line(cfg: ConfigLike) -> str:
    """The tokens a run trains on: steps x sequences x seq_len (DPO: each of batch_size pairs is two sequences)."""
    from workloads.protocol.shape import sequences_per_step

    t = typed(cfg).train
    total = t.steps * sequences_per_step(t) * t.seq_len
    each = f"{t.batch_size} pairs x 2" if t.objective == "dpo" else f"{t.batch_size}"
    return f"tokens:      {total:,} ({t.steps} steps x {each} x {t.seq_len})"


def benchmark_lines(cfg: dict[str, Any]) -> list[str]:
    """``eval.tasks``: what lm-eval scores during training and at which steps. Its time is the tasks'
    and the device's (unknown before a first scoring), so the wall time and cost below leave it out."""
    ev = cfg.get("eval") or {}
    tasks = list(ev.get("tasks") or [])
    if not tasks:
        return []
    steps, every = int(cfg["train"]["steps"]), int(ev.get("every") or cfg["checkpoint"]["every"] or 0)
    at = sorted({*(range(every, steps + 1, every) if every else ()), steps})
    when = f"step(s) {', '.join(map(str, at))}" if len(at) <= 6 else f"{len(at)} steps (every {every} and the last)"
    return [f"lm-eval:     {', '.join(tasks)} at {when}; its time is not in the estimate below"]
