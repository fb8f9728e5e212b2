"""One run lifecycle: a plan and a backend in, an attempt that ran and was closed out.

The only place that opens, closes and bills attempts and sets a run's final status. Entry points:

- ``launch``: a new MLflow run (``llmctl launch``);
- ``resume``: the same run, attempt n+1 (``llmctl resume``);
- ``trial``: a run the sweep supervisor created (``llmctl launch -m``);
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
from llmctl.controller.procs import Interrupted, clear_stop_requests, raise_interrupted, stop_requested
from llmctl.controller.workdir import run_dir
from llmctl.cost import hooks, ledger
from llmctl.errors import ConfigError, LaunchError
from llmctl.plan.job_plan import Plan
from llmctl.tracking import mlflow_run as tracking
from llmctl.tracking.mlflow_run import RunHandle
from workloads.pretrain.contract.protocol import (
    ENV_ATTEMPT,
    ENV_BILLING_START,
    ENV_MAX_COST,
    ENV_PRICE,
    ENV_SPENT,
    TAG_BUDGET_STOP,
    TAG_PREEMPTED,
)

TAG_BACKEND = "llmctl.backend"  # backend of the latest attempt (params keep the first attempt's infra.kind)
TERMINAL = ("FINISHED", "FAILED", "KILLED")
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
        " llmctl down) and saved its state (tag llmctl.preempted); `llmctl resume RUN`",
    ),
    Outcome.INTERRUPTED: Rule("KILLED", 130, "Ctrl-C (SIGINT) to llmctl: the workers were stopped"),
    Outcome.KILLED: Rule(
        "KILLED",
        143,
        "SIGTERM to llmctl that did not end in the workers' checkpoint"
        " (before they started, a second SIGTERM, or workers that did not stop in time)",
    ),
    Outcome.FAILED: Rule("FAILED", 1, "the workload exited non-zero without a preemption tag, or could not start"),
}


@dataclass
class Attempt:
    n: int
    start: float
    max_cost: Optional[float]
    spent_before: float


# ----------------------------------------------------------------------------- entry points


def check_memory(plan: Plan) -> None:
    """Refuse (ConfigError, before anything exists) a job whose memory plan exceeds its devices."""
    fit = plan.memory
    if fit is not None and fit.fits is False:
        fix = f" Fix: add {' '.join(fit.fix)} to the command." if fit.fix else ""
        raise ConfigError(
            f"the job would run out of memory: {fit.verdict()}.{fix} (`llmctl plan` shows the memory by part)"
        )


def launch(plan: Plan, *, max_cost: Optional[float], say: Say) -> int:
    """``llmctl launch``: preflight and budget (ConfigError, before anything exists), then a new run."""
    backend = backend_for(plan.backend)
    check_memory(plan)
    hooks.check_budget(plan.estimate, max_cost)  # before preflight: the plan alone decides it
    backend.preflight(plan)
    handle = tracking.create_run(plan.cfg, plan.choices)
    attempt = _open_attempt(handle, plan, max_cost, spent=0.0, from_step=0, first=True)
    return _run(
        plan,
        backend,
        handle,
        attempt,
        new_run=True,
        say=say,
        banner=f"llmctl: run {handle.run_id} on {plan.where}, {plan.world_size} process(es) on {plan.device}",
    )


def trial(
    plan: Plan, handle: RunHandle, *, max_cost: Optional[float], say: Say, workload_out: Optional[TextIO] = None
) -> int:
    """One sweep trial, in the run its supervisor created (preflight ran when the sweep started)."""
    backend = backend_for(plan.backend)
    tracking.client(handle.uri).update_run(handle.run_id, status="RUNNING")
    attempt = _open_attempt(handle, plan, max_cost, spent=0.0, from_step=0, first=True)
    return _run(
        plan,
        backend,
        handle,
        attempt,
        new_run=True,
        say=say,
        workload_out=workload_out,
        banner=f"run {handle.run_id} on {plan.where}, {plan.world_size} process(es) on {plan.device}",
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
) -> int:
    """``llmctl resume``: attempt n+1 of ``run`` (found in the store ``uri``). ``remaining`` is the
    estimate of the steps left; ``max_cost`` (else the run's stored budget) covers the whole run,
    earlier attempts included."""
    backend = backend_for(plan.backend)
    check_memory(plan)
    backend.preflight(plan)
    rid = run.info.run_id
    mc = tracking.client(uri)
    ledger.reconcile(mc, rid)  # a managed job's recoveries are attempts before this one is numbered
    run = mc.get_run(rid)
    previous_end = (run.info.end_time or time.time() * 1000) / 1000
    spent = ledger.compute(run.data.tags, now=previous_end).actual_usd
    stored = run.data.tags.get(hooks.TAG_MAX_COST)
    budget = max_cost if max_cost is not None else (float(stored) if stored else None)
    hooks.check_budget(remaining, budget, spent, rid)  # refuse before the run is touched

    # the previous attempt ends where its controller left it; what it was stays on its tags
    status = (run.data.tags.get("llmctl.status") or run.info.status.lower())[:500]
    ledger.close_open(mc, rid, previous_end, status)
    for tag in (TAG_PREEMPTED, TAG_BUDGET_STOP):  # facts about the previous attempt, not this one
        if tag in run.data.tags:
            mc.delete_tag(rid, tag)
    if max_cost is not None:
        mc.set_tag(rid, hooks.TAG_MAX_COST, f"{max_cost:.2f}")
    mc.update_run(rid, status="RUNNING")
    handle = RunHandle(uri=uri, run_id=rid, experiment_id=run.info.experiment_id)
    attempt = _open_attempt(handle, plan, budget, spent=spent, from_step=from_step or 0, first=False)
    return _run(
        plan,
        backend,
        handle,
        attempt,
        new_run=False,
        say=say,
        banner=f"llmctl: resuming run {rid} (attempt {attempt.n}) {where} on {plan.where},"
        f" {plan.world_size} process(es) on {plan.device}",
    )


def close_run(uri: str, run_id: str, outcome: Outcome, reason: str) -> None:
    """Close a run nobody is running any more: bill its open attempts to now, set its status."""
    mc = tracking.client(uri)
    run = mc.get_run(run_id)
    if run.info.status in TERMINAL:
        return
    hooks.close(mc, run_id, None, None, reason)
    tracking.end_run(RunHandle(uri, run_id, run.info.experiment_id), RULES[outcome].mlflow_status, reason)


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
            "train_steps": plan.cfg["train"]["steps"],
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
    handle: RunHandle,
    attempt: Attempt,
    *,
    new_run: bool,
    say: Say,
    banner: str,
    workload_out: Optional[TextIO] = None,
) -> int:
    mc = tracking.client(handle.uri)
    clear_stop_requests()
    previous = {sig: signal.signal(sig, raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    code: Optional[int] = None
    error: Optional[BaseException] = None
    cfg: Optional[dict[str, Any]] = None
    try:
        cfg = backend.finalize(plan, handle)
        if new_run:
            tracking.describe_run(handle, cfg, to_yaml(cfg))  # params + config.yaml
        else:  # params stay the first attempt's (MLflow keeps them); config.yaml is what the next resume reads
            mc.log_text(handle.run_id, tracking.redact(to_yaml(cfg)), "config.yaml")
            mc.log_text(handle.run_id, tracking.redact(to_yaml(cfg)), f"attempts/{attempt.n}/config.yaml")
        say(banner)
        code = backend.launch(plan, handle, echo=workload_out)
    except Interrupted as exc:
        error = exc
    except KeyboardInterrupt:
        error = Interrupted(signal.SIGINT)
    except (LaunchError, OSError) as exc:
        error = exc
    finally:  # closing takes a second: a stop request now must not leave the run half-closed
        for sig in previous:
            signal.signal(sig, _note_late_stop)
    try:
        outcome, reason = classify(code, error, mc.get_run(handle.run_id).data.tags, handle.run_id, stop_requested())
        cost_line = hooks.close(mc, handle.run_id, plan.cfg, plan.estimate, reason)
        _upload_log(mc, handle.run_id, attempt.n)
        _log_models(mc, handle, cfg)
        tracking.end_run(handle, RULES[outcome].mlflow_status, reason)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _report(outcome, reason, handle, time.monotonic() - started, cost_line, say)
    return RULES[outcome].exit_code


MAX_LOG_BYTES = 5_000_000


def _upload_log(mc: Any, run_id: str, n: int) -> None:
    """The attempt's ``output.log`` (a local job's; its last 5 MB) as ``attempts/<n>/output.log``."""
    path = run_dir(run_id) / "output.log"
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

    if cfg is None:
        return
    try:
        log_checkpoints(mc, handle.experiment_id, handle.run_id, (cfg.get("checkpoint") or {}).get("dir"))
    except Exception as exc:
        print(f"warning: checkpoints not logged as MLflow models ({type(exc).__name__}: {exc})", file=sys.stderr)


def _note_late_stop(signum: int, frame: Any) -> None:
    """SIGINT/SIGTERM while the attempt is being closed: the job has already ended; finish closing."""


def classify(
    code: Optional[int], error: Optional[BaseException], tags: dict[str, str], run_id: str, stop: Optional[int] = None
) -> tuple[Outcome, str]:
    """The outcome of an attempt and its ``llmctl.status``, from what the controller saw (exit code,
    an error starting, ``stop``: a stop request it received) and what the workload recorded (its tags)."""
    killed = (
        Outcome.KILLED,
        f"killed: SIGTERM to llmctl stopped the job without its checkpoint"
        f" — resume from the last one with: llmctl resume {run_id}",
    )
    if isinstance(error, Interrupted):
        return killed if error.signum == signal.SIGTERM else (Outcome.INTERRUPTED, "interrupted (Ctrl-C)")
    if error is not None:
        return Outcome.FAILED, f"failed to start: {error}"
    if code == 0:
        stop = tags.get(TAG_BUDGET_STOP)
        return (Outcome.BUDGET_STOP, hooks.budget_reason(stop)) if stop else (Outcome.FINISHED, "finished")
    preempted = tags.get(TAG_PREEMPTED)
    if preempted:
        return Outcome.PREEMPTED, _preempted_reason(preempted, run_id)
    if stop == signal.SIGTERM:  # passed on to the workers, which ended without saving (hung past the grace)
        return killed
    return Outcome.FAILED, f"workload exited with code {code}"


def _preempted_reason(raw: str, run_id: str) -> str:
    try:
        info = json.loads(raw)
    except ValueError:
        info = {}
    ck = info.get("checkpoint")
    saved = f"checkpoint step-{ck}" if ck is not None else "no checkpoint: resume restarts from step 0"
    return f"preempted at step {info.get('step', '?')} ({saved}) — resume with: llmctl resume {run_id}"


def _report(outcome: Outcome, reason: str, handle: RunHandle, elapsed: float, cost_line: str, say: Say) -> None:
    rid = handle.run_id
    if outcome in (Outcome.FINISHED, Outcome.BUDGET_STOP):
        say(tracking.summary(handle, elapsed))
        if cost_line:
            say(cost_line)
        if outcome is Outcome.BUDGET_STOP:
            say(f"llmctl: run {rid} {reason}", err=True)
        say(f"llmctl: open it: {tracking.run_url(handle)}")  # last: the line a user copies
    elif outcome is Outcome.FAILED:
        say(f"error: run {rid} FAILED: {reason} (log: {run_dir(rid) / 'output.log'})", err=True)
    elif outcome is Outcome.INTERRUPTED:
        say(f"error: run {rid} interrupted; marked KILLED", err=True)
    else:
        say(f"error: run {rid} {reason}", err=True)
