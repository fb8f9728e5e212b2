"""One run lifecycle: a plan and a backend in, an attempt that ran and was closed out.

The only place that opens, closes and bills attempts and sets a run's final status. Entry points:

- ``launch``: a new MLflow run (``llmctl launch``);
- ``resume``: the same run, attempt n+1 (``llmctl resume``);
- ``trial``: a run the sweep supervisor created (``llmctl launch -m``);
- ``attach``: a job of its own attached to a run that is not running (``llmctl eval RUN --tasks`` on
  the run's infra), billed as one more attempt of the run; the run's status stays the training's;
- ``close_run``: a run whose controller is gone (``llmctl down``, a dead trial controller, a job
  SkyPilot reports ended). ``llmctl smoke`` drives the CLI, so it goes through the same code.

Each attempt goes: open it (ledger tags, the workload's environment) → ``backend.finalize`` → record
the config → ``backend.launch`` under SIGINT/SIGTERM handling → read the outcome from the exit
code, the stop request and the workload's tags → bill it (``cost.hooks.close``) → upload its
``output.log`` and log the final and best checkpoints as MLflow models → set the MLflow
status and ``llmctl.status`` → the exit code. The outcome → (status, exit code) table is ``RULES``
(shown in docs/concepts.md).
"""

from __future__ import annotations

import enum
import json
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, TextIO

from llmctl.backends import backend_for
from llmctl.backends.base import Backend
from llmctl.config.compose import to_yaml
from llmctl.config.workload import is_command
from llmctl.controller.procs import (
    Interrupted,
    clear_stop_requests,
    live_controller,
    raise_interrupted,
    record_controller,
    stop_requested,
)
from llmctl.controller.workdir import JOB_END_FILE, read_json, run_dir, update_json
from llmctl.cost import hooks, ledger
from llmctl.errors import ConfigError, LaunchError
from llmctl.plan import data_check, task_check
from llmctl.plan.job_plan import Plan
from llmctl.tracking import mlflow_run as tracking
from llmctl.tracking.mlflow_run import RunHandle
from workloads.protocol.run_contract import (
    ENV_ATTEMPT,
    ENV_BILLING_START,
    ENV_MAX_COST,
    ENV_PRICE,
    ENV_SPENT,
    TAG_BUDGET_STOP,
    TAG_COMPLETED,
    TAG_PREEMPTED,
)

TAG_BACKEND = "llmctl.backend"  # backend of the latest attempt (params keep the first attempt's infra.kind)
# who asked the running attempt to stop, set before the signal is sent ({"by": "llmctl down"}, or a
# sweep's pruner: {"by": ..., "what": "pruned", "resume": false}): the controller then reports the stop
# as the requested one it is, not as a preemption or an error
TAG_STOP_REQUEST = "llmctl.stop_request"
TERMINAL = ("FINISHED", "FAILED", "KILLED")
# the stop requests the controller acts on: Ctrl-C, SIGTERM (llmctl down, a scheduler) and SIGHUP
# (the SSH session or terminal it ran in is gone); SIGTERM and SIGHUP are passed to the workers
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
Say = Callable[..., None]  # typer.echo's shape: say(text, err=False)


class Outcome(str, enum.Enum):
    FINISHED = "finished"
    BUDGET_STOP = "budget_stop"
    PREEMPTED = "preempted"
    INTERRUPTED = "interrupted"
    KILLED = "killed"
    FAILED = "failed"


@dataclass(frozen=True)
class Rule:
    mlflow_status: str
    exit_code: int
    when: str


RULES: dict[Outcome, Rule] = {
    Outcome.FINISHED: Rule("FINISHED", 0, "the workload exited 0"),
    Outcome.BUDGET_STOP: Rule(
        "FINISHED",
        4,
        "the workload's budget guard stopped it after a checkpoint (tag"
        " llmctl.budget_stop); continue with `llmctl resume RUN --max-cost <more>`",
    ),
    Outcome.PREEMPTED: Rule(
        "KILLED",
        75,
        "the workload was told to stop (SIGTERM/SIGUSR1: a spot reclaim, scancel,"
        " llmctl down, a sweep's pruner) and saved its state (tag llmctl.preempted); `llmctl resume RUN`."
        " A stop someone asked for (llmctl down, the pruner) says so, as information, not an error; it"
        " exits 75 all the same: the run did not finish, and resumes",
    ),
    Outcome.INTERRUPTED: Rule("KILLED", 130, "Ctrl-C (SIGINT) to llmctl: the workers were stopped"),
    Outcome.KILLED: Rule(
        "KILLED",
        143,
        "SIGTERM or SIGHUP to llmctl that did not end in the workers' checkpoint"
        " (before they started, a second SIGTERM, or workers that did not stop in time)",
    ),
    Outcome.FAILED: Rule(
        "FAILED",
        1,
        "the workload exited non-zero without a preemption tag, could not start, or llmctl itself failed"
        " (the error is re-raised after the run is closed)",
    ),
}


