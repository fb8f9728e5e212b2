"""Will it fit? The workload's memory plan against the device's memory, and the cheapest fix if not.

The per-device estimate is the trainer's own (``workloads.planner.memory_plan``, stdlib only, held
against torch's memory tracker by tests/trainer/test_memory_plan.py); the device's memory comes from SkyPilot's catalog
(``device_memory``) for cloud GPUs (on Slurm, the same GPU name in the clouds' catalogs), ``nvidia-smi`` for
local GPUs, and this machine's RAM shared by its processes on CPU, unless ``infra.device_memory_gib`` says.
``launch`` and ``resume`` refuse a job whose plan exceeds the usable memory (``RESERVE``: CUDA context,
workspaces and allocator slack that no tensor accounts for), naming the cheapest change that fits,
unless told ``--ignore-memory-plan``.
``parallel.grad_sync=auto`` is decided here: gradients reduced once per step where that fits, else
after every micro-batch (FSDP keeps them sharded).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any, Optional

GIB = 2**30
# not in any tensor plan: CUDA context, cuBLAS/NCCL workspaces, caching-allocator fragmentation
RESERVE_FRACTION, RESERVE_BYTES = 0.05, 1 * GIB

# What each change costs in throughput, roughly (for ranking fixes, not for reporting): recomputing
# in backward costs a share of a forward; a smaller micro-batch only utilisation; TP and
# un-replicating cost communication.
_AC_COST = {"none": 0.0, "selective": 0.10, "full": 0.33}
_HALVING_COST = 0.02
_TP_COST = 0.08
_UNREPLICATE_COST = 0.03
_SYNC_EACH_COST = 0.02  # a reduce-scatter per micro-batch instead of per step, mostly overlapped


@dataclass
class MemoryFit:
    """The plan per device, the device's usable memory (None: unknown) and a fix when it does not fit."""

    plan: Any  # workloads.planner.memory_plan.MemoryPlan
    device_bytes: Optional[int]
    device_label: str
    fix: list[str] = field(default_factory=list)  # overrides that make it fit
    fixed_plan: Any = None
    # eval.tasks: (the trainer's bytes kept on rank 0's device while lm-eval runs, lm-eval's model's)
    scoring: Optional[tuple[int, int]] = None

    @property
    def usable(self) -> Optional[int]:
        if self.device_bytes is None:
            return None
        return max(0, int(self.device_bytes * (1 - RESERVE_FRACTION)) - RESERVE_BYTES)

    @property
    def fits(self) -> Optional[bool]:
        return None if self.usable is None else self.plan.total <= self.usable

    @property
    def scoring_fits(self) -> Optional[bool]:
        """Whether in-training lm-eval's model fits beside what the trainer keeps (None: no
        ``eval.tasks``, or the device's size unknown)."""
        if self.scoring is None or self.usable is None:
            return None
        return sum(self.scoring) <= self.usable

    def scoring_verdict(self) -> str:
        """The plan's line for ``eval.tasks``: the second process on rank 0's device, and whether it fits."""
        if self.scoring is None:
            return ""
        kept, model = self.scoring
        dtype = "bf16" if self.plan.layout.get("device") == "cuda" else "fp32"
        line = (
            f"lm-eval during training: the trainer keeps {kept / GIB:.1f} GiB (parameter shards, AdamW) on rank 0's"
            f" device beside lm-eval's {dtype} model ({model / GIB:.1f} GiB): {sum(self.scoring) / GIB:.1f} GiB"
            " before lm-eval's batches"
        )
        if self.scoring_fits is None:
            return line
        if self.scoring_fits:
            return f"{line}; fits in the usable {self.usable / GIB:.1f} GiB"
        return (
            f"{line}; DOES NOT FIT in the usable {self.usable / GIB:.1f} GiB. Fix: leave eval.tasks out and score"
            " the checkpoints after training (`llmctl eval RUN --tasks ...`: a job of its own; --parallelize"
            " spreads a model larger than one GPU over a node's)"
        )

    def verdict(self) -> str:
        if self.fits is None:
            return (
                f"fit unknown: no memory size for {self.device_label}."
                " Fix: infra.device_memory_gib=<GiB per device> to hold the job against it"
            )
        share = self.plan.total / self.device_bytes
        head = (
            f"{'fits' if self.fits else 'DOES NOT FIT'}: {self.plan.total / GIB:.1f} GiB of "
            f"{self.device_bytes / GIB:.0f} GiB per {self.device_label} ({share:.0%}; usable "
            f"{self.usable / GIB:.1f} GiB after {RESERVE_FRACTION:.0%} + {RESERVE_BYTES / GIB:.0f} GiB reserve)"
        )
        if self.fits:
            return head
        if not self.fix:
            return (
                head + "; no change of micro-batch, checkpointing, sharding or TP fits: more devices or a smaller model"
            )
        return head + f"; cheapest fix: {' '.join(self.fix)} ({self.fixed_plan.total / GIB:.1f} GiB)"

    def describe(self) -> str:
        scoring = f"\n  {self.scoring_verdict()}" if self.scoring else ""
        return f"{self.plan.describe()}\n  {self.verdict()}{scoring}"


