"""``launch`` refuses a job its memory plan says will not fit, naming the way past it; with
``--ignore-memory-plan`` the same job runs. The plan is made not to fit by saying the device has
1 MiB (``infra.device_memory_gib``), so the job itself stays the tiny smoke run."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import mlflow_runs, run_cli

pytestmark = pytest.mark.slow

TINY = ["experiment=smoke", "train.steps=4", "train.val_every=0", "train.log_every=2", "checkpoint.every=0"]
NO_ROOM = "infra.device_memory_gib=0.001"


def test_refusal_names_the_override_and_the_override_launches(cli_env: dict[str, str], tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    shown = run_cli(["plan", *TINY, NO_ROOM, f"tracking.uri={uri}"], tmp_path, cli_env)
    assert shown.returncode == 0, shown.stderr
    assert "DOES NOT FIT" in shown.stdout and "(infra.device_memory_gib)" in shown.stdout, shown.stdout[-2000:]

    refused = run_cli(["launch", *TINY, NO_ROOM, f"tracking.uri={uri}"], tmp_path, cli_env)
    assert refused.returncode == 3, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "would run out of memory" in refused.stderr and "--ignore-memory-plan" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "llmctl-runs").exists()  # refused before anything exists

    out = run_cli(["launch", "--ignore-memory-plan", *TINY, NO_ROOM, f"tracking.uri={uri}"], tmp_path, cli_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "launching past the memory plan (--ignore-memory-plan): DOES NOT FIT" in out.stdout, out.stdout[-3000:]
    [run] = mlflow_runs(uri)
    assert run.info.status == "FINISHED" and run.data.params["train.steps"] == "4"


def test_device_memory_must_be_positive(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *TINY, "infra.device_memory_gib=0"], tmp_path, cli_env)
    assert out.returncode == 3 and "infra.device_memory_gib" in out.stderr and "Fix:" in out.stderr, out.stderr