@dataclass
class Attempt:
    n: int
    start: float
    max_cost: Optional[float]
    spent_before: float


# ----------------------------------------------------------------------------- entry points


IGNORE_MEMORY_PLAN = "--ignore-memory-plan"


def check_memory(plan: Plan, ignore: bool = False, say: Optional[Say] = None) -> None:
    """Refuse (ConfigError, before anything exists) a job whose memory plan exceeds its devices,
    unless ``ignore`` (``--ignore-memory-plan``): the plan's CUDA rules are not yet measured on a GPU
    (docs/scale.md), so a user who knows better can go past it, and is told what was overridden."""
    fit = plan.memory
    if fit is None or fit.fits is not False:
        return
    if ignore:
        if say is not None:
            say(f"llmctl: launching past the memory plan ({IGNORE_MEMORY_PLAN}): {fit.verdict()}")
        return
    fix = f" Fix: add {' '.join(fit.fix)} to the command." if fit.fix else ""
    raise ConfigError(
        f"the job would run out of memory: {fit.verdict()}.{fix} (`llmctl plan` shows the memory by part;"
        f" {IGNORE_MEMORY_PLAN} launches anyway: the plan's CUDA rules are not yet measured on a GPU, docs/scale.md)"
    )


def launch(plan: Plan, *, max_cost: Optional[float], say: Say, ignore_memory_plan: bool = False) -> int:
    """``llmctl launch``: preflight and budget (ConfigError, before anything exists), then a new run."""
    backend = backend_for(plan.backend)
    check_memory(plan, ignore_memory_plan, say)
    hooks.check_budget(plan.estimate, max_cost)  # before preflight: the plan alone decides it
    backend.preflight(plan)
    data_check.check_plan(plan, say)  # bad records, no files, a validation split too short: refused now
    task_check.check_plan(plan)  # eval.tasks: known lm-eval tasks whose data can be read
    return _run(
        plan,
        backend,
        lambda: tracking.create_run(plan.cfg, plan.choices),
        lambda handle: _open_attempt(handle, plan, max_cost, spent=0.0, from_step=0, first=True),
        new_run=True,
        say=say,
        banner=lambda handle, attempt: (
            f"llmctl: run {handle.run_id} on {plan.where}, {plan.world_size} process(es) on {plan.device}"
        ),
    )


def trial(
    plan: Plan, handle: RunHandle, *, max_cost: Optional[float], say: Say, workload_out: Optional[TextIO] = None
) -> int:
    """One sweep trial, in the run its supervisor created (preflight ran when the sweep started)."""
    backend = backend_for(plan.backend)

    def reopen() -> RunHandle:
        tracking.client(handle.uri).update_run(handle.run_id, status="RUNNING")
        return handle

    return _run(
        plan,
        backend,
        reopen,
        lambda handle: _open_attempt(handle, plan, max_cost, spent=0.0, from_step=0, first=True),
        new_run=True,
        say=say,
        workload_out=workload_out,
        banner=lambda handle, attempt: (
            f"run {handle.run_id} on {plan.where}, {plan.world_size} process(es) on {plan.device}"
        ),
    )


