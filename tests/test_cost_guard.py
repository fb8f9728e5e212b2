"""The in-run budget guard, for real: torchrun, the workload, a sqlite MLflow store.

History says this shape is very fast (a FINISHED run measured at 10M tok/s), so the estimate passes
``--max-cost``; this machine is slower, so the spend reaches the limit mid-run and the workload must
stop itself: checkpoint written, run FINISHED with a clear ``llmctl.status``, ``launch`` exits 4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import mlflow_runs, run_cli

pytestmark = pytest.mark.slow

PRICE = 36.0  # $/h: $0.01 per second of billed time
MAX_COST = 0.40  # ~40 s: start-up plus a few steps on a 2-core machine


def test_guard_stops_after_checkpoint(cli_env: dict[str, str], tmp_path: Path) -> None:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from llmctl.config import compose
    from llmctl.cost import history
    from llmctl.cost.estimate import shape_key
    from llmctl.planner import make_plan

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["experiment=smoke", "train.steps=5000", "train.log_every=5", "train.val_every=100000",
            "checkpoint.every=0", f"infra.price_per_gpu_hour={PRICE}"]
    plan = make_plan(compose(args + [f"tracking.uri={uri}"]))
    mc = MlflowClient(uri)
    fast = mc.create_run(mc.create_experiment("llmctl"), tags={history.TAG_SHAPE: shape_key(plan.cfg),
                                                               history.TAG_ACCELERATOR: plan.hardware.accelerator})
    mc.log_batch(fast.info.run_id, metrics=[Metric(history.STEADY, 1e7, 0, 0), Metric(history.OVERHEAD, 1.0, 0, 0)],
                 params=[Param("infra.nodes", "1"), Param("train.batch_size", "8"), Param("train.val_batches", "4")])
    mc.set_terminated(fast.info.run_id, "FINISHED")

    out = run_cli(["launch", *args, "--max-cost", str(MAX_COST)], tmp_path, cli_env, timeout=600)
    assert out.returncode == 4, out.stdout[-3000:] + out.stderr[-3000:]
    assert "stopped: budget $0.40 reached at step" in out.stderr
    assert "budget | stopping after step" in out.stdout

    run = next(r for r in mlflow_runs(uri) if r.info.run_id != fast.info.run_id)
    assert run.info.status == "FINISHED"
    status = run.data.tags["llmctl.status"]
    assert status.startswith("stopped: budget $0.40 reached at step") and "checkpoint saved" in status
    stop = json.loads(run.data.tags["llmctl.budget_stop"])
    step = int(stop["step"])
    assert 0 < step < 5000
    ckpt = tmp_path / "llmctl-runs" / run.info.run_id / "checkpoints" / f"step-{step}"
    assert (ckpt / ".complete").is_file(), sorted(p.name for p in ckpt.parent.iterdir())
    assert run.data.metrics["train/steps_done"] == step  # the stop step was logged as the last one
    assert run.data.metrics["cost/estimate_usd"] < MAX_COST
    # the guard stops before the limit; what follows (val, checkpoint, exit) is billed too
    assert stop["spent_usd"] <= MAX_COST
    assert run.data.metrics["cost/actual_usd"] < MAX_COST * 1.5, run.data.metrics["cost/actual_usd"]
