"""A job of its own attached to a run that is not running (``llmctl eval RUN --tasks`` on the
run's infra): billed as the run's next attempt, closed with its own outcome, the run's status left
as the training's; and the close of such an attempt whose controller is gone."""

from __future__ import annotations

import signal
import time
from typing import Any, Callable, Optional

from llmctl.backends import backend_for
from llmctl.config.compose import to_yaml
from llmctl.config.notify import masked
from llmctl.controller.procs import (
    Interrupted,
    clear_stop_requests,
    ignore_late_stop,
    install_stop_handlers,
    live_controller,
    raise_interrupted,
    record_controller,
    restore_handlers,
)
from llmctl.controller.workdir import run_dir
from llmctl.cost import ledger
from llmctl.errors import ConfigError, LaunchError
from llmctl.plan.job_plan import Plan
from llmctl.run.closing import run_tag, upload_log, warn_close
from llmctl.tracking import mlflow_run as tracking
from llmctl.tracking.mlflow_run import RunHandle
from workloads.protocol.run_contract import ENV_ATTEMPT

Say = Callable[..., None]  # typer.echo's shape: say(text, err=False)


def attach(plan: Plan, uri: str, run: Any, *, kind: str, say: Say) -> int:
    """Run ``plan`` (``plan.job``: "score", lm-eval on a checkpoint) as a job of its own on the run's
    infra, attached to ``run``: billed as the run's next attempt, tagged ``kind`` (``llmctl.attempt.<n>.kind``:
    ``llmctl cost`` counts it, nothing takes it for a training attempt), closed with its outcome whatever
    happens (a stop request cancels the job), its output uploaded as ``attempts/<n>/output.log`` and its
    config as ``attempts/<n>/config.yaml``. The run's status, params and ``config.yaml`` stay the
    training's: a resume reads them. A run still RUNNING is refused (ConfigError, nothing created): its
    open attempt would take this one's end as its own. The exit code: 0, 1 (failed), 130/143 (stopped)."""
    from llmctl.backends.base import log_name

    rid = run.info.run_id
    check_attachable(run, kind)
    backend = backend_for(plan.backend)
    backend.preflight(plan)
    mc = tracking.client(uri)
    est, hw = plan.estimate, plan.hardware
    price = (est.price.usd_per_hour if est.priced else None) if est else None  # None: unpriced, not $0
    n = ledger.open_attempt(
        mc,
        rid,
        usd_per_hour=price,
        nodes=hw.nodes,
        devices=hw.devices,
        extra={"kind": kind, "infra": plan.cfg["infra"]["name"], "world_size": plan.world_size},
    )
    handle = RunHandle(uri=uri, run_id=rid, experiment_id=run.info.experiment_id, attempt_env={ENV_ATTEMPT: str(n)})
    record_controller(rid)  # gone without closing (SIGKILL): `llmctl status` closes the attempt (close_orphaned)
    clear_stop_requests()
    previous = install_stop_handlers(raise_interrupted)
    started = time.monotonic()
    code: Optional[int] = None
    error: Optional[BaseException] = None
    try:
        mc.log_text(rid, tracking.redact(to_yaml(masked(plan.cfg))), f"attempts/{n}/config.yaml")
        say(f"llmctl: {kind} job of run {rid} (attempt {n}) on {plan.where}")
        code = backend.launch(plan, handle)
    except Interrupted as exc:
        error = exc
    except KeyboardInterrupt:
        error = Interrupted(signal.SIGINT)
    except Exception as exc:
        error = exc
    finally:
        install_stop_handlers(ignore_late_stop, previous)
    try:
        if isinstance(error, Interrupted):
            exit_code = 130 if error.signum == signal.SIGINT else 143
            status = f"{kind}: stopped by {signal.Signals(error.signum or signal.SIGTERM).name}"
        elif error is not None:
            exit_code = 1
            what = str(error) if isinstance(error, LaunchError) else f"{type(error).__name__}: {error}"
            status = f"{kind}: failed: {tracking.redact(what)}"
        else:
            exit_code = 0 if code == 0 else 1
            status = f"{kind}: finished" if code == 0 else f"{kind}: failed: the job exited with code {code}"
        cost_line = _close_attached(mc, rid, n, status[:500], log_name(plan.job))
    finally:
        restore_handlers(previous)
    if exit_code == 0:
        say(f"llmctl: {kind} job of run {rid} finished in {time.monotonic() - started:.0f} s")
        if cost_line:
            say(cost_line)
    else:
        say(
            f"error: {kind} job of run {rid} (attempt {n}): {status} (log: {run_dir(rid) / log_name(plan.job)})",
            err=True,
        )
    if error is not None and not isinstance(error, (Interrupted, LaunchError)):
        raise error
    return exit_code


def check_attachable(run: Any, kind: str) -> None:
    """A job can be attached to a run that is not running (ConfigError otherwise, before anything exists)."""
    rid = run.info.run_id
    if run.info.status == "RUNNING":
        raise ConfigError(
            f"run {rid} is still running: a {kind} job of its own would overlap its open attempt. Fix: score"
            f" its checkpoints as it trains (eval.tasks=[...]), wait for it to end (llmctl status {rid}),"
            " or score here: --here"
        )


def close_orphaned(uri: str, run: Any) -> Optional[str]:
    """An attached job's attempt (``attach``) left open by a controller that is gone (SIGKILL, the
    machine lost): closed at its last sign of life (its output's last write, else its start), with that
    said on its ``.status``. ``llmctl status RUN`` calls this for a run that is not running; the line it
    shows, or None when there was nothing to close."""
    from llmctl.backends.base import log_name

    tags, rid = run.data.tags, run.info.run_id
    orphans = [
        a
        for a in ledger.attempts(tags)
        if a.end is None and tags.get(f"{ledger.PREFIX}{a.n}.kind") and not tags.get(f"{ledger.PREFIX}{a.n}.status")
    ]
    if not orphans or run.info.status == "RUNNING" or live_controller(rid) is not None:
        return None
    mc = tracking.client(uri)
    for a in orphans:
        kind = tags[f"{ledger.PREFIX}{a.n}.kind"]
        try:
            end = max(a.start, (run_dir(rid) / log_name("score")).stat().st_mtime)
        except OSError:
            end = a.start
        status = f"{kind}: its controller ended without closing it (killed); billed to its last output"
        mc.log_batch(
            rid,
            tags=[
                run_tag(f"{ledger.PREFIX}{a.n}.end", ledger.stamp(end)),
                run_tag(f"{ledger.PREFIX}{a.n}.status", status),
            ],
        )
    ledger.update(mc, rid)
    return f"ledger:      closed attempt(s) {', '.join(str(a.n) for a in orphans)}: their controller was gone"


def _close_attached(mc: Any, rid: str, n: int, status: str, log: str) -> str:
    """An attached job's attempt: its end and outcome, the run's ledger, its output; best-effort past the
    end (a store gone mid-close loses the rest, not the end). The cost line, or ""."""
    from mlflow.entities import RunTag

    mc.log_batch(
        rid,
        tags=[
            RunTag(f"{ledger.PREFIX}{n}.end", ledger.stamp(time.time())),
            run_tag(f"{ledger.PREFIX}{n}.status", status),
        ],
    )
    cost_line = ""
    try:
        led = ledger.update(mc, rid)
        cost_line = "llmctl: run " + led.describe().split(":", 1)[1].strip()
    except Exception as exc:
        warn_close("recording the run's cost", exc)
    try:
        upload_log(mc, rid, n, log)
    except Exception as exc:
        warn_close(f"uploading {log}", exc)
    return cost_line
