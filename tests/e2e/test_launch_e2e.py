"""``llmctl launch`` end to end: real torchrun, real workload, real sqlite MLflow store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from helpers import mlflow_runs, run_cli

pytestmark = pytest.mark.slow

TINY = ["experiment=smoke", "train.steps=12", "train.val_every=6", "train.log_every=3", "checkpoint.every=0"]


def _sqlite(tmp: Path) -> str:
    return f"sqlite:///{tmp / 'mlflow.db'}"


def test_launch_finishes_with_tracked_run(cli_env: dict[str, str], tmp_path: Path) -> None:
    # MLflow's system metrics sample every second (default 10 s: longer than this run's training).
    # tracking.uri and $MLFLOW_TRACKING_URI both set: the config's store wins (the first half of
    # test_tracking_uri_precedence, checked on this run rather than on a launch of its own)
    uri = f"sqlite:///{tmp_path / 'from-config.db'}"
    env = {
        **cli_env,
        "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'from-env.db'}",
    }
    out = run_cli(["launch", *TINY, f"tracking.uri={uri}"], tmp_path, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "FINISHED" in out.stdout and "mlflow ui --backend-store-uri" in out.stdout
    assert not (tmp_path / "from-env.db").exists() and not (tmp_path / "mlflow.db").exists()
    # the first command in a directory: no MLflow store-creation lines, no dataset-source UserWarning
    for noise in ("Creating initial MLflow database tables", "Updating database tables", "UserWarning"):
        assert noise not in out.stdout + out.stderr, noise

    runs = mlflow_runs(uri)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    # params: the flattened resolved config, with the layout made concrete
    assert run.data.params["train.steps"] == "12"
    assert run.data.params["model.name"] == "tiny"
    assert run.data.params["parallel.dp_shard"] == "1"
    # the run's own path is a tag, not a param a Compare view reads as a difference (issue #34, item 9)
    assert "checkpoint.dir" not in run.data.params and run.data.params["checkpoint.every"]
    assert run.data.tags["llmctl.path.checkpoint.dir"].endswith(f"llmctl-runs/{run.info.run_id}/checkpoints")
    # tags: provenance
    tags = run.data.tags
    for key in ("llmctl.version", "llmctl.infra", "llmctl.host", "llmctl.git_sha", "llmctl.git_dirty"):
        assert tags.get(key), key
    assert tags["llmctl.infra"] == "local" and tags["llmctl.experiment"] == "smoke"
    # metrics: the contract names, val loss measured at step 0, midway and at the end
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
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
    log = (tmp_path / "llmctl-runs" / run.info.run_id / "output.log").read_text()
    assert log.count("step") >= 4
    # the closing line is last: the UI command for this store and the run page to open on it
    rid, eid = run.info.run_id, run.info.experiment_id
    assert out.stdout.strip().splitlines()[-1] == (
        f"llmctl: open it: mlflow ui --backend-store-uri {uri}, then "
        f"http://127.0.0.1:5000/#/experiments/{eid}/runs/{rid}?workflowType=machine_learning"
    )
    # the attempt's output.log, uploaded as it is on disk
    uploaded = client.download_artifacts(rid, "attempts/1/output.log", str(tmp_path / "dl"))
    assert Path(uploaded).read_text() == log
    # source: MLflow's standard fields, checked against git itself; a dirty tree's diff as an artifact
    repo = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert tags["mlflow.source.git.commit"] == head and tags["mlflow.source.type"] == "PROJECT"
    assert tags["mlflow.source.name"]
    artifacts = {a.path for a in client.list_artifacts(rid, "source")}
    assert ("source/uncommitted.diff" in artifacts) == (tags["llmctl.git_dirty"] == "true"), artifacts
    # attempt times in ISO 8601 (UTC); one-value cost figures as tags, the ones a runs table sorts by
    # (spend, device-hours, per 1M tokens) also as metrics (issue #34, item 9)
    start, end = (datetime.fromisoformat(tags[f"llmctl.attempt.1.{k}"]) for k in ("start", "end"))
    assert start.utcoffset() == timedelta(0) and start <= end
    assert float(tags["cost/actual_usd"]) == 0.0 and float(tags["cost/attempts"]) == 1
    metrics = run.data.metrics
    assert {k for k in metrics if k.startswith("cost/")} == {
        "cost/actual_usd",
        "cost/device_hours",
        "cost/usd_per_1m_tokens",
        "cost/estimate_usd",
    }, metrics
    assert metrics["cost/device_hours"] == float(tags["cost/device_hours"]) and "time/estimate_h" not in metrics
    # the training corpus as the run's dataset input; its token count is the cached corpus' length
    (ds,) = run.inputs.dataset_inputs
    assert [t.value for t in ds.tags] == ["training"] and ds.dataset.name == "pydoc"
    cached = Path(json.loads(ds.dataset.source)["uri"])
    assert json.loads(ds.dataset.profile)["tokens"] == len(np.load(cached / "tokens.npy", mmap_mode="r"))
    # system metrics from the node's local rank 0, labelled by node
    assert client.get_metric_history(rid, "system/node-0/cpu_utilization_percentage")


def test_tracking_uri_precedence(cli_env: dict[str, str], tmp_path: Path) -> None:
    """$MLFLOW_TRACKING_URI beats the default ./mlflow.db; tracking.uri beats both (checked by
    test_launch_finishes_with_tracked_run, whose launch sets the two)."""
    env_uri = f"sqlite:///{tmp_path / 'from-env.db'}"
    out = run_cli(
        ["launch", *TINY, "train.steps=2", "train.val_every=2"], tmp_path, {**cli_env, "MLFLOW_TRACKING_URI": env_uri}
    )
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmctl", "launch", *TINY, "train.steps=100000", f"tracking.run_name={marker}"],
        cwd=tmp_path,
        env=cli_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
