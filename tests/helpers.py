"""Helpers the tests import: the real CLI in a subprocess, and reading a real MLflow store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


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
