"""A new local store is a copy of an empty one MLflow built (``llmctl/tracking/fresh_store.py``), held
against a store MLflow builds in place: the same schema and migration head, a default experiment
whose artifact location is the new store's own, and runs logged into it as into any store."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest


def _schema(db: Path) -> tuple[dict[str, list[str]], str]:
    """Each table's and index's definition as a sorted list of its clauses (MLflow's own builds list a
    table's CHECK constraints in varying order), and the migration head."""
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL").fetchall()
        (head,) = con.execute("SELECT version_num FROM alembic_version").fetchone()
    con.close()
    return {name: sorted(ln.strip().rstrip(",") for ln in sql.splitlines()) for name, sql in rows}, head


def test_a_new_store_is_mlflows_empty_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    from llmctl.tracking import fresh_store
    from llmctl.tracking.mlflow_run import client

    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    ours, theirs = tmp_path / "ours" / "mlflow.db", tmp_path / "theirs" / "mlflow.db"
    theirs.parent.mkdir()
    mc = client(f"sqlite:///{ours}")
    assert fresh_store.template_path().is_file(), "the store was copied from the template"
    oracle = MlflowClient(f"sqlite:///{theirs}")  # MLflow's own first open: every migration
    assert _schema(ours) == _schema(theirs)
    (default,) = mc.search_experiments()
    (reference,) = oracle.search_experiments()
    assert (default.experiment_id, default.name) == (reference.experiment_id, reference.name) == ("0", "Default")
    # each derived from where its store is, not from where the template was built
    assert "cache" not in default.artifact_location
    assert default.artifact_location == reference.artifact_location.replace(str(theirs.parent), str(ours.parent))

    exp = mc.create_experiment("copied")
    run = mc.create_run(exp)
    mc.log_metric(run.info.run_id, "loss", 1.5, step=3)
    assert [m.value for m in mc.get_metric_history(run.info.run_id, "loss")] == [1.5]

    # a second store copies the template (no second build); LLMCTL_FRESH_STORE=0: MLflow builds it
    built = fresh_store.template_path().stat().st_mtime_ns
    client(f"sqlite:///{tmp_path / 'again.db'}")
    assert fresh_store.template_path().stat().st_mtime_ns == built
    monkeypatch.setenv("LLMCTL_FRESH_STORE", "0")
    assert fresh_store.create_from_template(tmp_path / "off.db") is None and not (tmp_path / "off.db").exists()
    client(f"sqlite:///{tmp_path / 'off.db'}")
    assert _schema(tmp_path / "off.db") == _schema(theirs)