def resume(
    plan: Plan,
    uri: str,
    run: Any,
    *,
    from_step: Optional[int],
    remaining: Any,
    max_cost: Optional[float],
    say: Say,
    where: str,
    ignore_memory_plan: bool = False,
) -> int:
    """``llmctl resume``: attempt n+1 of ``run`` (found in the store ``uri``). ``remaining`` is the
    estimate of the steps left; ``max_cost`` (else the run's stored budget) covers the whole run,
    earlier attempts included."""
    backend = backend_for(plan.backend)
    check_memory(plan, ignore_memory_plan, say)
    backend.preflight(plan)
    data_check.check_plan(plan, say)
    task_check.check_plan(plan)
    rid = run.info.run_id
    mc = tracking.client(uri)
    ledger.reconcile(mc, rid)  # a managed job's recoveries are attempts before this one is numbered
    run = mc.get_run(rid)
    previous_end = ended_at_of(run) or time.time()  # when its job ended, not when it was looked at
    spent = ledger.compute(run.data.tags, now=previous_end).actual_usd
    stored = run.data.tags.get(hooks.TAG_MAX_COST)
    budget = max_cost if max_cost is not None else (float(stored) if stored else None)
    hooks.check_budget(remaining, budget, spent, rid)  # refuse before the run is touched

    def reopen() -> RunHandle:
        # the previous attempt ends where its controller left it; what it was stays on its tags
        status = (run.data.tags.get("llmctl.status") or run.info.status.lower())[:500]
        ledger.close_open(mc, rid, previous_end, status)
        for tag in (TAG_PREEMPTED, TAG_BUDGET_STOP, TAG_COMPLETED, TAG_STOP_REQUEST):  # the previous attempt's facts
            if tag in run.data.tags:
                mc.delete_tag(rid, tag)
        if max_cost is not None:
            mc.set_tag(rid, hooks.TAG_MAX_COST, f"{max_cost:.2f}")
        mc.update_run(rid, status="RUNNING")
        return RunHandle(uri=uri, run_id=rid, experiment_id=run.info.experiment_id)

    return _run(
        plan,
        backend,
        reopen,
        lambda handle: _open_attempt(handle, plan, budget, spent=spent, from_step=from_step or 0, first=False),
        new_run=False,
        say=say,
        banner=lambda handle, attempt: (
            f"llmctl: resuming run {rid} (attempt {attempt.n}) {where} on {plan.where},"
            f" {plan.world_size} process(es) on {plan.device}"
        ),
    )


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
    previous = _install(raise_interrupted)
    started = time.monotonic()
    code: Optional[int] = None
    error: Optional[BaseException] = None
    try:
        mc.log_text(rid, tracking.redact(to_yaml(plan.cfg)), f"attempts/{n}/config.yaml")
        say(f"llmctl: {kind} job of run {rid} (attempt {n}) on {plan.where}")
        code = backend.launch(plan, handle)
    except Interrupted as exc:
        error = exc
    except KeyboardInterrupt:
        error = Interrupted(signal.SIGINT)
    except Exception as exc:
        error = exc
    finally:
        _install(_note_late_stop, previous)
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
        for sig, handler in previous.items():
            signal.signal(sig, handler)
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
            tags=[_tag(f"{ledger.PREFIX}{a.n}.end", ledger.stamp(end)), _tag(f"{ledger.PREFIX}{a.n}.status", status)],
        )
    ledger.update(mc, rid)
    return f"ledger:      closed attempt(s) {', '.join(str(a.n) for a in orphans)}: their controller was gone"


def _close_attached(mc: Any, rid: str, n: int, status: str, log: str) -> str:
    """An attached job's attempt: its end and outcome, the run's ledger, its output; best-effort past the
    end (a store gone mid-close loses the rest, not the end). The cost line, or ""."""
    from mlflow.entities import RunTag

    mc.log_batch(
        rid,
        tags=[RunTag(f"{ledger.PREFIX}{n}.end", ledger.stamp(time.time())), _tag(f"{ledger.PREFIX}{n}.status", status)],
    )
    cost_line = ""
    try:
        led = ledger.update(mc, rid)
        cost_line = "llmctl: run " + led.describe().split(":", 1)[1].strip()
    except Exception as exc:
        _warn_close("recording the run's cost", exc)
    try:
        _upload_log(mc, rid, n, log)
    except Exception as exc:
        _warn_close(f"uploading {log}", exc)
    return cost_line


def close_run(uri: str, run_id: str, outcome: Outcome, reason: str, end: Optional[float] = None) -> None:
    """Close a run nobody is running any more: bill its open attempts to ``end`` (when its job ended,
    as the backend or the controller's record says; else now), set its status."""
    mc = tracking.client(uri)
    run = mc.get_run(run_id)
    if run.info.status in TERMINAL:
        return
    hooks.close(mc, run_id, None, None, reason, end=end)
    tracking.end_run(RunHandle(uri, run_id, run.info.experiment_id), RULES[outcome].mlflow_status, reason, end)


def ended_at_of(run: Any, ended_at: Optional[float] = None) -> Optional[float]:
    """When a run's job ended: the run's own end time once closed; else what was recorded when the
    job ended (``job_end.json``), else the backend's word (``ended_at``), else the job's last sign of
    life (its newest metric; the system metrics keep coming while any worker runs); None: unknown."""
    if run.info.end_time:
        return run.info.end_time / 1000
    rec = job_end(run.info.run_id, run).get("time")
    if isinstance(rec, (int, float)):
        return float(rec)
    if ended_at is not None:
        return ended_at
    seen = [m.timestamp for m in getattr(run.data, "_metric_objs", None) or [] if m.timestamp]
    return max(seen) / 1000 if seen else None


