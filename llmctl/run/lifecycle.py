"""One run lifecycle: a plan and a backend in, an attempt that ran and was closed out.

The only place that opens and closes a run's training attempts. Entry points:

- ``launch``: a new MLflow run (``llmctl launch``);
- ``resume``: the same run, attempt n+1 (``llmctl resume``);
- ``trial``: a run the sweep supervisor created (``llmctl launch -m``).

Beside it: ``attached`` (a job of its own attached to a run that is not running, ``llmctl eval RUN
--tasks`` on the run's infra), ``closing`` (a run whose controller is gone: ``llmctl down``, a dead
trial controller, a job SkyPilot reports ended), ``outcome`` (how an attempt ended: ``RULES``,
``classify``) and ``report`` (the closing lines). ``llmctl smoke`` drives the CLI, so it goes
through the same code.

Each attempt (``attempt_of``, a context manager: the only way one is opened and closed) goes:
open it (ledger tags, the workload's environment) → ``backend.finalize`` → record the config →
``backend.launch`` under SIGINT/SIGTERM handling → read the outcome from the exit code, the stop
request and the workload's tags → bill it (``cost.hooks.close``) → upload its ``output.log`` and log
the final and best checkpoints as MLflow models → set the MLflow status and ``llmctl.status`` → the
exit code.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, TextIO

from llmctl.backends import backend_for
from llmctl.backends.base import Backend
from llmctl.config.compose import to_yaml
from llmctl.config.notify import masked
from llmctl.config.workload import is_command
from llmctl.controller.notify import Notifier, from_config
from llmctl.controller.procs import (
    Interrupted,
    clear_stop_requests,
    ignore_late_stop,
    install_stop_handlers,
    raise_interrupted,
    record_controller,
    restore_handlers,
    stop_requested,
)
from llmctl.controller.workdir import JOB_END_FILE, run_dir, update_json
from llmctl.cost import hooks, ledger
from llmctl.errors import ConfigError, LaunchError
from llmctl.plan import data_check, task_check
from llmctl.plan.job_plan import Plan
from llmctl.run import recoveries
from llmctl.run.closing import close_run, ended_at_of, job_end, run_tag, upload_log, warn_close
from llmctl.run.outcomes import RULES, TAG_STOP_REQUEST, Outcome, classify, stop_request
from llmctl.run.report import report
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
Say = Callable[..., None]  # typer.echo's shape: say(text, err=False)


@dataclass
class Attempt:
    n: int
    start: float
    max_cost: Optional[float]
    spent_before: float


# ----------------------------------------------------------------------------- entry points


IGNORE_MEMORY_PLAN = "--ignore-memory-plan"


def check_memory(plan: Plan, ignore: bool = False, say: Optional[Say] = None) -> None:
    """Refuse (ConfigError, before anything exists) a job whose memory plan exceeds its devices, or
    whose in-training lm-eval (``eval.tasks``) would not fit beside what the trainer keeps, unless
    ``ignore`` (``--ignore-memory-plan``): how far the plan's CUDA rules have been checked is in
    docs/scale.md, so a user who knows better can go past it, and is told what was overridden."""
    from llmctl.plan.candidates import misfits

    others = misfits(plan)[1 if plan.memory is not None and plan.memory.fits is False else 0 :]
    if others and not ignore:  # the run may land on any candidate: each must hold the job
        raise ConfigError(f"{others[0]}. Fix: drop it from infra.candidates, or {IGNORE_MEMORY_PLAN}")
    fit = plan.memory
    if fit is None or (fit.fits is not False and fit.scoring_fits is not False):
        return
    verdict = fit.verdict() if fit.fits is False else fit.scoring_verdict()
    if ignore:
        if say is not None:
            say(f"llmctl: launching past the memory plan ({IGNORE_MEMORY_PLAN}): {verdict}")
        return
    fix = f" Fix: add {' '.join(fit.fix)} to the command." if fit.fits is False and fit.fix else ""
    raise ConfigError(
        f"the job would run out of memory: {verdict}.{fix} (`llmctl plan` shows the memory by part;"
        f" {IGNORE_MEMORY_PLAN} launches anyway; how the plan's rules were checked: docs/scale.md)"
    )


def launch(plan: Plan, *, max_cost: Optional[float], say: Say, ignore_memory_plan: bool = False) -> int:
    """``llmctl launch``: preflight and budget (ConfigError, before anything exists), then a new run."""
    backend = backend_for(plan.backend)
    check_memory(plan, ignore_memory_plan, say)
    hooks.check_budget(plan.estimate, max_cost)  # before preflight: the plan alone decides it
    for cand in plan.candidates:  # the run may land on any of them: each within the budget
        hooks.check_budget(cand.estimate, max_cost, candidate=f"infra.candidates[{cand.index}] ({cand.label})")
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
        notifier=from_config(plan.cfg, say),
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
        notifier=from_config(plan.cfg, say),
        banner=lambda handle, attempt: (
            f"llmctl: resuming run {rid} (attempt {attempt.n}) {where} on {plan.where},"
            f" {plan.world_size} process(es) on {plan.device}"
        ),
    )


# ----------------------------------------------------------------------------- one attempt


def _open_attempt(
    handle: RunHandle, plan: Plan, max_cost: Optional[float], spent: float, from_step: int, first: bool
) -> Attempt:
    """Ledger attempt n (price snapshot, size, where) and the workload's environment for it; the
    first attempt also records the estimate."""
    from llmctl.plan.candidates import billed_estimate, candidate_prices

    mc = tracking.client(handle.uri)
    start = time.time()
    est = billed_estimate(plan)  # infra.candidates: the dearest until the backend says which served
    if first:
        hooks.record_estimate(mc, handle.run_id, plan, max_cost, start)
        if plan.candidates:  # each attempt is billed at the candidate its start says served it
            mc.set_tag(handle.run_id, ledger.TAG_CANDIDATES, candidate_prices(plan))
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
            run_tag(k, v)
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
    notifier: Optional[Notifier] = None,
) -> int:
    """One attempt of ``plan``'s run, opened and closed by ``attempt_of``: the backend finalizes the
    config, it is recorded, the backend launches the workload. The exit code is the outcome's.
    ``notifier``: whom to tell (``notify.*``); None for a sweep's trial, whose sweep tells at its end."""
    try:
        with attempt_of(plan, create, open_attempt, say=say, banner=banner, notifier=notifier) as running:
            running.cfg = backend.finalize(plan, running.handle)
            _record_config(running, new_run)
            with recoveries.watched(running.handle, _on_recovery(plan, running, say, notifier)):
                running.code = backend.launch(plan, running.handle, echo=workload_out)
    except NotOpened as closed:
        return closed.exit_code
    return running.exit_code


