"""``llmctl plan -m`` of a 100-trial sweep: wall time of the real CLI, as a user runs it.

Trials sharing config-group options share one Hydra composition (llmctl/sweep/expand.py); the
naive way (one ``compose()`` per trial, ~60 ms each here) is timed on a sample for comparison.

    .venv/bin/python benchmarks/sweep_plan.py [--repeat 3] [--naive-sample 10]

Last line: ``sweep_plan: <seconds> s`` (best of --repeat CLI runs, 100 trials, goal <= 2 s).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# 5 lr x 2 models x 10 seeds = 100 trials, 2 distinct group combinations
SWEEP = ["train.lr=1e-3,6e-4,3e-4,1e-4,5e-5", "model=tiny,smoke", "train.seed=range(0,10)", "train.steps=50"]


def cli_once(cwd: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "llmctl", "plan", "-m", *SWEEP], cwd=cwd, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if out.returncode != 0 or "100 trials" not in out.stdout:
        sys.exit(f"plan -m failed ({out.returncode}): {out.stderr[-2000:]}")
    return wall


def naive_per_trial(sample: int) -> float:
    sys.path.insert(0, str(ROOT))
    from llmctl.config.compose import compose
    from llmctl.sweep.expand import expand

    trials = expand(SWEEP)
    compose(trials[0])  # warm imports
    t0 = time.perf_counter()
    for overrides in trials[:sample]:
        compose(overrides)
    return (time.perf_counter() - t0) / sample


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--naive-sample", type=int, default=10)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cwd:
        walls = [cli_once(cwd) for _ in range(args.repeat)]
        assert not os.listdir(cwd), "plan must create nothing"
    print(f"llmctl plan -m (100 trials), {args.repeat} runs: " + ", ".join(f"{w:.2f} s" for w in walls))
    if args.naive_sample:
        per = naive_per_trial(args.naive_sample)
        print(f"naive compose() per trial: {per * 1000:.0f} ms -> {per * 100:.1f} s for 100 trials (composition only)")
    print(f"sweep_plan: {min(walls):.2f} s")


if __name__ == "__main__":
    main()
