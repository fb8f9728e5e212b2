"""Training further at a resume keeps the learning rate continuous (docs/resume.md, schedule.py):
a real run to the end of its cosine decay, resumed with more steps, read back from MLflow."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import mlflow_client, mlflow_runs, run_cli

pytestmark = pytest.mark.slow


def test_resume_with_more_steps_keeps_the_decay_and_says_so(cli_env: dict[str, str], tmp_path: Path) -> None:
    base = [
        "experiment=smoke",
        "train.log_every=1",
        "train.val_every=0",
        "train.warmup_steps=2",
        "train.lr=3e-4",
        "train.min_lr_ratio=0.1",
        "checkpoint.every=8",
    ]
    out = run_cli(["launch", *base, "train.steps=8"], tmp_path, cli_env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (run,) = mlflow_runs(uri)
    more = run_cli(["resume", run.info.run_id, "train.steps=12"], tmp_path, cli_env)
    assert more.returncode == 0, more.stdout[-2000:] + more.stderr[-2000:]
    assert "keeps its horizon of 8 steps" in more.stdout, more.stdout
    assert "Downloading artifacts" not in more.stdout + more.stderr  # MLflow's bar: noise in our output
    lr = {m.step: m.value for m in mlflow_client(uri).get_metric_history(run.info.run_id, "train/lr")}
    assert sorted(lr) == list(range(1, 13))
    assert lr[8] == pytest.approx(3e-5)  # the end of the planned decay
    assert [lr[s] for s in range(9, 13)] == pytest.approx([3e-5] * 4)  # no jump back up (re-stretched: ~2.5e-4)
    assert lr[7] > lr[8]