def _on_recovery(
    plan: Plan, running: "Running", say: Say, notifier: Optional[Notifier]
) -> Optional[Callable[[int, dict[str, str]], None]]:
    """What a managed job's recovery does (a line, and ``recovered`` to ``notify.url``); None for a
    run nothing recovers without its launcher."""
    if not plan.cfg["infra"].get("managed") or plan.backend == "local":
        return None

    def recovered(n: int, tags: dict[str, str]) -> None:
        line = recoveries.recovery_line(n, tags)
        say(line)
        if notifier is not None:
            announce(notifier, "recovered", running.handle, [line], n)

    return recovered


@dataclass
class Running:
    """An open attempt as the body of ``attempt_of`` sees it; the body fills in what it learns."""

    handle: RunHandle
    attempt: Attempt
    cfg: Optional[dict[str, Any]] = None  # the config the backend finalized (None: it never got that far)
    code: Optional[int] = None  # the workload's exit code (None: it never ran, or no code came back)
    exit_code: int = 0  # set when the attempt is closed: what the command exits with


class NotOpened(Exception):
    """A stop while the run was being created or its attempt opened: what existed is closed."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(exit_code)
        self.exit_code = exit_code


@contextlib.contextmanager
def attempt_of(
    plan: Plan,
    create: Callable[[], RunHandle],
    open_attempt: Callable[[RunHandle], Attempt],
    *,
    say: Say,
    banner: Callable[[RunHandle, Attempt], str],
    notifier: Optional[Notifier] = None,
) -> Iterator[Running]:
    """The one structure that opens and closes a run's attempt: ``create`` makes (or reopens) the run
    and ``open_attempt`` opens its attempt with stop signals already turned into ``Interrupted``; from
    then on a stop request, an error starting, or any other exception in the body (a cloud API's,
    MLflow's, a backend bug) ends in a closed attempt and a terminal run, never a run left RUNNING.
    A stop or a ``LaunchError`` in the body is closed and ends the ``with`` (``Running.exit_code``
    says how); any other exception is re-raised after the close (its traceback still shows; exit
    code 1). A stop before the attempt is open raises ``NotOpened`` once what existed is closed."""
    clear_stop_requests()
    previous = install_stop_handlers(raise_interrupted)
    handle: Optional[RunHandle] = None
    try:
        handle = create()
        attempt = open_attempt(handle)
    except BaseException as exc:
        raise NotOpened(_close_unopened(handle, exc, previous, say)) from None
    opened = banner(handle, attempt)
    say(opened)  # the run id, as soon as the run and its attempt exist
    if notifier is not None:
        announce(notifier, "started", handle, [opened, f"llmctl: open it: {tracking.run_url(handle)}"], attempt.n)
    running = Running(handle, attempt)
    started = time.monotonic()
    error: Optional[BaseException] = None
    unexpected: Optional[BaseException] = None
    (run_dir(handle.run_id) / JOB_END_FILE).unlink(missing_ok=True)  # an earlier attempt's end is not this one's
    update_json(handle.run_id, JOB_END_FILE, attempt=attempt.n)
    record_controller(handle.run_id)
    try:
        yield running
    except Interrupted as exc:
        error = exc
    except KeyboardInterrupt:
        error = Interrupted(signal.SIGINT)
    except Exception as exc:  # LaunchError: could not start; anything else: closed as FAILED, then re-raised
        error = exc
        if not isinstance(exc, LaunchError):
            unexpected = exc
    finally:  # closing takes a second: a stop request now must not leave the run half-closed
        install_stop_handlers(ignore_late_stop, previous)
    mc = tracking.client(handle.uri)
    try:
        outcome, reason, cost_line, requested = _close(plan, handle, attempt, running.cfg, running.code, error, mc)
    finally:
        restore_handlers(previous)
    lines: list[str] = []

    def shown(text: str, err: bool = False) -> None:  # the closing lines, for the notification too
        lines.append(text)
        say(text, err=err)

    report(outcome, reason, handle, time.monotonic() - started, cost_line, shown, requested)
    if notifier is not None:  # a stop someone asked for (llmctl down, a pruner) is theirs to know
        announce(notifier, "interrupted" if requested else outcome.value, handle, lines, attempt.n)
    if unexpected is not None:
        raise unexpected
    running.exit_code = RULES[outcome].exit_code


def announce(notifier: Notifier, event: str, handle: RunHandle, lines: list[str], attempt: int) -> None:
    """``event`` of the run to ``notify.url``: the lines the terminal showed, the run's page and its
    spend so far (the ledger's ``cost/actual_usd``). Best-effort: never raises."""
    if not notifier.wants(event):
        return
    try:
        tags = tracking.client(handle.uri).get_run(handle.run_id).data.tags
    except Exception:  # the store went away: the message goes without the spend
        tags = {}
    try:
        page = tracking.run_url(handle)
    except Exception:
        page = None
    notifier.send(
        event,
        "\n".join(tracking.redact(line) for line in lines),
        run_id=handle.run_id,
        run_name=tags.get("mlflow.runName"),
        attempt=attempt,
        page=page,
        spend_usd=float(tags["cost/actual_usd"]) if "cost/actual_usd" in tags else None,
    )


def _record_config(running: Running, new_run: bool) -> None:
    """The attempt's config into the run: params and config.yaml for a new run; for a resumed one the
    params stay the first attempt's (MLflow keeps them) and config.yaml is what the next resume reads."""
    handle, cfg = running.handle, running.cfg
    assert cfg is not None
    if new_run:
        tracking.describe_run(handle, cfg, to_yaml(masked(cfg)))
        return
    mc = tracking.client(handle.uri)
    shown = tracking.redact(to_yaml(masked(cfg)))
    mc.log_text(handle.run_id, shown, "config.yaml")
    mc.log_text(handle.run_id, shown, f"attempts/{running.attempt.n}/config.yaml")


def _close_unopened(handle: Optional[RunHandle], error: BaseException, previous: dict[int, Any], say: Say) -> int:
    """A stop or an error while the run was being created or its attempt opened: close what exists
    (the attempt, if it was opened, billed to now; the run terminal) and say so. A stop ends with its
    exit code; anything else is re-raised after the close."""
    install_stop_handlers(ignore_late_stop, previous)
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
            warn_close("closing the run", exc)
        report(outcome, reason, handle, 0.0, "", say)
    finally:
        restore_handlers(previous)
    if not isinstance(error, Interrupted):
        raise error
    return RULES[outcome].exit_code


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
        warn_close("reading the run's tags", exc)
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
        ("uploading output.log", lambda: upload_log(mc, rid, attempt.n)),
        ("logging checkpoints as models", lambda: _log_models(mc, handle, cfg)),
    ):
        try:
            step()
        except Exception as exc:
            warn_close(what, exc)
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


def _log_models(mc: Any, handle: RunHandle, cfg: Optional[dict[str, Any]]) -> None:
    """The final and best checkpoints as the run's MLflow logged models (``checkpoint_models``)."""
    from llmctl.tracking.logged_models import log_checkpoints

    if cfg is None or is_command(cfg):  # a user's program's checkpoints are in its own format
        return
    try:
        log_checkpoints(mc, handle.experiment_id, handle.run_id, (cfg.get("checkpoint") or {}).get("dir"))
    except Exception as exc:
        print(f"warning: checkpoints not logged as MLflow models ({type(exc).__name__}: {exc})", file=sys.stderr)
