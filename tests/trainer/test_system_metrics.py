"""System metrics from the trainer's monitor land in the run even when the run is shorter than one
sampling interval (MLflow's loop alone drops the sample it holds when told to stop)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workloads.pretrain.components import system_metrics


def test_a_run_shorter_than_one_interval_still_gets_a_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("sm"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "3600")  # the loop never reaches a publish
    for var in ("LOCAL_RANK", "GROUP_RANK", "SKYPILOT_NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GROUP_RANK", "1")

    monitor = system_metrics.start()
    assert monitor is not None
    system_metrics.stop(monitor)

    history = client.get_metric_history(run.info.run_id, "system/node-1/cpu_utilization_percentage")
    assert len(history) == 1 and 0.0 <= history[0].value <= 100.0, history
