"""Closing an attempt is unconditional (issue #32): whatever exception the controller meets, the run
ends in a true terminal state with its attempt closed, and the workload's facts are read only from
the start that wrote them. Real parts: the lifecycle, a sqlite MLflow store, the real SkyPilot
exception classes; the one fake is a backend that fails the way a cloud API does."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any, Optional

import pytest
from helpers import mlflow_client, mlflow_runs

from llmctl.controller.procs import Interrupted
from llmctl.cost import ledger
from llmctl.run import closing, lifecycle, outcomes
from llmctl.run.outcomes import Outcome, classify


def _start(k: int, attempt: int = 1) -> tuple[str, str]:
    return f"llmctl.workload_start.{k}", json.dumps({"time": 1000.0 + k, "attempt": attempt, "from_step": 0})


def test_a_stale_fact_from_an_earlier_start_is_not_this_starts() -> None:
    """A managed job preempted at start 1, recovered by SkyPilot (start 2), then crashed: FAILED, not
    PREEMPTED with the old checkpoint; a budget stop or a completion from start 1 likewise."""
    pre = json.dumps({"step": 7, "checkpoint": 7, "saved": True, "signal": "SIGTERM", "start": 1, "attempt": 1})
    two = dict([_start(1), _start(2)])
    assert classify(1, None, {**two, "llmctl.preempted": pre}, "r1")[0] is Outcome.FAILED
    assert classify(1, None, {**dict([_start(1)]), "llmctl.preempted": pre}, "r1")[0] is Outcome.PREEMPTED
    now = json.dumps({"step": 9, "checkpoint": 9, "saved": True, "signal": "SIGTERM", "start": 2, "attempt": 1})
    got, reason = classify(1, None, {**two, "llmctl.preempted": now}, "r1")
    assert got is Outcome.PREEMPTED and reason.startswith("preempted at step 9 (checkpoint step-9)"), reason
    budget = json.dumps({"step": 3, "spent_usd": 1.5, "max_cost_usd": 1.0, "checkpoint": True, "start": 1})
    assert classify(0, None, {**two, "llmctl.budget_stop": budget}, "r1") == (Outcome.FINISHED, "finished")
    # no start recorded (its bookkeeping failed): the attempt number still scopes the fact
    old = json.dumps({"step": 7, "checkpoint": 7, "attempt": 1})
    assert classify(1, None, {"llmctl.preempted": old}, "r1", None, 2)[0] is Outcome.FAILED
    assert classify(1, None, {"llmctl.preempted": old}, "r1", None, 1)[0] is Outcome.PREEMPTED


def test_a_stop_after_the_last_step_is_a_finished_run() -> None:
    """torchrun exits 1 when it is signalled, although every worker ended 0: with the workload's
    ``llmctl.completed`` fact of this start, that is FINISHED (exit 0); an earlier start's is not."""
    done = json.dumps({"step": 20, "checkpoint": 20, "start": 1, "attempt": 1})
    tags = {**dict([_start(1)]), "llmctl.completed": done}
    got, reason = classify(1, None, tags, "r1", signal.SIGTERM)
    assert got is Outcome.FINISHED and reason.startswith("finished: all 20 steps (final checkpoint step-20)"), reason
    assert classify(None, Interrupted(signal.SIGHUP), tags, "r1", signal.SIGHUP)[0] is Outcome.FINISHED
    assert classify(0, None, tags, "r1") == (Outcome.FINISHED, "finished")
    stale = {**tags, **dict([_start(2)])}
    assert classify(1, None, stale, "r1", signal.SIGTERM)[0] is Outcome.KILLED


