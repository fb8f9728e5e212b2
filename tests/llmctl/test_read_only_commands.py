"""Commands that only read runs create no tracking store where there is none: they say so in one
line and exit as for nothing found (a listing: 0; a run id: 3). Before, each created ./mlflow.db
(printing MLflow's "Creating initial MLflow database tables") and then reported a run missing from
a store that had not existed a moment before."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_cli

NO_STORE = "no tracking store at ./mlflow.db"


@pytest.mark.parametrize(
    "args, code",
    [
        (["status", "deadbeef"], 3),
        (["resume", "deadbeef"], 3),
        (["runs"], 0),
        (["cost"], 0),
        (["status"], 0),
        (["status", "sweep-20260101-abcdef"], 3),
    ],
)
def test_no_store_is_said_not_created(args: list[str], code: int, cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(args, tmp_path, cli_env)
    assert out.returncode == code, out.stdout + out.stderr
    said = (out.stdout + out.stderr).strip().splitlines()
    assert len(said) == 1 and NO_STORE in said[0], said
    assert "Creating initial MLflow database tables" not in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # no mlflow.db, mlruns or llmctl-runs
