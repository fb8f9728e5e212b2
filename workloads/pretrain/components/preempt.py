"""Preemption and resumption inside the workload (docs/resume.md).

SIGTERM (a spot reclaim, ``llmctl down``, Slurm's ``scancel``) and SIGUSR1 (a preemption notice)
only set a flag. One process reads it after every step. Several all-reduce it (MAX) after every
``AGREE_EVERY`` steps and at every checkpoint step (``agreement_due``), so they agree on the step to
stop at even when the signal reached them at different times: a collective and a host sync every
step would keep the CPU from running ahead of the GPU. Then, if ``checkpoint.preempt_grace_s``
still leaves time for a save to become durable, an emergency checkpoint is written; otherwise the
previous complete checkpoint stands. "Durable" includes an async save's background write and
commit; before any save of the attempt is measured, the loaded checkpoint's recorded save time or
an estimate from the state's size stands in (``Checkpointer.emergency_save_s``). The log line says
which, and the two numbers compared. The process exits ``contract.EXIT_PREEMPTED`` (75) and
rank 0 tags the MLflow run ``llmctl.preempted`` (JSON) for the controller: torchrun reports any
non-zero worker exit as 1, so the tag, not the exit status, is the contract.

On start inside an existing MLflow run, rank 0 also:
- records the start (``llmctl.workload_start.<k>``: time, ``$LLMCTL_ATTEMPT``, from step, world
  size) and ``SKYPILOT_TASK_ID`` (stable across managed-job recoveries) as ``llmctl.sky.task_id``.
  Facts only: the launcher turns a second start under one attempt (a managed job's recovery) into
  a billed attempt; the workload writes no bills;
- returns the last step already logged per metric, so steps recomputed after a resume are not
  logged twice (their values are the ones logged the first time: same data, same state).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from workloads.protocol.run_contract import (
    ENV_ATTEMPT,
    TAG_COMPLETED,
    TAG_PREEMPTED,
    TAG_START_PREFIX,
    TAG_TASK_ID,
    node_where,
)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Steps between the ranks' agreements (preemption flag, budget). A signal then waits at most this
# many steps; the grace period's clock runs from the signal, so a late agreement only shortens
# the time left for the emergency save, which is then skipped if it no longer fits.
AGREE_EVERY = 10


def agreement_due(step: int, checkpoint_every: int, world_size: int) -> bool:
    """Whether the ranks compare their flags after ``step``: always with one process (nothing to
    compare, no collective), else every ``AGREE_EVERY`` steps and at each checkpoint step (a stop
    there needs no emergency save). Every rank computes the same answer from the step alone."""
    if world_size <= 1:
        return True
    return step % AGREE_EVERY == 0 or (checkpoint_every > 0 and step % checkpoint_every == 0)


class Preempted(Exception):
    """Raised out of the training loop after the emergency checkpoint (or the decision to skip it)."""

    def __init__(self, step: int, checkpoint: Optional[int], saved: bool, signame: str, note: str = ""):
        super().__init__(f"preempted ({signame}) after step {step}")
        self.step, self.checkpoint, self.saved, self.signame, self.note = step, checkpoint, saved, signame, note

    def info(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "checkpoint": self.checkpoint,
            "saved": self.saved,
            "signal": self.signame,
            "note": self.note,
        }


class Preemption:
    """The signal flag and the per-step agreement on it. Install once, in the main thread."""

    NONE = 1e9  # "no deadline" in the all-reduced tensor

    def __init__(self) -> None:
        self.signal_at: Optional[float] = None
        self.signame = ""
        # the decision's two numbers (seconds of grace left, seconds the save needs), for the log
        self.decided: Optional[tuple[float, float]] = None

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signal_at is None:
            self.signal_at = time.monotonic()
            self.signame = signal.Signals(signum).name

    def check(self, device: torch.device, grace_s: float, save_s: float, due: bool = True) -> Optional[bool]:
        """Every rank, after every step. None: carry on. True: save, then stop. False: stop unsaved.

        One process: the flag itself, no tensor. Several, on the steps ``due`` (``agreement_due``,
        the same on every rank): one all-reduce of (flag, -time left, save estimate) with MAX: any
        rank signalled, the least time left on any rank, the slowest rank's last save.
        """
        left = grace_s - (time.monotonic() - self.signal_at) if self.signal_at is not None else self.NONE
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            if self.signal_at is None:
                return None
            self.decided = (left, save_s)
            return left >= save_s
        if not due:
            return None
        t = torch.tensor(
            [1.0 if self.signal_at is not None else 0.0, -left, save_s], dtype=torch.float64, device=device
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flag, neg_left, save = t.tolist()  # one device-to-host copy
        if flag == 0.0:
            return None
        if not self.signame:
            self.signame = "SIGTERM (on another rank)"
        self.decided = (-neg_left, save)
        return -neg_left >= save


PREEMPTION = Preemption()

# which start of the workload this process is (``on_start`` adds its k): every fact it records names
# it, so a launcher never reads an earlier start's preemption as this one's (workloads/protocol/run_contract.py)
THIS_START: dict[str, Any] = {}


def scope() -> dict[str, Any]:
    """``{"start": k, "attempt": n}`` of this process's start, for the facts it records."""
    out: dict[str, Any] = {"attempt": int(os.environ.get(ENV_ATTEMPT, "1") or 1)}
    if "start" in THIS_START:
        out["start"] = THIS_START["start"]
    return out


