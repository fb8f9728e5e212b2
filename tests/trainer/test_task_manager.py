"""Which lm-eval ``TaskManager`` the harness scores with (``workloads.pretrain.harness.task_manager``):
the include path's own index when it defines every task asked for, lm-eval's built-ins too otherwise.
lm-eval's own index is the oracle of what each holds; that the scores are lm-eval's is
tests/e2e/test_eval_e2e.py's (the same tasks through ``lm_eval`` itself)."""

from __future__ import annotations

from pathlib import Path

import pytest

lm_eval_tasks = pytest.importorskip("lm_eval.tasks", reason="lm-eval (the eval extra) is the harness")

from workloads.pretrain.harness import task_manager  # noqa: E402

TASKS = Path(__file__).resolve().parents[2] / "examples" / "eval-tasks"


def test_tasks_of_the_include_path_alone_skip_lm_evals_builtins() -> None:
    manager = task_manager(["python_facts_mc", "python_facts_gen"], str(TASKS))
    index = manager.task_index
    assert {"python_facts_mc", "python_facts_gen"} <= set(index)
    assert "hellaswag" not in index  # lm-eval's own tasks were not indexed


def test_a_group_reaching_a_builtin_task_gets_the_builtins(tmp_path: Path) -> None:
    """A local group whose member is one of lm-eval's tasks: the include path alone cannot run it."""
    (tmp_path / "mine.yaml").write_text("group: mine\ntask:\n  - python_facts_mc\n  - arc_easy\n")
    for yaml in TASKS.glob("*.yaml"):
        (tmp_path / yaml.name).write_text(yaml.read_text())
    manager = task_manager(["mine"], str(tmp_path))
    assert {"mine", "python_facts_mc", "arc_easy", "hellaswag"} <= set(manager.task_index)
