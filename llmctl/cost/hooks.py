"""What ``llmctl launch`` and ``llmctl status`` do about cost, in the order they do it.

1. ``check_budget``: refuse (before any MLflow run or run directory exists) when the estimate is above
   ``--max-cost``.
2. ``on_launch``: tag the run (accelerator, shape, price snapshot and its source), log the estimate
   (``cost/estimate_usd``, ``time/estimate_h``, ``estimate.json``), open billing attempt 1, and
   return the environment the workload's budget guard reads.
3. ``on_end``: close the attempt, log calibration (``history.calibration``) and the ledger, and
   report whether the workload stopped itself on the budget.
4. ``status_lines``: ``llmctl status RUN`` refreshes the ledger (an open attempt counts to now).
Every step after 1 is best-effort: cost bookkeeping never turns a good run into a failed one.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Optional

from llmctl.errors import ConfigError

EXIT_BUDGET = 4  # `llmctl launch`: the run was stopped by its budget guard (MLflow: FINISHED + llmctl.status)
TAG_BUDGET_STOP = "llmctl.budget_stop"  # JSON written by the workload's rank 0 when it stops on budget
ENV_PRICE = "LLMCTL_PRICE_PER_HOUR"  # $/h of the whole job (all nodes)
ENV_MAX_COST = "LLMCTL_MAX_COST_USD"
ENV_BILLING_START = "LLMCTL_BILLING_START"  # epoch seconds: when this attempt's billing started
ENV_SPENT = "LLMCTL_SPENT_USD"  # spend of earlier attempts (a resumed run)


def check_budget(plan: Any, max_cost: Optional[float]) -> None:
    """Refuse a launch whose estimate exceeds ``max_cost``; nothing has been created yet."""
    if max_cost is None:
        return
    est = getattr(plan, "estimate", None)
    if est is None:
        raise ConfigError(f"--max-cost ${max_cost:,.2f} cannot be checked: no cost estimate for this plan"
                          " (see the notes of `llmctl plan`)")
    est.max_cost = max_cost
    if est.over_budget:
        raise ConfigError(f"estimated cost ${est.total_usd:,.2f} ({est.price.label}, wall {est.wall_h:.2f} h,"
                          f" throughput {est.throughput.kind}) exceeds --max-cost ${max_cost:,.2f}; nothing was"
                          " launched. Fix: fewer train.steps, a cheaper infra or offer, or a higher --max-cost")


def _warn(what: str, exc: BaseException) -> None:
    print(f"llmctl: warning: {what} failed ({type(exc).__name__}: {exc}); the run itself is unaffected",
          file=sys.stderr, flush=True)


def on_launch(handle: Any, plan: Any, max_cost: Optional[float]) -> tuple[Optional[int], dict[str, str]]:
    """Record the estimate and open billing attempt 1. Returns (attempt number, worker environment)."""
    from llmctl.cost import ledger
    from llmctl.cost.estimate import hardware_of, shape_key
    from llmctl.cost.history import TAG_ACCELERATOR, TAG_SHAPE
    from llmctl.tracking import client

    start = time.time()
    est = getattr(plan, "estimate", None)
    price = est.price.usd_per_hour if est else 0.0
    env = {ENV_BILLING_START: f"{start:.3f}", ENV_PRICE: f"{price:.6f}", ENV_SPENT: "0"}
    if max_cost is not None:
        env[ENV_MAX_COST] = f"{max_cost:.6f}"
    try:
        from mlflow.entities import Metric, RunTag

        mc = client(handle.uri)
        hw = est.hw if est else hardware_of(plan)
        tags = {TAG_ACCELERATOR: hw.accelerator, TAG_SHAPE: shape_key(plan.cfg)}
        metrics = {}
        if est:
            tags.update({"llmctl.price.usd_per_hour": f"{price:.4f}",
                         "llmctl.price.source": f"{est.price.label}; {est.price.source}",
                         "llmctl.estimate.source": est.throughput.source})
            metrics = {"cost/estimate_usd": est.total_usd, "time/estimate_h": est.wall_h,
                       "cost/estimate_device_hours": est.device_hours}
            mc.log_dict(handle.run_id, {**est.to_json(), "priced_at": start}, "estimate.json")
        if max_cost is not None:
            tags["llmctl.max_cost_usd"] = f"{max_cost:.2f}"
        ts = int(start * 1000)
        mc.log_batch(handle.run_id, metrics=[Metric(k, v, ts, 0) for k, v in metrics.items()],
                     tags=[RunTag(k, v[:5000]) for k, v in tags.items()])
        n = ledger.open_attempt(mc, handle.run_id, usd_per_hour=price, nodes=hw.nodes, devices=hw.devices,
                                start=start)
        return n, env
    except Exception as exc:  # noqa: BLE001
        _warn("recording the cost estimate", exc)
        return None, env


def on_end(handle: Any, plan: Any, attempt: Optional[int]) -> tuple[Optional[str], str]:
    """Close the open attempt(s), log calibration and ledger. Returns (budget-stop reason or None, a cost line)."""
    from llmctl.cost import history, ledger
    from llmctl.tracking import client

    try:
        mc = client(handle.uri)
        end = time.time()
        # every attempt still open ends now: the controller's own, or the newest one a managed job's
        # in-job recovery opened (the workload already closed the controller's at that recovery)
        for a in ledger.attempts(mc.get_run(handle.run_id).data.tags):
            if a.end is None:
                ledger.close_attempt(mc, handle.run_id, a.n, end)
        run = mc.get_run(handle.run_id)
        this = [a for a in ledger.attempts(run.data.tags) if a.n == attempt]
        if this and len(ledger.attempts(run.data.tags)) == 1:  # one clean attempt: a calibration point
            from mlflow.entities import Metric

            cal = history.calibration(mc, handle.run_id, plan.cfg, end - this[0].start)
            mc.log_batch(handle.run_id, metrics=[Metric(k, v, int(end * 1000), 0) for k, v in cal.items()])
        led = ledger.update(mc, handle.run_id, end)
        stop = run.data.tags.get(TAG_BUDGET_STOP)
    except Exception as exc:  # noqa: BLE001
        _warn("recording the run's cost", exc)
        return None, ""
    est = getattr(plan, "estimate", None)
    line = "llmctl: " + led.describe().split(":", 1)[1].strip() + (f" (estimated ${est.total_usd:,.2f})" if est else "")
    return (budget_reason(stop) if stop else None), line


def budget_reason(stop: str) -> str:
    """The run's final ``llmctl.status`` from the workload's ``llmctl.budget_stop`` tag."""
    try:
        info = json.loads(stop)
        return (f"stopped: budget ${float(info['max_cost_usd']):,.2f} reached at step {info['step']}"
                f" (spent ${float(info['spent_usd']):,.2f}; checkpoint {'saved' if info.get('checkpoint') else 'none'})")
    except (ValueError, KeyError, TypeError):
        return f"stopped: budget reached ({stop[:200]})"


def status_lines(uri: str, run: Any) -> list[str]:
    """Estimate vs ledger for ``llmctl status RUN``; refreshes ``cost/*`` on the run."""
    from llmctl.cost import ledger
    from llmctl.tracking import client

    lines = []
    est = run.data.metrics.get("cost/estimate_usd")
    if est is not None:
        lines.append(f"estimate:    ${est:,.2f}, {run.data.metrics.get('time/estimate_h', 0) * 3600:,.0f} s"
                     f" ({run.data.tags.get('llmctl.estimate.source', '?')[:120]})")
    if not ledger.attempts(run.data.tags):
        return lines
    try:
        led = ledger.update(client(uri), run.info.run_id)
    except Exception as exc:  # noqa: BLE001 - a read-only store still gets the numbers
        led = ledger.compute(run.data.tags)
        lines.append(f"note:        ledger not saved ({type(exc).__name__})")
    return lines + [led.describe()]
