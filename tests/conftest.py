"""Shared fixtures: a hermetic working directory, a real sqlite MLflow store, the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenizer/corpus cache per test session (training the BPE takes a few seconds)."""
    return tmp_path_factory.mktemp("llmctl-cache")


@pytest.fixture()
def cli_env(cache_dir: Path, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}
    env.update({
        "LLMCTL_CACHE_DIR": str(cache_dir),
        "PYTHONUNBUFFERED": "1",
        "HOME": str(tmp_path / "home"),
        "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
        "DO_NOT_TRACK": "1",
    })
    (tmp_path / "home").mkdir(exist_ok=True)
    return env


def run_cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess, exactly as a user runs it."""
    return subprocess.run([sys.executable, "-m", "llmctl", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout, **kwargs)


def mlflow_runs(tracking_uri: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exps = client.search_experiments()
    return client.search_runs([e.experiment_id for e in exps]) if exps else []