def job_end(run_id: str, run: Any = None) -> dict[str, Any]:
    """What this machine recorded about the run's job end (``job_end.json``: time, exit code, and the
    controller's outcome when it got that far), {} if nothing. With ``run``: {} too when the record is
    of an earlier attempt than the run's newest (one a launcher opened; a managed job's recoveries,
    numbered after it by ``ledger.reconcile``, belong to the same launch)."""
    rec = read_json(run_id, JOB_END_FILE)
    if run is None or not rec:
        return rec
    n, tags = rec.get("attempt"), run.data.tags
    if not isinstance(n, int):
        return {}
    later = [a.n for a in ledger.attempts(tags) if a.n > n and f"{ledger.PREFIX}{a.n}.start_seq" not in tags]
    return {} if later else rec


def close_ended(
    uri: str, run: Any, outcome: Outcome, reason: str, ended_at: Optional[float] = None
) -> Optional[Outcome]:
    """Close a RUNNING run whose job has ended or was stopped (``llmctl status`` when its backend reports
    the end, ``llmctl down``): with ``outcome`` and ``reason``, billed to ``ended_at`` (the backend's
    word on when), unless its controller is alive here and closes it itself (one closer per run).
    What the controller recorded wins: its outcome, the exit code it saw, its end time. Returns the
    outcome it was closed with, or None when it was left to its controller."""
    rid = run.info.run_id
    if live_controller(rid) is not None:
        return None
    rec = job_end(rid, run)
    end = ended_at_of(run, ended_at)
    if rec.get("outcome") in {o.value for o in Outcome}:
        outcome, reason = Outcome(rec["outcome"]), str(rec.get("reason") or rec["outcome"])
        if not rec.get("tags_read", True) and isinstance(rec.get("code"), int):  # the store was down then
            outcome, reason = classify(rec["code"], None, run.data.tags, rid, rec.get("stop"), rec.get("attempt"))
    elif isinstance(rec.get("code"), int):  # the workers' exit was seen, the controller did not close
        outcome, reason = classify(rec["code"], None, run.data.tags, rid, rec.get("stop"), rec.get("attempt"))
    close_run(uri, rid, outcome, reason, end)
    return outcome


# ----------------------------------------------------------------------------- one attempt


def _open_attempt(
    handle: RunHandle, plan: Plan, max_cost: Optional[float], spent: float, from_step: int, first: bool
) -> Attempt:
    """Ledger attempt n (price snapshot, size, where) and the workload's environment for it; the
    first attempt also records the estimate."""
    mc = tracking.client(handle.uri)
    start = time.time()
    est = plan.estimate
    if first:
        hooks.record_estimate(mc, handle.run_id, plan, max_cost, start)
    price = (est.price.usd_per_hour if est.priced else None) if est else 0.0  # None: unpriced, not $0
    hw = plan.hardware
    n = ledger.open_attempt(
        mc,
        handle.run_id,
        usd_per_hour=price,
        nodes=hw.nodes,
        devices=hw.devices,
        start=start,
        extra={
            "infra": plan.cfg["infra"]["name"],
            "world_size": plan.world_size,
            "from_step": from_step,
            # the trainer's step target (a user's program counts its own steps)
            **({} if is_command(plan.cfg) else {"train_steps": plan.cfg["train"]["steps"]}),
        },
    )
    mc.log_batch(
        handle.run_id,
        tags=[
            _tag(k, v)
            for k, v in {
                "llmctl.infra": plan.cfg["infra"]["name"],
                TAG_BACKEND: plan.backend,
                "llmctl.status": f"running: attempt {n}" + (f" from step {from_step}" if from_step else ""),
            }.items()
        ],
    )
    handle.attempt_env = {
        ENV_ATTEMPT: str(n),
        ENV_BILLING_START: f"{start:.3f}",
        ENV_PRICE: f"{price or 0.0:.6f}",
        ENV_SPENT: f"{spent:.6f}",
    }
    if max_cost is not None:
        handle.attempt_env[ENV_MAX_COST] = f"{max_cost:.6f}"
    return Attempt(n, start, max_cost, spent)


def _tag(key: str, value: str) -> Any:
    from mlflow.entities import RunTag

    return RunTag(key, tracking.redact(value)[:5000])