def test_a_stop_someone_asked_for_is_named_as_such() -> None:
    """``llmctl down`` and a sweep's pruner record who asks before they signal: the stop then reads as
    theirs (stopped / pruned), not as a preemption; without the record it stays a preemption."""
    pre = json.dumps({"step": 9, "checkpoint": 9, "start": 1, "attempt": 1})
    tags = {**dict([_start(1)]), "llmctl.preempted": pre}
    down = {**tags, outcomes.TAG_STOP_REQUEST: json.dumps({"by": "llmctl down", "what": "stopped", "resume": True})}
    assert classify(75, None, down, "r1") == (
        Outcome.PREEMPTED,
        "stopped by llmctl down at step 9 (checkpoint step-9) — resume with: llmctl resume r1",
    )
    prune = json.dumps({"by": "the sweep's asha pruner", "what": "pruned", "resume": False})
    got = classify(75, None, {**tags, outcomes.TAG_STOP_REQUEST: prune}, "r1")
    assert got == (Outcome.PREEMPTED, "pruned by the sweep's asha pruner at step 9 (checkpoint step-9)")
    asked = {outcomes.TAG_STOP_REQUEST: down[outcomes.TAG_STOP_REQUEST]}
    got, reason = classify(1, None, asked, "r1", signal.SIGTERM)
    assert got is Outcome.KILLED and reason.startswith("stopped by llmctl down before its workers saved"), reason
    assert classify(75, None, tags, "r1")[1].startswith("preempted at step 9")


def test_sighup_and_unexpected_errors_are_named() -> None:
    got, reason = classify(None, Interrupted(signal.SIGHUP), {}, "r1", signal.SIGHUP)
    assert got is Outcome.KILLED and reason.startswith("killed: SIGHUP to llmctl"), reason
    assert classify(1, None, {}, "r1", signal.SIGHUP)[1].startswith("killed: SIGHUP to llmctl")
    got, reason = classify(None, RuntimeError("API https://me:s3cret@api.example.com down"), {}, "r1")
    assert got is Outcome.FAILED and reason == "failed: RuntimeError: API https://***@api.example.com down"


class _ReclaimedCluster:
    """A backend whose job-status call fails as SkyPilot's does once a spot cluster was reclaimed."""

    name = "local"

    def __init__(self, exc: BaseException):
        self.exc = exc

    def finalize(self, plan: Any, handle: Any) -> dict[str, Any]:
        return plan.cfg

    def launch(self, plan: Any, handle: Any, echo: Optional[Any] = None) -> int:
        raise self.exc


def _plan(tmp_path: Path) -> tuple[Any, str]:
    from llmctl.config.compose import compose
    from llmctl.plan.make import make_plan

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return make_plan(compose(["experiment=smoke", f"tracking.uri={uri}"])), uri


def _attempt(tmp_path: Path) -> tuple[Any, Any, Any, str]:
    """A run with its first attempt open, as ``llmctl launch`` leaves it before the workload starts."""
    from llmctl.tracking import mlflow_run as tracking

    plan, uri = _plan(tmp_path)
    handle = tracking.create_run(plan.cfg, plan.choices)
    attempt = lifecycle._open_attempt(handle, plan, None, spent=0.0, from_step=0, first=True)
    return plan, handle, attempt, uri


def _run(plan: Any, backend: Any, said: list[str], open_attempt: Any = None) -> None:
    """``lifecycle._run`` as ``llmctl launch`` calls it (a new run, its first attempt)."""
    from llmctl.tracking import mlflow_run as tracking

    lifecycle._run(
        plan,
        backend,
        lambda: tracking.create_run(plan.cfg, plan.choices),
        open_attempt
        or (lambda handle: lifecycle._open_attempt(handle, plan, None, spent=0.0, from_step=0, first=True)),
        new_run=True,
        say=lambda t, err=False: said.append(t),
        banner=lambda handle, attempt: "",
    )


