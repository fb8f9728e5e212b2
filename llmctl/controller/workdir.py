"""The controller's folder for each run and sweep, under the directory llmctl was started from.

``llmctl-runs/<run-id>/``: the exact ``config.yaml`` the workers ran, ``output.log`` (everything
the run printed), ``pids.json`` for a local run and, unless ``checkpoint.dir`` says otherwise, a
local run's ``checkpoints/``. ``llmctl-runs/sweeps/<sweep-id>/``: a sweep's spec and state.
"""

from __future__ import annotations

from pathlib import Path

RUNS_DIR = "llmctl-runs"


def run_dir(run_id: str) -> Path:
    return Path.cwd() / RUNS_DIR / run_id


def sweeps_root() -> Path:
    return Path.cwd() / RUNS_DIR / "sweeps"
