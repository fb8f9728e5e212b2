"""Wall time of a 2-trial local sweep on a CPU: trials splitting the cores against each taking all of them.

    python benchmarks/concurrent_trials.py

``llmctl launch -m --max-parallel 2 --wait`` of two smoke trials (80 steps, no checkpoints), run
``ROUNDS`` times in each of two ways, alternating:

- **split** (llmctl's default): the supervisor sets ``OMP_NUM_THREADS`` to cores / 2 and the trainer
  honours it;
- **all cores** (what the trainer did before 2026-11-24, when it ignored the supervisor's value):
  ``OMP_NUM_THREADS`` set to the core count, so each trial spins up a thread per core.

Each sweep gets a fresh store; the tokenizer cache is shared and built before the first timed round.
Last line: ``concurrent_trials: <all cores / split>x`` (median wall times; above 1 = splitting pays).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROUNDS = 3
TRIALS = ["experiment=smoke", "train.steps=80", "checkpoint.every=0", "train.seed=0,1"]


def sweep(cache: Path, threads: int | None) -> tuple[float, set[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_", "OMP_"))}
    env.update({"LLMCTL_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"})
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory(prefix="llmctl-concurrent-") as tmp:
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "llmctl", "launch", "-m", "--max-parallel", "2", "--wait", *TRIALS],
            cwd=tmp,
            env=env,
            text=True,
            capture_output=True,
            timeout=1200,
        )
        wall = time.monotonic() - t0
        if out.returncode != 0:
            sys.exit(f"sweep failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        logs = list(Path(tmp, "llmctl-runs").glob("*/output.log"))
        shown = {m for log in logs for m in re.findall(r"\((\d+ threads/proc)\)", log.read_text())}
        return wall, shown


def main() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    times: dict[str, list[float]] = {"split": [], "all cores": []}
    with tempfile.TemporaryDirectory(prefix="llmctl-cache-") as cache:
        sweep(Path(cache), None)  # builds the tokenizer and corpus cache; not timed
        for r in range(ROUNDS):
            for name, threads in (
                (("split", None), ("all cores", cores)) if r % 2 == 0 else (("all cores", cores), ("split", None))
            ):
                wall, shown = sweep(Path(cache), threads)
                times[name].append(wall)
                print(f"round {r + 1} {name:>9}: {wall:6.1f} s  (trials report {', '.join(sorted(shown))})", flush=True)
    split, full = statistics.median(times["split"]), statistics.median(times["all cores"])
    print(f"{cores} cores; median 2-trial sweep: split {split:.1f} s, all cores {full:.1f} s")
    print(f"concurrent_trials: {full / split:.2f}x")


if __name__ == "__main__":
    main()
