"""How an attempt ended: the outcomes, their MLflow status and exit code (``RULES``, shown in
docs/concepts.md), and ``classify``, which reads the outcome from what the controller saw (exit
code, an error, a stop request) and what the workload recorded (its tags, of its current start).
Who asked for a stop (``llmctl down``, a sweep's pruner) is a tag set before the signal is sent."""

from __future__ import annotations

import enum
import json
import signal
from dataclasses import dataclass
from typing import Any, Optional

from llmctl.controller.procs import Interrupted
from llmctl.cost import hooks
from llmctl.errors import LaunchError
from llmctl.tracking import mlflow_run as tracking
from workloads.protocol.run_contract import TAG_BUDGET_STOP, TAG_COMPLETED, TAG_PREEMPTED

# who asked the running attempt to stop, set before the signal is sent ({"by": "llmctl down"}, or a
# sweep's pruner: {"by": ..., "what": "pruned", "resume": false}): the controller then reports the stop
# as the requested one it is, not as a preemption or an error
TAG_STOP_REQUEST = "llmctl.stop_request"


TERMINAL = ("FINISHED", "FAILED", "KILLED")


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


def _fact(raw: Optional[str]) -> dict[str, Any]:
    """A workload fact's fields (a JSON object in a tag); {} for none, or for anything else (a fact
    from an older trainer, a tag a user edited): the reasons then say "?" rather than fail."""
    try:
        info = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _program_saved(raw: Optional[str]) -> bool:
    """Whether a preemption fact is a command workload's program that saved its state (exit 75)."""
    info = _fact(raw)
    return bool(info.get("program")) and bool(info.get("saved"))


def _completed_reason(raw: str, code: Optional[int]) -> str:
    info = _fact(raw)
    ck = info.get("checkpoint")
    saved = f"final checkpoint step-{ck}" if ck is not None else "no checkpoint.dir"
    after = f"; stopped after its last step (exit code {code})" if code else "; stopped after its last step"
    return f"finished: all {info.get('step', '?')} steps ({saved}){after}"


def _preempted_reason(raw: str, run_id: str) -> str:
    info = _fact(raw)
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
        info = _fact(preempted)
        ck = info.get("checkpoint")
        saved = f"checkpoint step-{ck}" if ck is not None else "no checkpoint: resume restarts from step 0"
        where = f"at step {info.get('step', '?')} ({saved})"
        if info.get("program"):  # a user's program: its own state, its own steps
            where = "after the program saved its state (exit 75)"
        hint = "resume with"
    tail = f" — {hint}: llmctl resume {run_id}" if request.get("resume", True) else ""
    return f"{what} by {by} {where}{tail}"