def _run(
    plan: Plan,
    backend: Backend,
    create: Callable[[], RunHandle],
    open_attempt: Callable[[RunHandle], Attempt],
    *,
    new_run: bool,
    say: Say,
    banner: Callable[[RunHandle, Attempt], str],
    workload_out: Optional[TextIO] = None,
) -> int:
    """The one structure that opens and closes a run: ``create`` makes (or reopens) the run and
    ``open_attempt`` opens its attempt with stop signals already turned into ``Interrupted``; from
    then on a stop request, an error starting, or any other exception (a cloud API's, MLflow's, a
    backend bug) ends in a closed attempt and a terminal run, never a run left RUNNING. An unexpected
    exception is re-raised only after that (its traceback still shows; exit code 1)."""
    clear_stop_requests()
    previous = _install(raise_interrupted)
    handle: Optional[RunHandle] = None
    try:
        handle = create()
        attempt = open_attempt(handle)
    except BaseException as exc:
        return _close_unopened(handle, exc, previous, say)
    say(banner(handle, attempt))  # the run id, as soon as the run and its attempt exist
    return _attempt(plan, backend, handle, attempt, previous, new_run=new_run, say=say, workload_out=workload_out)


def _close_unopened(handle: Optional[RunHandle], error: BaseException, previous: dict[int, Any], say: Say) -> int:
    """A stop or an error while the run was being created or its attempt opened: close what exists
    (the attempt, if it was opened, billed to now; the run terminal) and say so. A stop ends with its
    exit code; anything else is re-raised after the close."""
    _install(_note_late_stop, previous)
    try:
        if isinstance(error, KeyboardInterrupt) and not isinstance(error, Interrupted):
            error = Interrupted(signal.SIGINT)
        if handle is None:  # nothing was created: nothing to close
            if isinstance(error, Interrupted):
                return RULES[Outcome.INTERRUPTED if error.signum == signal.SIGINT else Outcome.KILLED].exit_code
            raise error
        outcome, reason = classify(None, error, {}, handle.run_id, stop_requested())
        try:
            close_run(handle.uri, handle.run_id, outcome, reason)
        except Exception as exc:
            _warn_close("closing the run", exc)
        _report(outcome, reason, handle, 0.0, "", say)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not isinstance(error, Interrupted):
        raise error
    return RULES[outcome].exit_code


def _attempt(
    plan: Plan,
    backend: Backend,
    handle: RunHandle,
    attempt: Attempt,
    previous: dict[int, Any],
    *,
    new_run: bool,
    say: Say,
    workload_out: Optional[TextIO] = None,
) -> int:
    """Run the opened attempt and close it, whatever happens (``_run``)."""
    mc = tracking.client(handle.uri)
    started = time.monotonic()
    code: Optional[int] = None
    error: Optional[BaseException] = None
    unexpected: Optional[BaseException] = None
    cfg: Optional[dict[str, Any]] = None
    rdir = run_dir(handle.run_id)
    (rdir / JOB_END_FILE).unlink(missing_ok=True)  # an earlier attempt's end is not this one's
    update_json(handle.run_id, JOB_END_FILE, attempt=attempt.n)
    record_controller(handle.run_id)
    try:
        cfg = backend.finalize(plan, handle)
        if new_run:
            tracking.describe_run(handle, cfg, to_yaml(cfg))  # params + config.yaml
        else:  # params stay the first attempt's (MLflow keeps them); config.yaml is what the next resume reads
            mc.log_text(handle.run_id, tracking.redact(to_yaml(cfg)), "config.yaml")
            mc.log_text(handle.run_id, tracking.redact(to_yaml(cfg)), f"attempts/{attempt.n}/config.yaml")
        code = backend.launch(plan, handle, echo=workload_out)
    except Interrupted as exc:
        error = exc
    except KeyboardInterrupt:
        error = Interrupted(signal.SIGINT)
    except Exception as exc:  # LaunchError: could not start; anything else: closed as FAILED, then re-raised
        error = exc
        if not isinstance(exc, LaunchError):
            unexpected = exc
    finally:  # closing takes a second: a stop request now must not leave the run half-closed
        _install(_note_late_stop, previous)
    try:
        outcome, reason, cost_line, requested = _close(plan, handle, attempt, cfg, code, error, mc)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _report(outcome, reason, handle, time.monotonic() - started, cost_line, say, requested)
    if unexpected is not None:
        raise unexpected
    return RULES[outcome].exit_code


