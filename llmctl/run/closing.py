"""Closing a run nobody is running any more (``llmctl down``, ``llmctl status`` when the backend
reports the job ended, a dead trial controller): what this machine recorded about the job's end
(``job_end.json``) wins over the backend's word; and the steps every close shares (a redacted tag,
the attempt's ``output.log`` uploaded, a warning for a step that failed)."""

from __future__ import annotations

import sys
from typing import Any, Optional

from llmctl.controller.procs import live_controller
from llmctl.controller.workdir import JOB_END_FILE, read_json, run_dir
from llmctl.cost import hooks, ledger
from llmctl.run.outcomes import RULES, TERMINAL, Outcome, classify
from llmctl.tracking import mlflow_run as tracking
from llmctl.tracking.mlflow_run import RunHandle


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


def run_tag(key: str, value: str) -> Any:
    from mlflow.entities import RunTag

    return RunTag(key, tracking.redact(value)[:5000])


def warn_close(what: str, exc: BaseException) -> None:
    print(
        f"warning: closing the run: {what} failed ({type(exc).__name__}: {tracking.redact(str(exc))[:300]})",
        file=sys.stderr,
        flush=True,
    )


MAX_LOG_BYTES = 5_000_000


def upload_log(mc: Any, run_id: str, n: int, name: str = "output.log") -> None:
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
