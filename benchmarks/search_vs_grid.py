"""Does a 12-trial TPE search with ASHA pruning find a val loss no worse than a 12-trial grid?

    python benchmarks/search_vs_grid.py

Issue #19's criterion, over several seeds rather than one: one store, one 12-trial grid
(``train.lr`` at 4 log-spaced points of the interval, its ends included, x ``train.warmup_steps`` at
its 3 choices) and,
over the same ranges, one 12-trial ``--search tpe --prune asha`` sweep per seed in ``SEEDS``; every
sweep local, 2 trials at once, trials of the ``smoke`` experiment. Prints each sweep's best val/loss
(its FINISHED trials' final ``val/loss``), how many of its trials were pruned, and the steps all its
trials trained (pruning's saving). Val losses do not depend on this machine's speed (seeded, CPU);
which trials ASHA prunes does, a little (what the other trials had reported when it judged), so the
per-seed result is the evidence.

Last line: ``search_vs_grid: <k>/<n> seeds no worse than the grid (...)``.
Takes about forty minutes on a 2-core machine (twenty at batch 8).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Fixed before the run that produced docs/benchmarks.md's figures (ranges chosen after seeing results
# would be a bias): trials long enough for val loss to tell learning rates apart, and an lr range of
# four decades whose optimum for this model lies inside it, not on an end.
# batch_size=16 and SEEDS 4-6: fixed 2026-11-24 before any run with them, from a smoothness check
# (7 lrs, warmup 0, 200 steps). At the smoke preset's batch 8 the final val/loss jumped 0.107 between
# lr 3.65e-3 and 3.7e-3 (6.342, 6.449), as much as the grid's points differ, so "best trial" was a
# draw; at batch 16 neighbouring lrs differed by at most 0.007 and 2.15e-3 -> 3.6e-3 gained 0.068.
# The figures in docs/benchmarks.md before that date are batch 8, seeds 1-3.
TRIAL = [
    "experiment=smoke",
    "train.steps=200",
    "train.batch_size=16",
    "train.log_every=10",
    "train.val_every=20",
    "checkpoint.every=0",
]
SEARCH = ["train.lr=tag(log, interval(1e-4, 1.0))", "train.warmup_steps=choice(0,20,40)"]
GRID = ["train.lr=1e-4,2.154e-3,4.642e-2,1.0", "train.warmup_steps=0,20,40"]  # the same ranges: 4 x 3 points
SEEDS = (4, 5, 6)  # fresh: 1-3 were spent on the batch-8 runs


def sweep(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[str, float]:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "llmctl", "launch", "-m", "--wait", "--max-parallel", "2", *args],
        check=False,
        cwd=cwd,
        env=env,
        text=True,
        capture_output=True,
        timeout=1800,
    )
    if out.returncode != 0:
        sys.exit(f"sweep {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return next(w.rstrip(":") for w in out.stdout.split() if w.startswith("sweep-")), time.monotonic() - t0


def outcome(mc: Any, sweep_id: str) -> dict[str, Any]:
    runs = mc.search_runs(
        [e.experiment_id for e in mc.search_experiments()],
        f"tags.`llmctl.sweep_id` = '{sweep_id}' and tags.`llmctl.kind` = 'trial'",
    )
    finished = [
        r for r in runs if r.info.status == "FINISHED" and math.isfinite(r.data.metrics.get("val/loss", math.nan))
    ]
    best = min(finished, key=lambda r: r.data.metrics["val/loss"])
    steps = sum(max((m.step for m in mc.get_metric_history(r.info.run_id, "train/loss")), default=0) for r in runs)
    return {
        "best": best.data.metrics["val/loss"],
        "trials": len(runs),
        "steps": steps,
        "pruned": sum(1 for r in runs if r.data.tags.get("llmctl.pruned")),
        "params": {k: best.data.params[k] for k in ("train.lr", "train.warmup_steps")},
    }


def main() -> None:
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory(prefix="llmctl-search-") as tmp:
        work = Path(tmp)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}
        env.update(
            {
                "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}",
                "LLMCTL_CACHE_DIR": str(work / "cache"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        mc = MlflowClient(env["MLFLOW_TRACKING_URI"])
        results: dict[str, dict[str, Any]] = {}
        for name, args in [
            ("grid", [*TRIAL, *GRID]),
            *(
                (
                    f"tpe seed {s}",
                    ["--search", "tpe", "--trials", "12", "--prune", "asha", "--seed", str(s), *TRIAL, *SEARCH],
                )
                for s in SEEDS
            ),
        ]:
            sid, wall = sweep(args, work, env)
            r = results[name] = outcome(mc, sid)
            print(
                f"{name:>11}: best val/loss {r['best']:.4f} at lr {float(r['params']['train.lr']):.3g},"
                f" warmup {r['params']['train.warmup_steps']} | {r['trials']} trials, {r['pruned']} pruned,"
                f" {r['steps']} steps trained | {wall:.0f} s",
                flush=True,
            )
        grid = results.pop("grid")["best"]
        no_worse = [r["best"] <= grid for r in results.values()]
        bests = ", ".join(f"{r['best']:.4f}" for r in results.values())
        print(
            f"search_vs_grid: {sum(no_worse)}/{len(no_worse)} seeds no worse than the grid"
            f" (best val/loss tpe+asha {bests}; grid {grid:.4f})"
        )


if __name__ == "__main__":
    main()