def _install(handler: Any, only: Optional[dict[int, Any]] = None) -> dict[int, Any]:
    """``handler`` for each stop signal (or those in ``only``); returns the handlers it replaced. A
    SIGHUP ignored by whoever started llmctl (``nohup``) stays ignored: they asked it to outlive the
    terminal."""
    replaced = {}
    for sig in STOP_SIGNALS if only is None else only:
        if sig == signal.SIGHUP and only is None and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        replaced[sig] = signal.signal(sig, handler)
    return replaced


def _close(
    plan: Plan,
    handle: RunHandle,
    attempt: Attempt,
    cfg: Optional[dict[str, Any]],
    code: Optional[int],
    error: Optional[BaseException],
    mc: Any,
) -> tuple[Outcome, str, str, bool]:
    """Classify, bill, upload and set the terminal status: each step runs whatever became of the one
    before (a tracking server that went away mid-close fails one step, not the rest). What the
    controller made of the attempt is kept in ``job_end.json`` first, so when the terminal status
    cannot be written, ``llmctl status`` closes the run later with this outcome, billed to this end.
    The last value: whether the stop was one someone asked for (``TAG_STOP_REQUEST``)."""
    rid = handle.run_id
    ended = job_end(rid).get("time")
    ended = float(ended) if isinstance(ended, (int, float)) else time.time()  # the backend's word, else now
    tags_read = True
    try:
        tags = mc.get_run(rid).data.tags
    except Exception as exc:  # the store is unreachable: classify on what the controller saw alone
        _warn_close("reading the run's tags", exc)
        tags, tags_read = {}, False
    stop = stop_requested()
    outcome, reason = classify(code, error, tags, rid, stop, attempt.n)
    update_json(
        rid,
        JOB_END_FILE,
        time=ended,
        code=code,
        stop=stop,
        attempt=attempt.n,
        outcome=outcome.value,
        reason=reason,
        tags_read=tags_read,
    )
    cost_line = hooks.close(mc, rid, plan.cfg, plan.estimate, reason, end=ended)  # best-effort inside
    for what, step in (
        ("uploading output.log", lambda: _upload_log(mc, rid, attempt.n)),
        ("logging checkpoints as models", lambda: _log_models(mc, handle, cfg)),
    ):
        try:
            step()
        except Exception as exc:
            _warn_close(what, exc)
    try:
        tracking.end_run(handle, RULES[outcome].mlflow_status, reason, ended)
    except Exception as exc:
        print(
            f"error: run {rid} ended {RULES[outcome].mlflow_status} ({reason[:300]}) but MLflow could not"
            f" record it ({type(exc).__name__}: {tracking.redact(str(exc))[:300]}); `llmctl status {rid}`"
            " closes it once the tracking store is reachable",
            file=sys.stderr,
            flush=True,
        )
    requested = outcome in (Outcome.PREEMPTED, Outcome.KILLED) and stop_request(tags) is not None
    return outcome, reason, cost_line, requested


def _warn_close(what: str, exc: BaseException) -> None:
    print(
        f"warning: closing the run: {what} failed ({type(exc).__name__}: {tracking.redact(str(exc))[:300]})",
        file=sys.stderr,
        flush=True,
    )


MAX_LOG_BYTES = 5_000_000


def _upload_log(mc: Any, run_id: str, n: int, name: str = "output.log") -> None:
    """The attempt's output (``name`` in the run's folder; its last 5 MB) as ``attempts/<n>/output.log``."""
    path = run_dir(run_id) / name
    if not path.is_file():
        return
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - MAX_LOG_BYTES))
        text = f.read().decode("utf-8", "replace")
    try:
        mc.log_text(run_id, text, f"attempts/{n}/output.log")
    except Exception as exc:
        print(f"warning: output.log not uploaded ({type(exc).__name__}: {exc})", file=sys.stderr)


def _log_models(mc: Any, handle: RunHandle, cfg: Optional[dict[str, Any]]) -> None:
    """The final and best checkpoints as the run's MLflow logged models (``checkpoint_models``)."""
    from llmctl.tracking.logged_models import log_checkpoints

    if cfg is None or is_command(cfg):  # a user's program's checkpoints are in its own format
        return
    try:
        log_checkpoints(mc, handle.experiment_id, handle.run_id, (cfg.get("checkpoint") or {}).get("dir"))
    except Exception as exc:
        print(f"warning: checkpoints not logged as MLflow models ({type(exc).__name__}: {exc})", file=sys.stderr)


def _note_late_stop(signum: int, frame: Any) -> None:
    """A stop request while the attempt is being closed: the job has already ended; finish closing."""


