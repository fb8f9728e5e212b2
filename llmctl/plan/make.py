"""Config → plan: the config's backend says how it would run, the cost model says what it costs.

No side effects: ``llmctl plan`` prints the result, ``launch`` executes exactly it. The estimate
is best-effort here (a plan stands without one; ``--max-cost`` then refuses).
"""

from __future__ import annotations

from typing import Any, Optional

from llmctl.config.compose import Composed
from llmctl.plan.job_plan import Plan
from llmctl.tracking.mlflow_run import resolve_uri


def make_plan(composed: Composed) -> Plan:
    """The backend's plan for ``composed`` (refused with ConfigError where its hardware cannot run the
    config) plus its memory plan per device (``memory``) and its cost
    estimate (earlier runs in MLflow, read-only)."""
    from llmctl.backends import backend_for
    from llmctl.config.launcher_checks import check_hardware

    plan = backend_for(composed.cfg["infra"]["kind"]).plan(composed)
    check_hardware(plan.cfg, plan.hardware)  # e.g. train.fp8 on a GPU without FP8: refused, nothing created
    plan.tracking_uri = resolve_uri(composed.cfg["tracking"]["uri"])
    try:
        from llmctl.plan import memory_fit as memory

        plan.memory = memory.check(plan)
    except Exception as exc:
        plan.notes.append(f"no memory plan: {type(exc).__name__}: {exc}")
    try:
        plan.estimate = estimate_for(plan)
    except Exception as exc:
        plan.notes.append(f"no cost estimate: {type(exc).__name__}: {exc}")
    return plan


def estimate_for(
    plan: Plan, max_cost: Optional[float] = None, lookup: bool = True, cfg: Optional[dict[str, Any]] = None
) -> Any:
    """The estimate of ``plan`` (or of ``cfg`` on the plan's hardware, e.g. the steps a resume has
    left); ``lookup`` asks MLflow for a measured run of the same shape on the same accelerator."""
    from llmctl.cost import estimate, history

    cfg = cfg or plan.cfg
    measured = None
    if lookup:
        measured = history.find(plan.tracking_uri, estimate.shape_key(cfg), plan.hardware.accelerator, cfg)
    return estimate.estimate(
        cfg,
        plan.hardware,
        plan.backend,
        measured=measured,
        catalog=estimate.catalog_prices(plan.offers),
        max_cost=max_cost,
    )
