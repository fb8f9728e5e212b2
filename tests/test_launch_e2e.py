"""``llmctl launch`` end to end: real torchrun, real workload, real sqlite MLflow store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import mlflow_runs, run_cli

pytestmark = pytest.mark.slow

TINY = ["experiment=smoke", "train.steps=12", "train.val_every=6", "train.log_every=3", "checkpoint.every=0"]


def _sqlite(tmp: Path) -> str:
    return f"sqlite:///{tmp / 'mlflow.db'}"


def test_launch_finishes_with_tracked_run(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["launch", *TINY], tmp_path, cli_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "FINISHED" in out.stdout and "mlflow ui --backend-store-uri" in out.stdout

    runs = mlflow_runs(_sqlite(tmp_path))
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    # params: the flattened resolved config, with the layout made concrete
    assert run.data.params["train.steps"] == "12"
    assert run.data.params["model.name"] == "tiny"
    assert run.data.params["parallel.dp_shard"] == "1"
    assert run.data.params["checkpoint.dir"].endswith(f"llmctl-runs/{run.info.run_id}/checkpoints")
    # tags: provenance
    tags = run.data.tags
    for key in ("llmctl.version", "llmctl.infra", "llmctl.host", "llmctl.git_sha", "llmctl.git_dirty"):
        assert tags.get(key), key
    assert tags["llmctl.infra"] == "local" and tags["llmctl.experiment"] == "smoke"
    # metrics: the contract names, val loss measured at step 0, midway and at the end
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=_sqlite(tmp_path))
    for name in ("train/loss", "val/loss", "train/lr", "perf/tokens_per_s"):
        assert client.get_metric_history(run.info.run_id, name), name
    val = sorted(client.get_metric_history(run.info.run_id, "val/loss"), key=lambda m: m.step)
    assert [m.step for m in val] == [0, 6, 12]
    assert val[-1].value < val[0].value
    # artifacts: the resolved config as it ran
    local = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path / "dl"))
    assert "steps: 12" in Path(local).read_text()
    svg = Path(client.download_artifacts(run.info.run_id, "loss_curve.svg", str(tmp_path / "dl"))).read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 2 and "val/loss" in svg
    assert (tmp_path / "llmctl-runs" / run.info.run_id / "output.log").read_text().count("step") >= 4


def test_tracking_uri_precedence(cli_env: dict[str, str], tmp_path: Path) -> None:
    env_uri = f"sqlite:///{tmp_path / 'from-env.db'}"
    cfg_uri = f"sqlite:///{tmp_path / 'from-config.db'}"
    out = run_cli(["launch", *TINY, "train.steps=2", "train.val_every=2", f"tracking.uri={cfg_uri}"],
                  tmp_path, {**cli_env, "MLFLOW_TRACKING_URI": env_uri})
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(mlflow_runs(cfg_uri)) == 1
    assert not (tmp_path / "from-env.db").exists() and not (tmp_path / "mlflow.db").exists()
    out = run_cli(["launch", *TINY, "train.steps=2", "train.val_every=2"], tmp_path,
                  {**cli_env, "MLFLOW_TRACKING_URI": env_uri})
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r.info.status for r in mlflow_runs(env_uri)] == ["FINISHED"]


def test_failing_workload_marks_run_failed(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["launch", *TINY], tmp_path, {**cli_env, "LLMCTL_FAIL_AT_STEP": "3"})
    assert out.returncode == 1, out.stdout[-2000:]
    assert "FAILED" in out.stderr and "Traceback" not in out.stderr
    runs = mlflow_runs(_sqlite(tmp_path))
    assert [r.info.status for r in runs] == ["FAILED"]
    assert "exited with code" in runs[0].data.tags["llmctl.status"]


def _pids_of(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_ctrl_c_stops_workers_and_marks_run_killed(cli_env: dict[str, str], tmp_path: Path) -> None:
    marker = f"llmctl-ctrlc-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-m", "llmctl", "launch", *TINY, "train.steps=100000",
                             f"tracking.run_name={marker}"], cwd=tmp_path, env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    for line in proc.stdout:  # wait until training is really under way
        if line.startswith("step") or time.monotonic() > deadline:
            break
    run_dir = next((tmp_path / "llmctl-runs").iterdir())
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "KILLED" in err
    assert _pids_of(str(run_dir)) == []  # no worker of this run survives
    assert [r.info.status for r in mlflow_runs(_sqlite(tmp_path))] == ["KILLED"]
