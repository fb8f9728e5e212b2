"""The summary of lm-eval's built-in tasks that llmctl ships (``lm_eval_index.SHIPPED``) is lm-eval's
own index of the installed lm-eval (the version the project pins), summarised: lm-eval is the oracle.
After a change of the pin this fails until ``python -m workloads.planner.lm_eval_index``
ships the new one."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("lm_eval.tasks", reason="lm-eval (the eval extra) is the harness")

from workloads.planner import lm_eval_index


def test_the_shipped_summary_is_lm_evals_own_index() -> None:
    shipped = lm_eval_index.SHIPPED / f"{lm_eval_index._files_key()}.json.gz"
    assert shipped.is_file(), f"no summary for this lm-eval: run python -m {lm_eval_index.__name__}"
    assert json.loads(gzip.decompress(shipped.read_bytes())) == lm_eval_index.build_builtin_summary()


def test_one_summary_is_shipped() -> None:
    """Older summaries go when the pin moves (each is ~150 KB in every install)."""
    assert [p.name for p in lm_eval_index.SHIPPED.iterdir()] == [f"{lm_eval_index._files_key()}.json.gz"]


def test_a_changed_task_file_changes_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key is the task files' paths and sizes: a task added in place, or edited to another size,
    is another lm-eval, never answered from a summary of the shipped one."""
    import importlib.util

    origin = Path(importlib.util.find_spec("lm_eval").origin)  # type: ignore[union-attr, arg-type]
    fake = tmp_path / "lm_eval"
    (fake / "tasks" / "a").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "tasks" / "a" / "t.yaml").write_text("task: t\n")
    spec = importlib.util.spec_from_file_location("lm_eval", fake / "__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "lm_eval" else None)
    first = lm_eval_index._files_key()
    (fake / "tasks" / "a" / "t.yaml").write_text("task: tt\n")
    assert lm_eval_index._files_key() != first
    (fake / "tasks" / "a" / "t.yaml").write_text("task: t\n")
    assert lm_eval_index._files_key() == first
    (fake / "tasks" / "a" / "u.yaml").write_text("task: u\n")
    assert lm_eval_index._files_key() != first
    assert os.path.isfile(origin)
