"""What a run's lifecycle does about cost (``llmctl.run.lifecycle`` calls these, in this order).

1. ``check_budget``: refuse (before any MLflow run exists, or before a resume reopens one) when
   what was spent plus the estimate is above the budget.
2. ``record_estimate``: tag the run (accelerator, shape, price snapshot and its source), log the
   estimate (``cost/estimate_usd``, ``time/estimate_h``, ``estimate.json``).
3. ``close``: bill every open attempt up to now (after ``ledger.reconcile``), log calibration and
   the ledger; return the line that says what it cost.
4. ``status_lines``: ``llmctl status RUN`` refreshes the ledger (an open attempt counts to now).
Every step after 1 is best-effort: cost bookkeeping never turns a good run into a failed one.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Optional

from llmctl.cost.ledger import UNPRICED
from llmctl.errors import ConfigError

TAG_MAX_COST = "llmctl.max_cost_usd"
TAG_PRICE = "llmctl.price.usd_per_hour"  # UNPRICED where nobody said what the infra costs


def check_budget(
    est: Any, max_cost: Optional[float], spent: float = 0.0, run_id: str = "", candidate: str = ""
) -> None:
    """Refuse when ``spent`` (earlier attempts) plus the estimate passes ``max_cost``; nothing changes.
    ``candidate``: which of ``infra.candidates`` ``est`` prices (named first in the refusal)."""
    if max_cost is None:
        return
    if candidate:
        try:
            check_budget(est, max_cost, spent, run_id)
        except ConfigError as exc:
            raise ConfigError(f"{candidate}: {exc}") from None
        return
    if spent >= max_cost:
        raise ConfigError(
            f"run {run_id} has already spent ${spent:,.2f} of --max-cost ${max_cost:,.2f};"
            f" nothing was launched. Fix: a larger budget (llmctl resume {run_id} --max-cost <more>)"
        )
    if est is None:
        raise ConfigError(
            f"--max-cost ${max_cost:,.2f} cannot be checked: no cost estimate for this plan"
            " (see the notes of `llmctl plan`)"
        )
    est.max_cost = max_cost - spent
    refusal = est.budget_refusal()
    if refusal:
        raise ConfigError(f"{refusal}; nothing was launched")
    if est.over_budget:
        so_far = f" + ${spent:,.2f} already spent" if spent else ""
        raise ConfigError(
            f"estimated cost ${est.total_usd:,.2f}{so_far} ({est.price.label}, wall {est.wall_h:.2f} h,"
            f" throughput {est.throughput.kind}) exceeds --max-cost ${max_cost:,.2f}; nothing was"
            " launched. Fix: fewer train.steps, a cheaper infra or offer, or a higher --max-cost"
        )


def _warn(what: str, exc: BaseException) -> None:
    print(
        f"llmctl: warning: {what} failed ({type(exc).__name__}: {exc}); the run itself is unaffected",
        file=sys.stderr,
        flush=True,
    )


def record_estimate(mc: Any, run_id: str, plan: Any, max_cost: Optional[float], at: float) -> None:
    """Tags and metrics of what the run was expected to cost (``llmctl.shape``/``llmctl.accelerator``
    are what the next estimate of this shape looks for)."""
    from mlflow.entities import RunTag

    from llmctl.config.workload import is_command
    from llmctl.cost import ledger
    from llmctl.cost.estimate import command_key, shape_key
    from llmctl.cost.history import TAG_ACCELERATOR, TAG_FLOPS, TAG_SHAPE

    try:
        est = plan.estimate
        shape = command_key(plan.cfg) if is_command(plan.cfg) else shape_key(plan.typed, bool(plan.hardware.gpu))
        tags = {TAG_ACCELERATOR: plan.hardware.accelerator, TAG_SHAPE: shape[:5000]}
        metrics = {}
        if est:
            tags.update(
                {
                    TAG_FLOPS: str(est.flops_per_token),
                    TAG_PRICE: f"{est.price.usd_per_hour:.4f}" if est.priced else UNPRICED,
                    "llmctl.price.source": f"{est.price.label}; {est.price.source}",
                    "llmctl.estimate.source": est.throughput.source,
                }
            )
            # a program with no known hours has no estimate to chart (not a $0 one)
            known = est.throughput.kind != "unknown"
            metrics = {"time/estimate_h": est.wall_h, "cost/estimate_device_hours": est.device_hours} if known else {}
            if est.priced and known:  # unpriced: no $0 that reads like a price
                metrics["cost/estimate_usd"] = est.total_usd
            mc.log_dict(run_id, {**est.to_json(), "priced_at": at}, "estimate.json")
        if max_cost is not None:
            tags[TAG_MAX_COST] = f"{max_cost:.2f}"
        mc.log_batch(
            run_id,
            metrics=ledger.charted_metrics(metrics, 0),
            tags=[RunTag(k, v[:5000]) for k, v in tags.items()] + ledger.figure_tags(metrics),
        )
    except Exception as exc:
        _warn("recording the cost estimate", exc)


def close(
    mc: Any, run_id: str, cfg: Optional[dict[str, Any]], est: Any, status: str, end: Optional[float] = None
) -> str:
    """Bill the attempt(s) to ``end`` (when the job ended; default now), calibrate (a run of one clean
    attempt, when ``cfg`` is given), refresh ``cost/*``. Returns one line for the terminal ("" if
    nothing was billed)."""
    from llmctl.cost import history, ledger

    try:
        end = time.time() if end is None else end
        ledger.reconcile(mc, run_id)
        ledger.close_open(mc, run_id, end, status)
        done = ledger.attempts(mc.get_run(run_id).data.tags)
        if not done:  # never started (a pending trial, a sweep's parent run): nothing to bill
            return ""
        # every attempt: the steps done so far (a resumed run has trained past its first attempt's)
        cal = {"train/steps_done": float(history.steps_done(mc, run_id))}
        if len(done) == 1 and cfg is not None:  # one clean attempt: a calibration point for the next estimate
            cal = history.calibration(mc, run_id, cfg, end - done[0].start)
        mc.log_batch(run_id, tags=ledger.figure_tags(cal))  # one-value figures: tags, not single-point charts
        led = ledger.update(mc, run_id, end)
    except Exception as exc:
        _warn("recording the run's cost", exc)
        return ""
    return "llmctl: " + led.describe().split(":", 1)[1].strip() + (f" (estimated {est.total_text})" if est else "")


def budget_reason(stop: str) -> str:
    """The run's final ``llmctl.status`` from the workload's ``llmctl.budget_stop`` tag."""
    try:
        info = json.loads(stop)
        at = f"at step {info['step']}" if info.get("step") is not None else "(the program stopped on SIGTERM)"
        return (
            f"stopped: budget ${float(info['max_cost_usd']):,.2f} reached {at}"
            f" (spent ${float(info['spent_usd']):,.2f}; checkpoint {'saved' if info.get('checkpoint') else 'none'})"
        )
    except (ValueError, KeyError, TypeError):
        return f"stopped: budget reached ({stop[:200]})"


def status_lines(uri: str, run: Any) -> list[str]:
    """Estimate vs ledger for ``llmctl status RUN``; refreshes ``cost/*`` on the run."""
    from llmctl.cost import ledger
    from llmctl.tracking.mlflow_run import client

    lines = []
    figures = ledger.figures(run)
    est = figures.get("cost/estimate_usd")
    text = UNPRICED if run.data.tags.get(TAG_PRICE) == UNPRICED else (None if est is None else f"${est:,.2f}")
    if text is not None:
        lines.append(
            f"estimate:    {text}, {figures.get('time/estimate_h', 0) * 3600:,.0f} s"
            f" ({run.data.tags.get('llmctl.estimate.source', '?')})"
        )
    if not ledger.attempts(run.data.tags):
        return lines
    tags = run.data.tags
    try:
        mc = client(uri)
        ledger.reconcile(mc, run.info.run_id)
        led = ledger.update(mc, run.info.run_id)
        tags = mc.get_run(run.info.run_id).data.tags
    except Exception as exc:
        led = ledger.compute(run.data.tags)
        lines.append(f"note:        ledger not saved ({type(exc).__name__})")
    return lines + [led.describe(), *served_lines(led, tags)]


def served_lines(led: Any, tags: Any) -> list[str]:
    """What served each attempt of a run over ``infra.candidates``, at what price (none otherwise)."""
    from llmctl.cost import ledger

    lines = []
    for a in led.attempts:
        where = tags.get(f"{ledger.PREFIX}{a.n}.served")
        if where:
            price = ledger.UNPRICED if a.usd_per_hour is None else f"${a.usd_per_hour:,.2f}/h"
            lines.append(f"{f'attempt {a.n}:':<12} {where}, {price}")
    return lines
