"""``eval.tasks`` / ``--tasks`` checked where the scoring runs (issue #51, items 3 and 4): a run on a
cloud or Slurm scores on its nodes, which install lm-eval and read the Hub there, so a controller
without lm-eval, or one that cannot reach the Hub, does not refuse it; a run scored here still does.
A misspelt task is refused here whenever lm-eval is installed here, and on the node by the score job.

The plans are the real ones (``make_plan`` over SkyPilot's fixture catalog); a controller without
lm-eval is this process with ``lm_eval`` unimportable (``sys.modules``), the Hub out of reach is
``HF_HUB_OFFLINE``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmctl.config.compose import compose
from llmctl.errors import ConfigError

TASKS = Path(__file__).resolve().parents[2] / "examples" / "eval-tasks"
REMOTE = ["infra=lambda", "infra.accelerators=H100:1", "tracking.uri=http://127.0.0.1:5000"]
LOCAL = ["tracking.uri=http://127.0.0.1:5000"]


def _check(overrides: list[str]) -> None:
    from llmctl.plan import task_check
    from llmctl.plan.make import make_plan

    task_check.check_plan(make_plan(compose(["experiment=smoke", *overrides])))


@pytest.mark.usefixtures("sky_home")
def test_a_hub_task_out_of_reach_here_is_the_nodes_to_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _check([*REMOTE, "eval.tasks=[arc_easy]"])
    with pytest.raises(ConfigError, match="from the Hugging Face Hub, which cannot be reached from here"):
        _check([*LOCAL, "eval.tasks=[arc_easy]"])


@pytest.mark.usefixtures("sky_home")
def test_a_controller_without_lm_eval_launches_a_run_that_scores_on_its_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    _check([*REMOTE, "eval.tasks=[python_facts_mc]", f"eval.include_path={TASKS}"])
    with pytest.raises(ConfigError, match=r"lm-eval is not installed: pip install 'llmctl-train\[eval\]'"):
        _check([*LOCAL, "eval.tasks=[python_facts_mc]", f"eval.include_path={TASKS}"])


@pytest.mark.usefixtures("sky_home")
def test_a_misspelt_task_is_refused_here_when_lm_eval_can_say_so() -> None:
    with pytest.raises(ConfigError, match="unknown lm-eval task 'python_facts_mcq'"):
        _check([*REMOTE, "eval.tasks=[python_facts_mcq]", f"eval.include_path={TASKS}"])


def test_the_score_job_checks_its_tasks_on_the_node_before_exporting() -> None:
    """What the node runs first (``score_tasks.check_tasks_here``): lm-eval's index there."""
    from workloads.pretrain.score_tasks import check_tasks_here

    check_tasks_here(["python_facts_mc", "python_facts_gen"], str(TASKS))
    with pytest.raises(ValueError, match="unknown lm-eval task 'python_facts_mcq' on this node"):
        check_tasks_here(["python_facts_mcq"], str(TASKS))