def current_fact(tags: dict[str, str], key: str, attempt: Optional[int] = None) -> Optional[str]:
    """The workload's fact ``key`` (preempted, budget stop, completed) if the start that is running now
    wrote it, else None. A fact names its start (``start``: k of ``llmctl.workload_start.<k>``;
    ``attempt``): one left by an earlier start (a managed job preempted, recovered by SkyPilot, then
    crashed) says nothing about how the newest one ended. A fact without either (a trainer from before
    this) is taken as it is."""
    from llmctl.cost.ledger import workload_starts

    raw = tags.get(key)
    if not raw:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(info, dict):
        return raw
    starts = workload_starts(tags)
    if info.get("start") is not None and starts:
        return raw if str(info["start"]) == str(starts[-1][0]) else None
    if info.get("attempt") is not None and attempt is not None:
        return raw if str(info["attempt"]) == str(attempt) else None
    return raw


def classify(
    code: Optional[int],
    error: Optional[BaseException],
    tags: dict[str, str],
    run_id: str,
    stop: Optional[int] = None,
    attempt: Optional[int] = None,
) -> tuple[Outcome, str]:
    """The outcome of an attempt and its ``llmctl.status``, from what the controller saw (exit code,
    an error, ``stop``: a stop request it received) and what the workload recorded (its tags, those of
    its current start only; ``attempt``: the controller's attempt number)."""

    request = stop_request(tags)

    def killed(signum: Optional[int]) -> tuple[Outcome, str]:
        name = signal.Signals(signum).name if signum else "SIGTERM"
        if request is not None:
            return Outcome.KILLED, _requested_reason(request, None, run_id)
        return (
            Outcome.KILLED,
            f"killed: {name} to llmctl stopped the job without its checkpoint"
            f" — resume from the last one with: llmctl resume {run_id}",
        )

    completed = current_fact(tags, TAG_COMPLETED, attempt)
    if completed and (isinstance(error, Interrupted) or (error is None and code != 0)):
        # every step ran and the final checkpoint is written: a stop (or the launcher's non-zero exit
        # because of it: torchrun exits 1 when it is signalled) after that is not a failure
        return Outcome.FINISHED, _completed_reason(completed, code)
    if isinstance(error, Interrupted):
        if error.signum != signal.SIGINT:
            return killed(error.signum)
        if _program_saved(current_fact(tags, TAG_PREEMPTED, attempt)):
            # a command workload's guard passed the Ctrl-C on as a stop, and its program saved
            return Outcome.INTERRUPTED, (
                f"interrupted (Ctrl-C) after the program saved its state — resume with: llmctl resume {run_id}"
            )
        return Outcome.INTERRUPTED, "interrupted (Ctrl-C)"
    if isinstance(error, LaunchError):
        return Outcome.FAILED, f"failed to start: {error}"
    if error is not None:  # llmctl's own error (a cloud API, the tracking store, a bug): re-raised after closing
        return Outcome.FAILED, tracking.redact(f"failed: {type(error).__name__}: {error}")[:2000]
    if code == 0:
        budget = current_fact(tags, TAG_BUDGET_STOP, attempt)
        return (Outcome.BUDGET_STOP, hooks.budget_reason(budget)) if budget else (Outcome.FINISHED, "finished")
    preempted = current_fact(tags, TAG_PREEMPTED, attempt)
    if preempted:
        if request is not None:
            return Outcome.PREEMPTED, _requested_reason(request, preempted, run_id)
        return Outcome.PREEMPTED, _preempted_reason(preempted, run_id)
    if stop in (signal.SIGTERM, signal.SIGHUP):  # passed on to the workers, which ended without saving
        return killed(stop)
    return Outcome.FAILED, f"workload exited with code {code}"


def _program_saved(raw: Optional[str]) -> bool:
    """Whether a preemption fact is a command workload's program that saved its state (exit 75)."""
    try:
        info = json.loads(raw) if raw else None
    except ValueError:
        return False
    return isinstance(info, dict) and bool(info.get("program")) and bool(info.get("saved"))


def _completed_reason(raw: str, code: Optional[int]) -> str:
    try:
        info = json.loads(raw)
    except ValueError:
        info = {}
    ck = info.get("checkpoint") if isinstance(info, dict) else None
    saved = f"final checkpoint step-{ck}" if ck is not None else "no checkpoint.dir"
    after = f"; stopped after its last step (exit code {code})" if code else "; stopped after its last step"
    return f"finished: all {info.get('step', '?')} steps ({saved}){after}"


