"""A new local sqlite store starts as a copy of an empty one MLflow made earlier on this machine.

MLflow builds a new sqlite store's schema by running every Alembic migration from the first (about 60
of them): seconds of CPU, more on a busy machine, paid by the first command
in every directory (and by every test of this repository that launches in a fresh one). The schema
only changes with MLflow's version, so llmctl lets MLflow build it once per version, in
``$LLMCTL_CACHE_DIR`` (else ``~/.cache/llmctl``), and copies that file where a new store is wanted.

The copy is what MLflow itself made, less one row: the default experiment (id 0), whose artifact
location MLflow derives from where the store was created. MLflow recreates a missing default
experiment when it opens a store (``SqlAlchemyStore._initialize_store_state``), so the copy gets one
with its own location, as a store built in place would. ``LLMCTL_FRESH_STORE=0`` turns this off.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Optional

DEFAULT_EXPERIMENT_ID = 0


def template_path() -> Path:
    import mlflow

    from workloads.protocol.run_contract import cache_home

    return cache_home() / "mlflow-stores" / f"empty-mlflow-{mlflow.__version__}.db"


def _build(template: Path) -> None:
    """Let MLflow create a store in a scratch file, drop its default experiment, then move it into
    place atomically (two builders at once: each moves a whole file, the last one stays)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    template.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=template.parent) as scratch:
        db = Path(scratch) / "store.db"
        store = SqlAlchemyStore(f"sqlite:///{db}", default_artifact_root=str(Path(scratch) / "artifacts"))
        store.engine.dispose()
        with sqlite3.connect(db) as con:
            con.execute("DELETE FROM experiment_tags WHERE experiment_id = ?", (DEFAULT_EXPERIMENT_ID,))
            con.execute("DELETE FROM experiments WHERE experiment_id = ?", (DEFAULT_EXPERIMENT_ID,))
        con.close()
        os.replace(db, template)


def create_from_template(path: Path) -> Optional[Path]:
    """Put a copy of the empty store at ``path`` (which must not exist: the caller holds the lock on
    its directory); the template used, or None when turned off or when it cannot be made (MLflow then
    builds the store itself, as without this)."""
    if os.environ.get("LLMCTL_FRESH_STORE") == "0":
        return None
    try:
        template = template_path()
        if not template.is_file():
            _build(template)
        partial = path.with_name(f".{path.name}.partial")
        shutil.copyfile(template, partial)
        os.replace(partial, path)
        return template
    except Exception:  # an unwritable cache, a changed schema: MLflow's own way still works
        return None
