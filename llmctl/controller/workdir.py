"""The controller's folder for each run and sweep, under the directory llmctl was started from.

``llmctl-runs/<run-id>/``: the exact ``config.yaml`` the workers ran, ``output.log`` (everything
the run printed), ``pids.json`` for a local run and, unless ``checkpoint.dir`` says otherwise, a
local run's ``checkpoints/``. ``llmctl-runs/sweeps/<sweep-id>/``: a sweep's spec and state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RUNS_DIR = "llmctl-runs"


def run_dir(run_id: str) -> Path:
    return Path.cwd() / RUNS_DIR / run_id


def sweeps_root() -> Path:
    return Path.cwd() / RUNS_DIR / "sweeps"


# ``llmctl-runs/<run-id>/controller.json``: the live controller of the run's current attempt (pid and
# start time), so ``down`` and ``status`` can tell whether someone will still close the run.
CONTROLLER_FILE = "controller.json"
# ``llmctl-runs/<run-id>/job_end.json``: when the job ended and what the controller made of it, written
# by whoever saw it end; a later ``status``/``down``/``resume`` bills the attempt to that time, not to
# when it looked, and closes the run with the outcome the controller could not record itself.
JOB_END_FILE = "job_end.json"


def read_json(run_id: str, name: str) -> dict[str, Any]:
    """A record in the run's folder, {} when missing or unreadable."""
    try:
        value = json.loads((run_dir(run_id) / name).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def update_json(run_id: str, name: str, **fields: Any) -> None:
    """Merge ``fields`` into a record in the run's folder (best-effort: a record is a hint, never a
    reason for a run to fail). Written to a temporary file and renamed: a reader sees all or nothing."""
    path = run_dir(run_id) / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{name}.{os.getpid()}")
        tmp.write_text(json.dumps({**read_json(run_id, name), **fields}))
        os.replace(tmp, path)
    except OSError:
        pass
