"""The closing lines a run's controller prints, once the run is closed: the summary and the
run's page for a finished run, the reason and the way on (``llmctl resume``) for one that stopped,
the log for one that failed."""

from __future__ import annotations

import sys
from typing import Callable

from llmctl.controller.workdir import run_dir
from llmctl.run.outcomes import Outcome
from llmctl.tracking import mlflow_run as tracking
from llmctl.tracking.mlflow_run import RunHandle

Say = Callable[..., None]  # typer.echo's shape: say(text, err=False)


def report(
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