def _preempted_reason(raw: str, run_id: str) -> str:
    try:
        info = json.loads(raw)
    except ValueError:
        info = {}
    if info.get("program"):  # a command workload's program exited 75 (``workloads/command/guard.py``)
        return f"preempted after the program saved its state (exit 75) — resume with: llmctl resume {run_id}"
    ck = info.get("checkpoint")
    saved = f"checkpoint step-{ck}" if ck is not None else "no checkpoint: resume restarts from step 0"
    return f"preempted at step {info.get('step', '?')} ({saved}) — resume with: llmctl resume {run_id}"


def stop_request(tags: dict[str, str]) -> Optional[dict[str, Any]]:
    """Who asked the current attempt to stop (``TAG_STOP_REQUEST``), or None."""
    raw = tags.get(TAG_STOP_REQUEST)
    if not raw:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        info = {"by": raw}
    return info if isinstance(info, dict) else {"by": str(info)}


def request_stop(mc: Any, run_id: str, by: str, what: str = "stopped", resume: bool = True) -> None:
    """Record, before signalling, that ``by`` asks the run's attempt to stop (``llmctl down``, a pruner)."""
    mc.set_tag(run_id, TAG_STOP_REQUEST, json.dumps({"by": by, "what": what, "resume": resume}))


def _requested_reason(request: dict[str, Any], preempted: Optional[str], run_id: str) -> str:
    """``stopped by llmctl down at step 37 (checkpoint step-37) — resume with: ...``; ``pruned by ...``."""
    what, by = str(request.get("what") or "stopped"), str(request.get("by") or "request")
    if preempted is None:
        where, hint = "before its workers saved a checkpoint", "resume from the last one with"
    else:
        try:
            info = json.loads(preempted)
        except ValueError:
            info = {}
        ck = info.get("checkpoint") if isinstance(info, dict) else None
        saved = f"checkpoint step-{ck}" if ck is not None else "no checkpoint: resume restarts from step 0"
        where = f"at step {info.get('step', '?') if isinstance(info, dict) else '?'} ({saved})"
        if isinstance(info, dict) and info.get("program"):  # a user's program: its own state, its own steps
            where = "after the program saved its state (exit 75)"
        hint = "resume with"
    tail = f" — {hint}: llmctl resume {run_id}" if request.get("resume", True) else ""
    return f"{what} by {by} {where}{tail}"


def _report(
    outcome: Outcome,
    reason: str,
    handle: RunHandle,
    elapsed: float,
    cost_line: str,
    say: Say,
    requested: bool = False,
) -> None:
    """The closing lines; the run is closed already, so a terminal that is gone (SIGHUP) or a store
    that cannot be read for the summary only loses them."""
    try:
        _say_outcome(outcome, reason, handle, elapsed, cost_line, say, requested)
    except Exception as exc:
        try:
            print(f"warning: run {handle.run_id} closed {outcome.value}; report not shown ({exc})", file=sys.stderr)
        except OSError:
            pass


def _say_outcome(
    outcome: Outcome, reason: str, handle: RunHandle, elapsed: float, cost_line: str, say: Say, requested: bool
) -> None:
    rid = handle.run_id
    if requested:  # the stop someone asked for: information, not an error
        say(f"llmctl: run {rid} {reason}", err=True)
        return
    if outcome in (Outcome.FINISHED, Outcome.BUDGET_STOP):
        say(tracking.summary(handle, elapsed))
        if cost_line:
            say(cost_line)
        if outcome is Outcome.BUDGET_STOP:
            say(f"llmctl: run {rid} {reason}", err=True)
        say(f"llmctl: all runs: {tracking.runs_url(handle)}")  # the experiment's runs, losses and spend side by side
        say(f"llmctl: open it: {tracking.run_url(handle)}")  # last: the line a user copies
    elif outcome is Outcome.FAILED:
        say(f"error: run {rid} FAILED: {reason} (log: {run_dir(rid) / 'output.log'})", err=True)
    elif outcome is Outcome.INTERRUPTED and "resume with" in reason:  # stopped, its state saved: the way on
        say(f"llmctl: run {rid} {reason}; marked KILLED", err=True)
    elif outcome is Outcome.INTERRUPTED:
        say(f"error: run {rid} interrupted; marked KILLED", err=True)
    elif outcome is Outcome.PREEMPTED:  # stopped with its state saved: it resumes, nothing went wrong
        say(f"llmctl: run {rid} {reason}", err=True)
    else:
        say(f"error: run {rid} {reason}", err=True)
