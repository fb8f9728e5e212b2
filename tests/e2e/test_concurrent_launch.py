"""Several ``llmctl launch`` at once in a new directory: one fresh sqlite store, nothing lost.

MLflow creates a new store's schema on first open; eight processes doing that at once used to die
with ``table alembic_version already exists``. Real CLI processes, a real sqlite store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import mlflow_client, mlflow_runs

pytestmark = pytest.mark.slow
# Started together, the launches reach the store within moments of each other, and creating its
# schema (dozens of migrations) takes far longer than that: two are enough to race for it, and four
# collided on every try with the lock on the store taken out of llmctl. They then log their points
# into the one file side by side.
N, STEPS = 4, 3


def test_launches_at_once_on_a_fresh_store_all_finish_with_every_point(cli_env: dict[str, str], tmp_path: Path) -> None:
    assert not (tmp_path / "mlflow.db").exists()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmctl",
                "launch",
                "experiment=smoke",
                f"train.steps={STEPS}",
                "train.log_every=1",
                "train.val_every=0",
                f"train.seed={i}",
                f"tracking.run_name=concurrent-{i}",
            ],
            cwd=tmp_path,
            env=cli_env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(N)
    ]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    runs = mlflow_runs(uri)
    assert sorted(r.info.run_name for r in runs) == sorted(f"concurrent-{i}" for i in range(N))
    mc = mlflow_client(uri)
    for r in runs:
        assert r.info.status == "FINISHED", r.data.tags.get("llmctl.status")
        for key in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s"):
            assert sorted(m.step for m in mc.get_metric_history(r.info.run_id, key)) == list(range(1, STEPS + 1)), key
        assert sorted(m.step for m in mc.get_metric_history(r.info.run_id, "val/loss")) == [0, STEPS]