@pytest.mark.parametrize("kind", ["ClusterNotUpError", "RuntimeError"])
def test_any_exception_closes_the_run_then_is_raised(kind: str, tmp_path: Path, monkeypatch: Any) -> None:
    import sky.exceptions

    monkeypatch.chdir(tmp_path)
    exc = RuntimeError("backend bug") if kind == "RuntimeError" else getattr(sky.exceptions, kind)("llmctl-abc is gone")
    plan, uri = _plan(tmp_path)
    said: list[str] = []
    with pytest.raises(type(exc)):  # re-raised after closing: the traceback still shows, exit code 1
        _run(plan, _ReclaimedCluster(exc), said)
    [run] = mlflow_runs(uri)
    handle = run.info
    assert run.info.status == "FAILED" and run.info.end_time
    assert run.data.tags["llmctl.status"].startswith(f"failed: {kind}: "), run.data.tags["llmctl.status"]
    rows = ledger.attempts(run.data.tags)
    assert [a.n for a in rows] == [1] and rows[0].end is not None
    assert run.data.tags["llmctl.attempt.1.status"] == run.data.tags["llmctl.status"]
    assert said[-1].startswith(f"error: run {handle.run_id} FAILED: failed: {kind}"), said


def test_an_error_while_the_attempt_opens_closes_the_run_then_is_raised(tmp_path: Path, monkeypatch: Any) -> None:
    """The tracking store fails after the run exists, while its attempt opens: the run is closed
    FAILED (its attempt, opened in the ledger, billed and closed), not left RUNNING."""
    monkeypatch.chdir(tmp_path)
    plan, uri = _plan(tmp_path)
    said: list[str] = []

    def open_then_fail(handle: Any) -> Any:
        lifecycle._open_attempt(handle, plan, None, spent=0.0, from_step=0, first=True)
        raise ConnectionError("the tracking server went away")

    with pytest.raises(ConnectionError):
        _run(plan, _ReclaimedCluster(RuntimeError("never launched")), said, open_then_fail)
    [run] = mlflow_runs(uri)
    tags = run.data.tags
    assert run.info.status == "FAILED" and run.info.end_time, tags.get("llmctl.status")
    assert tags["llmctl.status"].startswith("failed: ConnectionError: the tracking server went away")
    rows = ledger.attempts(tags)
    assert [a.n for a in rows] == [1] and rows[0].end is not None
    assert said[-1].startswith(f"error: run {run.info.run_id} FAILED"), said


def test_one_closer_per_run_billed_to_the_jobs_end(tmp_path: Path, monkeypatch: Any) -> None:
    """While the run's controller is alive here, ``status``/``down`` leave the run to it; once it is
    gone, they close it as the controller's record says (the workers exited 1: FAILED), billed to
    when the job ended, not to when they looked."""
    import subprocess
    import sys

    from llmctl.controller.procs import start_time
    from llmctl.controller.workdir import CONTROLLER_FILE, JOB_END_FILE, update_json

    monkeypatch.chdir(tmp_path)
    _, handle, attempt, uri = _attempt(tmp_path)
    rid, mc = handle.run_id, mlflow_client(uri)
    ended = attempt.start + 5.0
    update_json(rid, JOB_END_FILE, time=ended, code=1, attempt=1)  # the workers' exit, as it was seen
    controller = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        update_json(rid, CONTROLLER_FILE, pid=controller.pid, start=start_time(controller.pid))
        assert closing.close_ended(uri, mc.get_run(rid), Outcome.KILLED, "llmctl down") is None
        assert mc.get_run(rid).info.status == "RUNNING", "a live controller closes its own run"
    finally:
        controller.kill()
        controller.wait()
    assert closing.close_ended(uri, mc.get_run(rid), Outcome.KILLED, "llmctl down") is Outcome.FAILED
    run = mc.get_run(rid)
    assert (run.info.status, run.data.tags["llmctl.status"]) == ("FAILED", "workload exited with code 1")
    [row] = ledger.attempts(run.data.tags)
    assert row.end == pytest.approx(ended, abs=1e-3) and run.info.end_time == int(ended * 1000)