def record_completed(step: int, checkpoint: Optional[int], is_main: bool) -> None:
    """Rank 0, after the last step and the final checkpoint's commit: tag the run ``llmctl.completed``
    (best-effort). A stop that arrives after this (torchrun then exits 1 although every worker ended
    0) does not make the run a failed or preempted one."""
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not (is_main and run_id):
        return
    try:
        from mlflow.tracking import MlflowClient

        MlflowClient().set_tag(run_id, TAG_COMPLETED, json.dumps({"step": step, "checkpoint": checkpoint, **scope()}))
    except Exception as e:
        print(f"warning: could not tag the run as completed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)


def record(exc: Preempted, is_main: bool) -> None:
    """Rank 0: say what happened and tag the run for the controller (best-effort)."""
    if not is_main:
        return
    # the tag first: when a scheduler cancels the job, whatever read our stdout may already be gone
    run_id, problem = os.environ.get("MLFLOW_RUN_ID"), ""
    if run_id:
        try:
            from mlflow.tracking import MlflowClient

            MlflowClient().set_tag(run_id, TAG_PREEMPTED, json.dumps({**exc.info(), **scope()}))
        except Exception as e:
            problem = f"warning: could not tag the run as preempted ({type(e).__name__}: {e})"
    ck = f"checkpoint step-{exc.checkpoint}" if exc.checkpoint is not None else "no checkpoint"
    try:
        print(
            f"preempt | {exc.signame}: stopped after step {exc.step}; {ck}"
            f"{' (emergency save)' if exc.saved else ''}{'; ' + exc.note if exc.note else ''}",
            flush=True,
        )
        if problem:
            print(problem, file=sys.stderr, flush=True)
    except OSError:  # a closed pipe (the job step's reader was cancelled first)
        pass


def begin(is_main: bool, world_size: int) -> None:
    """Rank 0 in an MLflow run, first thing: record this start (``llmctl.workload_start.<k>``) before
    anything that can fail (data, model, checkpoint load). A start that crashes early then still
    counts as the newest, and an earlier start's ``llmctl.preempted`` is not read as its own. Its
    ``from_step`` is filled in by ``on_start`` once the checkpoint is loaded."""
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not (is_main and run_id):
        return
    try:
        _record_start(run_id, None, world_size)
    except Exception as e:
        print(f"warning: recording the start failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)


def _record_start(run_id: str, start_step: Optional[int], world_size: int) -> Any:
    """Write this process's start tag (a new k the first time, the same k after); returns the run."""
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    mc = MlflowClient()
    run = mc.get_run(run_id)
    k = THIS_START.get("start") or len([t for t in run.data.tags if t.startswith(TAG_START_PREFIX)]) + 1
    start = {
        "time": THIS_START.get("time", round(time.time(), 3)),
        "attempt": int(os.environ.get(ENV_ATTEMPT, "1") or 1),
        "from_step": start_step,
        "world_size": world_size,
    }
    where = node_where()
    if where:
        start["where"] = where
    tags = {f"{TAG_START_PREFIX}{k}": json.dumps(start)}
    task_id = os.environ.get("SKYPILOT_TASK_ID")
    if task_id:
        tags[TAG_TASK_ID] = task_id
    mc.log_batch(run_id, tags=[RunTag(key, v) for key, v in tags.items()])
    THIS_START.update(start=k, time=start["time"])  # recorded: the facts this process writes name it
    return run


def on_start(is_main: bool, start_step: int, world_size: int) -> dict[str, int]:
    """Rank 0 in an MLflow run: complete this start's record with the step it starts from (``begin``
    recorded it; a new record if that failed); returns {metric: last step already logged}.

    The start is a fact, not a bill: ``llmctl.workload_start.<k>`` = JSON (time, the launcher's
    attempt ``$LLMCTL_ATTEMPT``, the step it starts from, world size, SkyPilot's task id). A
    launcher that sees two starts under one attempt knows its supervisor (a managed job) reran the
    job, and bills that as a new attempt (llmctl: ``cost/ledger.py``).
    """
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not (is_main and run_id):
        return {}
    try:
        from mlflow.tracking import MlflowClient

        mc = MlflowClient()
        run = _record_start(run_id, start_step, world_size)
        logged = {}
        for key in run.data.metrics:
            if key.startswith("cost/"):
                continue  # the launcher's snapshots, re-logged at step 0 by design
            logged[key] = max((m.step for m in mc.get_metric_history(run_id, key)), default=-1)
        return logged
    except Exception as e:
        print(f"warning: run bookkeeping on start failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return {}


def _why(checkpointer: Any, save: bool) -> str:
    """The emergency save's decision in words: the time it needs, where that figure comes from,
    and the grace left (the slowest rank's and the least, when several ranks agreed)."""
    left, need = PREEMPTION.decided or (0.0, checkpointer.emergency_save_s())
    basis = f"~{need:.1f}s ({checkpointer.describe_save_estimate()})"
    grace = f"{max(0.0, left):.1f}s of checkpoint.preempt_grace_s left"
    if save:
        return f"emergency save: needs {basis}, {grace}"
    return (
        f"emergency save skipped: it would not finish within checkpoint.preempt_grace_s (needs {basis}, only"
        f" {grace}); the previous checkpoint stands. A longer grace (within the platform's notice) or"
        " checkpoint.every bounds the loss"
    )


def stop(checkpointer: Any, step: int, save: bool) -> Preempted:
    """All ranks: the emergency checkpoint (unless this step is already saved, or time is short),
    then the exception that ends the run."""
    sig = PREEMPTION.signame or "signal"
    if not checkpointer.root:
        return Preempted(step, None, False, sig, "checkpoint.dir unset: nothing saved")
    pending = checkpointer._pending[0] if checkpointer._pending else None
    saved, note = False, ""
    if step not in (checkpointer.last_committed, pending):
        note = _why(checkpointer, save)  # before saving: the estimate the decision used
        if save:
            checkpointer.save(step)
            saved = True
    checkpointer.close()  # an async save in flight is committed (or never marked) here
    # Nobody leaves before rank 0 has marked the save: under torchrun a rank that ends first ends the
    # group (the agent stops the others and SIGKILLs them after its shutdown timeout, 30 s on torch
    # 2.11, whatever the grace), which would cut rank 0's commit and its record of the stop.
    checkpointer.settle()
    return Preempted(step, checkpointer.last_committed, saved, sig, note)
