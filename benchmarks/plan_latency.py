"""``llmctl plan`` wall time with a calibration history to read: the real CLI, as a user runs it.

A temporary sqlite MLflow store gets 50 FINISHED runs through MlflowClient, tagged as launch tags
them (``llmctl.shape``, ``llmctl.accelerator``) with the metrics and params ``history.find`` reads:
25 of the local plan's shape on this CPU, 25 of the cloud plan's on Lambda's H100:8. Then
``llmctl plan`` (local) and ``llmctl plan infra=lambda`` (SkyPilot's offline catalog from
tests/fixtures, a private HOME) run alternately; each output must name a measured run.

    .venv/bin/python benchmarks/plan_latency.py [--rounds 7]

SkyPilot's answers are remembered on disk (``llmctl/backends/sky/facts.py``); the same cloud plan with
SkyPilot asked afresh (``LLMCTL_SKY_FACTS=0``) runs alongside, for the ratio.

Last line: ``plan_latency_median_s: <seconds>``, the larger of the local and the cloud median (goal: <= 1.5 s each).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CATALOG = ROOT / "tests" / "fixtures" / "sky-catalog-v8"
PLANS = {"local": [], "lambda": ["infra=lambda"], "lambda-fresh": ["infra=lambda"]}
# "lambda-fresh": SkyPilot asked every time (LLMCTL_SKY_FACTS=0), as the first plan after a catalog
# or SkyPilot change is; measured alongside, not in the headline (a plan repeats with remembered answers)
FRESH = {"lambda-fresh": {"LLMCTL_SKY_FACTS": "0"}}
RUNS_PER_PLAN = 25


def populate(uri: str) -> None:
    """50 FINISHED runs, 25 per plan's (shape, accelerator), as ``llmctl launch`` leaves them."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from llmctl.config.compose import compose
    from llmctl.cost import history
    from llmctl.cost.estimate import shape_key
    from llmctl.plan.make import make_plan

    mc = MlflowClient(tracking_uri=uri)
    exp = mc.create_experiment("history")
    for name, args in PLANS.items():
        if name in FRESH:
            continue
        plan = make_plan(compose([*args, f"tracking.uri={uri}"]))
        tags = {history.TAG_SHAPE: shape_key(plan.cfg), history.TAG_ACCELERATOR: plan.hardware.accelerator}
        train = plan.cfg["train"]
        for i in range(RUNS_PER_PLAN):
            rid = mc.create_run(exp, tags=tags).info.run_id
            mc.log_batch(
                rid,
                metrics=[
                    Metric(history.STEADY, 1000.0 + i, 0, 0),
                    Metric(history.OVERHEAD, 20.0, 0, 0),
                    Metric(history.VAL_PASS, 0.5, 0, 0),
                ],
                params=[
                    Param("infra.nodes", "1"),
                    Param("train.batch_size", str(train["batch_size"])),
                    Param("train.val_batches", str(train["val_batches"])),
                ],
            )
            mc.set_terminated(rid, "FINISHED")


def plan_once(args: list[str], cwd: str, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "llmctl", "plan", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if out.returncode != 0 or "measured: run" not in out.stdout:
        sys.exit(
            f"llmctl plan {' '.join(args)} failed or found no measured run ({out.returncode}):"
            f" {out.stderr[-2000:] or out.stdout[-2000:]}"
        )
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home, cwd = Path(tmp) / "home", Path(tmp) / "work"
        shutil.copytree(CATALOG, home / ".sky" / "catalogs" / "v8")  # no .meta md5: SkyPilot never refetches
        cwd.mkdir()
        uri = f"sqlite:///{tmp}/mlflow.db"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_", "SKYPILOT_API"))}
        env.update(
            {
                "HOME": str(home),
                "MLFLOW_TRACKING_URI": uri,
                "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
                "DO_NOT_TRACK": "1",
                "AWS_EC2_METADATA_DISABLED": "true",
            }
        )
        os.environ.update(env)  # this process plans too (for the shapes): same HOME for SkyPilot
        sys.path.insert(0, str(ROOT))
        populate(uri)
        for name, plan_args in PLANS.items():  # warm-up, not counted: bytecode caches, the catalog's first read
            plan_once(plan_args, str(cwd), {**env, **FRESH.get(name, {})})
        walls: dict[str, list[float]] = {name: [] for name in PLANS}
        for _ in range(args.rounds):
            for name, plan_args in PLANS.items():
                walls[name].append(plan_once(plan_args, str(cwd), {**env, **FRESH.get(name, {})}))
        assert not os.listdir(cwd), "plan must create nothing"
    medians = {name: statistics.median(w) for name, w in walls.items()}
    for name, w in walls.items():
        fresh = " (SkyPilot asked afresh)" if name in FRESH else ""
        print(
            f"llmctl plan {' '.join(PLANS[name]) or '(local)'}{fresh}: median {medians[name]:.2f} s over {len(w)} runs"
            f" ({', '.join(f'{x:.2f}' for x in w)})"
        )
    print(f"remembered / fresh SkyPilot answers: {medians['lambda'] / medians['lambda-fresh']:.2f}")
    print(f"plan_latency_median_s: {max(v for k, v in medians.items() if k not in FRESH):.2f}")


if __name__ == "__main__":
    main()
