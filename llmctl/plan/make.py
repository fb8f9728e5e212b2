"""Config → plan: the config's backend says how it would run, the cost model says what it costs.

No side effects: ``llmctl plan`` prints the result, ``launch`` executes exactly it. The estimate
is best-effort here (a plan stands without one; ``--max-cost`` then refuses).
"""

from __future__ import annotations

from typing import Any, Optional

from llmctl.config.compose import Composed
from llmctl.config.workload import is_command
from llmctl.plan.job_plan import Plan
from llmctl.tracking.mlflow_run import resolve_uri


def make_plan(composed: Composed) -> Plan:
    """The backend's plan for ``composed`` (refused with ConfigError where its hardware cannot run the
    config) plus its memory plan per device (``memory``) and its cost
    estimate (earlier runs in MLflow, read-only)."""
    from llmctl.backends import backend_for
    from llmctl.config.launcher_checks import check_hardware

    plan = backend_for(composed.cfg["infra"]["kind"]).plan(composed)
    check_hardware(plan.typed, plan.hardware)  # e.g. train.fp8 on a GPU without FP8: refused, nothing created
    plan.tracking_uri = resolve_uri(composed.cfg["tracking"]["uri"])
    if plan.candidates:  # each provider's own memory plan and estimate; the plan's are the first tried
        from llmctl.plan import candidates
        from llmctl.plan import memory_fit as memory

        candidates.fill(plan, memory.check, estimate_for)
    else:
        _memory_and_estimate(plan)
    warning = checkpoint_warning(plan.cfg, plan.estimate)
    if warning:
        plan.notes.append(warning)
    return plan


def _memory_and_estimate(plan: Plan) -> None:
    """The plan's memory plan per device (``memory``) and cost estimate, each best-effort."""
    if not is_command(plan.cfg):  # a user's program: its memory is its own
        try:
            from llmctl.plan import memory_fit as memory

            plan.memory = memory.check(plan)
        except Exception as exc:
            plan.notes.append(f"no memory plan: {type(exc).__name__}: {exc}")
    try:
        plan.estimate = estimate_for(plan)
    except Exception as exc:
        plan.notes.append(f"no cost estimate: {type(exc).__name__}: {exc}")


CHECKPOINT_INTERVAL_S = 1800.0  # the periodic checkpoint a spot or managed run is advised to have
FALLBACK_EVERY = 500  # the suggestion when the plan has no step time


def checkpoint_warning(cfg: dict[str, Any], est: Any = None) -> Optional[str]:
    """A spot or managed run with ``checkpoint.every=0`` (the default) keeps, when preempted, only
    what its emergency save writes within ``checkpoint.preempt_grace_s``, and restarts from step 0
    when that save is skipped (too little grace for the state's size): say so, and what to set,
    sized for a checkpoint about every 30 minutes by the estimate's step time when there is one."""
    infra, ck = cfg["infra"], cfg["checkpoint"]
    spot = infra.get("use_spot") or any(c.get("use_spot") for c in infra.get("candidates") or [])
    what = "spot" if spot else "managed" if infra.get("managed") else None
    if what is None or int(ck.get("every") or 0) > 0:
        return None
    steps = int(cfg["train"]["steps"])
    if est is not None and steps > 0 and est.train_s > 0:
        step_s = est.train_s / steps
        every = max(1, round(CHECKPOINT_INTERVAL_S / step_s))
        if every >= steps:
            every = max(1, steps // 2)
            sized = f"halfway: the estimate puts the whole run at {est.train_s:.0f} s of training"
        else:
            sized = f"about every {CHECKPOINT_INTERVAL_S / 60:.0f} min at the estimated {step_s:.2g} s/step"
    else:
        every, sized = min(FALLBACK_EVERY, max(1, steps // 2)), "no step-time estimate: size it to ~30 min of steps"
    return (
        f"warning: a {what} run with checkpoint.every=0 (no periodic checkpoints) depends on the emergency save"
        f" alone: a preemption whose save does not fit checkpoint.preempt_grace_s={ck.get('preempt_grace_s')}s"
        f" restarts from the previous emergency save, or step 0. Set checkpoint.every={every} ({sized})"
    )


def estimate_for(
    plan: Plan, max_cost: Optional[float] = None, lookup: bool = True, cfg: Optional[dict[str, Any]] = None
) -> Any:
    """The estimate of ``plan`` (or of ``cfg`` on the plan's hardware, e.g. the steps a resume has
    left); ``lookup`` asks MLflow for a measured run of the same shape on the same accelerator."""
    from llmctl.cost import estimate, history
    from workloads.protocol.config import typed

    # the plan's own config is typed already; another one (the steps a resume has left) is typed here
    tc = plan.typed if cfg is None else typed(cfg)
    cfg = cfg or plan.cfg
    if is_command(cfg):
        found = (
            history.command_wall(plan.tracking_uri, estimate.command_key(cfg), plan.hardware.accelerator)
            if lookup
            else None
        )
        return estimate.command_estimate(
            cfg, plan.hardware, measured=found, catalog=estimate.catalog_prices(plan.offers), max_cost=max_cost
        )
    measured = None
    if lookup:
        measured = history.find(
            plan.tracking_uri, estimate.shape_key(tc, bool(plan.hardware.gpu)), plan.hardware.accelerator, cfg, tc
        )
    return estimate.estimate(
        cfg,
        plan.hardware,
        plan.backend,
        measured=measured,
        catalog=estimate.catalog_prices(plan.offers),
        max_cost=max_cost,
        tc=tc,
    )