def device_memory(plan: Any) -> tuple[Optional[int], str]:
    """(bytes one process may use, label): a GPU's memory, or this machine's RAM shared by its processes."""
    hw = plan.hardware
    given = plan.cfg["infra"].get("device_memory_gib")
    if given is not None:  # the user's figure (a MIG slice, a GPU the catalog lacks, a shared machine)
        return int(float(given) * GIB), f"{hw.gpu or 'CPU process'} (infra.device_memory_gib)"
    if hw.gpu:
        gib, source = _catalog_gib(plan)
        gib = gib or _local_gpu_gib(plan) or _gib_in_name(hw.gpu)
        return (int(gib * GIB) if gib else None), hw.gpu + (f" ({source})" if source else "")
    if plan.backend == "local":
        ram = _this_machine_ram()
        return (ram // max(1, plan.nproc_per_node) if ram else None), "CPU process (this machine's RAM shared)"
    return None, "CPU node"


def _catalog_gib(plan: Any) -> tuple[Optional[float], str]:
    """(GiB, where from: "" for the provider's own catalog). A provider whose catalog lists no memory
    (Slurm) gets the same GPU name's memory from the clouds' catalogs (``rules.listed_memory_gib``)."""
    if plan.backend == "local" or not plan.hardware.gpu:
        return None, ""
    from llmctl.backends.sky.rules import accelerator_memory_gib, listed_memory_gib

    gpu = plan.hardware.gpu
    own = accelerator_memory_gib(plan.cfg["infra"].get("provider"), gpu)
    if own:
        return own, ""
    gib, clouds = listed_memory_gib(gpu)
    return gib, (f"as SkyPilot's {'/'.join(clouds)} catalog lists it" if gib else "")


def _gib_in_name(name: str) -> Optional[float]:
    m = re.search(r"(\d+)\s*GB", name, re.I)
    return float(m.group(1)) if m else None


def _local_gpu_gib(plan: Any) -> Optional[float]:
    if plan.backend != "local":
        return None
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split()
        return float(out[0]) / 1024 if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _this_machine_ram() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _device_type(plan: Any) -> str:
    return "cuda" if plan.hardware.gpu else "cpu"


def check(plan: Any) -> MemoryFit:
    """The memory plan of ``plan`` against its device, with the cheapest fix when it does not fit.

    Resolves ``parallel.grad_sync=auto`` in ``plan.cfg`` (what the trainer is given): ``step``, one
    reduction per optimizer step, unless only reducing after each micro-batch fits."""
    from workloads.planner.memory_plan import plan_memory
    from workloads.protocol.config import with_values

    device = _device_type(plan)
    auto = str(plan.cfg["parallel"].get("grad_sync", "auto")) == "auto"
    if auto:
        plan.set_values("parallel", grad_sync="step")
    mem = plan_memory(plan.typed, plan.world_size, device)
    capacity, label = device_memory(plan)
    fit = MemoryFit(mem, capacity, label)
    if auto and fit.fits is False:
        each = plan_memory(with_values(plan.typed, "parallel", grad_sync="micro_batch"), plan.world_size, device)
        if each.total < mem.total:
            plan.set_values("parallel", grad_sync="micro_batch")
            fit = MemoryFit(each, capacity, label)
    if fit.fits is False:
        found = cheapest_fix(plan.cfg, plan.world_size, device, fit.usable, plan.hardware.gpus_per_node or 1)
        if found:
            fit.fix, fit.fixed_plan = found
    if (plan.cfg.get("eval") or {}).get("tasks"):
        from workloads.planner.memory_plan import scoring_memory

        fit.scoring = scoring_memory(plan.typed, fit.plan)
    return fit


def _candidates(cfg: dict[str, Any], world: int, gpus_per_node: int):
    """(cost, overrides, cfg) for each combination of the changes that lower memory."""
    import copy
    import itertools

    from workloads.protocol.config import typed
    from workloads.protocol.validate import ConfigError, resolve_layout

    train, par, model = cfg["train"], cfg["parallel"], cfg["model"]
    ac_now = str(par["ac"])
    acs = [a for a in ("none", "selective", "full") if _AC_COST[a] >= _AC_COST.get(ac_now, 0)]
    tps = [
        t
        for t in (1, 2, 4, 8)
        if t >= par["tp"] and t <= gpus_per_node and model["n_heads"] % t == 0 and model["n_kv_heads"] % t == 0
    ]
    replicate = [False, True] if par["dp_replicate"] > 1 else [False]
    sync_now = str(par.get("grad_sync", "auto"))
    syncs = [sync_now, "micro_batch"] if sync_now != "micro_batch" else [sync_now]
    for unrep, tp, ac, sync in itertools.product(replicate, tps, acs, syncs):
        c = copy.deepcopy(cfg)
        c["parallel"].update(ac=ac, tp=tp, grad_sync=sync)
        over, cost = [], _AC_COST[ac] - _AC_COST.get(ac_now, 0)
        if ac != ac_now:
            over.append(f"parallel.ac={ac}")
        if sync != sync_now:
            over.append(f"parallel.grad_sync={sync}")
            cost += _SYNC_EACH_COST
        if tp != par["tp"]:
            over.append(f"parallel.tp={tp}")
            cost += _TP_COST * (tp // par["tp"]).bit_length()
        if unrep:
            c["parallel"].update(dp_replicate=1, dp_shard=-1)
            over += ["parallel.dp_replicate=1", "parallel.dp_shard=-1"]
            cost += _UNREPLICATE_COST
        elif tp != par["tp"] and par["dp_shard"] != -1:
            c["parallel"]["dp_shard"] = -1
            over.append("parallel.dp_shard=-1")
        try:
            layout = resolve_layout(typed(c), world)
        except ConfigError:
            continue
        local = train["batch_size"] // (layout["dp_replicate"] * layout["dp_shard"])
        micro, halvings = train.get("micro_batch_size") or local, 0
        while micro >= 1 and local % micro == 0:
            m = copy.deepcopy(c)
            m["train"]["micro_batch_size"] = micro
            extra = [f"train.micro_batch_size={micro}"] if halvings else []
            yield cost + _HALVING_COST * halvings, over + extra, m
            if micro == 1:
                break
            micro, halvings = micro // 2, halvings + 1


def cheapest_fix(
    cfg: dict[str, Any], world: int, device: str, usable: int, gpus_per_node: int
) -> Optional[tuple[list[str], Any]]:
    """(overrides, plan) of the cheapest change that brings the plan under ``usable`` bytes."""
    from workloads.planner.memory_plan import plan_memory
    from workloads.protocol.config import typed

    best = None
    for cost, overrides, candidate in _candidates(cfg, world, gpus_per_node):
        if not overrides or (best and cost >= best[0]):
            continue
        mem = plan_memory(typed(candidate), world, device)
        if mem.total <= usable:
            best = (cost, overrides, mem)
    return (best[1], best[2]) if best else None


def dry_run(plan: Any) -> str:
    """``plan --dry-run``: the trainer's model built on meta and parallelised at the plan's world
    size under a fake process group (``python -m workloads.pretrain.dry_run``, a process of its own:
    llmctl imports only the protocol and the planner), against the memory plan."""
    from llmctl.backends.trainer_entry import run_trainer_entry

    r = json.loads(run_trainer_entry("dry_run", plan.cfg, "--world-size", str(plan.world_size)).splitlines()[-1])
    lay = r["layout"]
    lines = [
        f"# dry run: the model built on meta, parallelised for world {r['world_size']} (dp_replicate "
        f"{lay['dp_replicate']} x dp_shard {lay['dp_shard']} x tp {lay['tp']}, fake process group) in "
        f"{r['seconds']:.1f} s",
        f"parameters:  {r['params_total']:,} in all, {r['params_per_rank']:,} on rank 0 = "
        f"{r['param_bytes_per_rank'] / GIB:.2f} GiB fp32",
    ]
    if r["wq_placements"]:
        lines.append(f"layers.0.attention.wq placements: {', '.join(r['wq_placements'])}")
    if plan.memory is not None:
        lines.append(f"memory plan: parameters {plan.memory.plan.params / GIB:.2f} GiB per device (with buffers)")
    return "\n".join(lines)
