"""``eval.tasks`` preflight: the lm-eval tasks a run scores during training exist and can read their
data, checked before the run exists (exit 3, one line), at launch, resume and sweep launch.

Only when ``eval.tasks`` names any: lm-eval indexes its thousands of task YAMLs to answer (seconds),
which a launch without tasks never pays. The check is ``workloads.pretrain.contract.lm_eval_tasks.check_tasks``,
the one ``llmctl eval --tasks`` runs: an unknown task, a Hub task where the Hub cannot be reached
from here, lm-eval not installed here.
"""

from __future__ import annotations

from typing import Any

from llmctl.errors import ConfigError


def check_plan(plan: Any) -> None:
    ev = plan.cfg.get("eval") or {}
    tasks = list(ev.get("tasks") or [])
    if not tasks:
        return
    from workloads.pretrain.contract.lm_eval_tasks import check_tasks

    why = check_tasks(tasks, ev.get("include_path"), flag="eval.include_path=")
    if why:
        raise ConfigError(f"eval.tasks: {why}")
