"""Preemption and resumption inside the workload (docs/resume.md).

SIGTERM (a spot reclaim, ``llmctl down``, Slurm's ``scancel``) and SIGUSR1 (a preemption notice)
only set a flag. After every step all ranks all-reduce it (MAX), so they agree on the step to stop
at even when the signal reached them at different times. Then, if ``checkpoint.preempt_grace_s``
still leaves time for a save as long as the last one took, an emergency checkpoint is written;
otherwise the previous complete checkpoint stands. The process exits ``contract.EXIT_PREEMPTED`` (75) and
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

from workloads.pretrain.contract.protocol import ENV_ATTEMPT, TAG_PREEMPTED, TAG_START_PREFIX, TAG_TASK_ID

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signal_at is None:
            self.signal_at = time.monotonic()
            self.signame = signal.Signals(signum).name

    def check(self, device: torch.device, grace_s: float, save_s: float) -> Optional[bool]:
        """Every rank, after every step. None: carry on. True: save, then stop. False: stop unsaved.

        One all-reduce of (flag, -time left, save estimate) with MAX: any rank signalled, the least
        time left on any rank, the slowest rank's last save.
        """
        left = grace_s - (time.monotonic() - self.signal_at) if self.signal_at is not None else self.NONE
        t = torch.tensor(
            [1.0 if self.signal_at is not None else 0.0, -left, save_s], dtype=torch.float64, device=device
        )
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if t[0].item() == 0.0:
            return None
        if not self.signame:
            self.signame = "SIGTERM (on another rank)"
        return -t[1].item() >= t[2].item()


PREEMPTION = Preemption()


def record(exc: Preempted, is_main: bool) -> None:
    """Rank 0: say what happened and tag the run for the controller (best-effort)."""
    if not is_main:
        return
    # the tag first: when a scheduler cancels the job, whatever read our stdout may already be gone
    run_id, problem = os.environ.get("MLFLOW_RUN_ID"), ""
    if run_id:
        try:
            from mlflow.tracking import MlflowClient

            MlflowClient().set_tag(run_id, TAG_PREEMPTED, json.dumps(exc.info()))
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


def on_start(is_main: bool, start_step: int, world_size: int) -> dict[str, int]:
    """Rank 0 in an MLflow run: record this start; returns {metric: last step already logged}.

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
        run = mc.get_run(run_id)
        seen = [k for k in run.data.tags if k.startswith(TAG_START_PREFIX)]
        start = {
            "time": round(time.time(), 3),
            "attempt": int(os.environ.get(ENV_ATTEMPT, "1") or 1),
            "from_step": start_step,
            "world_size": world_size,
        }
        task_id = os.environ.get("SKYPILOT_TASK_ID")
        tags = {f"{TAG_START_PREFIX}{len(seen) + 1}": json.dumps(start)}
        if task_id:
            tags[TAG_TASK_ID] = task_id
        from mlflow.entities import RunTag

        mc.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        logged = {}
        for key in run.data.metrics:
            if key.startswith("cost/"):
                continue  # the launcher's snapshots, re-logged at step 0 by design
            logged[key] = max((m.step for m in mc.get_metric_history(run_id, key)), default=-1)
        return logged
    except Exception as e:
        print(f"warning: run bookkeeping on start failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return {}


def stop(checkpointer: Any, step: int, save: bool) -> Preempted:
    """All ranks: the emergency checkpoint (unless this step is already saved, or time is short),
    then the exception that ends the run."""
    sig = PREEMPTION.signame or "signal"
    if not checkpointer.root:
        return Preempted(step, None, False, sig, "checkpoint.dir unset: nothing saved")
    pending = checkpointer._pending[0] if checkpointer._pending else None
    saved, note = False, ""
    if step not in (checkpointer.last_committed, pending):
        if save:
            checkpointer.save(step)
            saved = True
        else:
            note = (
                f"emergency save skipped: it would not finish within checkpoint.preempt_grace_s"
                f" (last save took {checkpointer.save_s:.1f}s); the previous checkpoint stands"
            )
    checkpointer.close()  # an async save in flight is committed (or never marked) here
    return Preempted(step, checkpointer.last_committed, saved, sig, note)
