"""How close is the memory plan to torch's own tracker? Every case of ``memory_tracker.CASES``.

    python benchmarks/memory_plan.py

For each case (shape, layout: world 1 / FSDP / TP / FSDP+TP / HSDP+TP, AC mode, micro-batching,
dtype), ``memory_plan.plan_memory`` (stdlib, from the config alone) against
``memory_tracker.tracked_peak`` (``FSDPMemTracker`` / ``MemTracker`` over two real training steps of
the real model on fake tensors and a fake process group), both on CPU rules, in MiB per device
by part, and the relative error of the totals. Goal: every case within 15%. About a minute on a
2-core machine (no real memory or FLOPs are spent).

The tracker has no "logits" part: it counts the loss's buffers as activations in the forward and
temporaries in the backward. Parts can also differ where the two name the same bytes differently
(the tracker calls a gradient a temporary until FSDP's post-backward hook claims it); the totals
are what is compared.

Last line: ``memory_plan_max_error: X%`` (the largest |plan / tracker - 1| over the cases).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the oracle: tests/oracles/memory_tracker.py

MIB = 2**20


def _row(name: str, plan: float | None, tracked: float | None) -> str:
    def fmt(v: float | None) -> str:
        return f"{v / MIB:10.1f}" if v is not None else f"{'-':>10s}"

    return f"    {name:<12s}{fmt(plan)}{fmt(tracked)}"


def main() -> None:
    import logging

    from oracles.memory_tracker import CASES, TRACKER_PARTS, compare

    from workloads.planner.memory_plan import PARTS

    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)  # DTensor's 2-D grad-norm notice
    errors: list[float] = []
    t_all = time.perf_counter()
    for case in CASES:
        t0 = time.perf_counter()
        plan, tracked, err = compare(case)
        errors.append(err)
        lay = plan.layout
        print(
            f"{case['name']}  (world {case['world_size']}: dp_replicate {lay['dp_replicate']} x dp_shard "
            f"{lay['dp_shard']} x tp {lay['tp']}; {lay['micro_batches']} micro-batch(es) of {lay['micro_batch']} seq; "
            f"ac {lay['ac']}; {lay['dtype']})"
        )
        print(f"    {'MiB':<12s}{'plan':>10s}{'tracker':>10s}")
        for part in PARTS:
            print(_row(part, getattr(plan, part), tracked[part] if part in TRACKER_PARTS else None))
        print(_row("total", plan.total, tracked["total"]))
        print(f"    error {err * 100:+.2f}%   plan's peak: {plan.phase}   ({time.perf_counter() - t0:.1f} s)")
        print(flush=True)
    worst = max(abs(e) for e in errors)
    print(
        f"{len(CASES)} cases in {time.perf_counter() - t_all:.0f} s; errors: "
        + ", ".join(f"{e * 100:+.1f}%" for e in errors)
    )
    print(f"memory_plan_max_error: {worst * 100:.1f}%")


if __name__ == "__main__":
    main()
