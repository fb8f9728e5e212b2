"""Faults and traces that tests and benchmarks ask of the trainer, from the environment, read here
and nowhere else. Each is off unless its variable is set; a launcher never sets them. (The
controller's faults are injected from the tests instead: tests/inject/sitecustomize.py.)

- ``LLMCTL_FAIL_AT_STEP=N``: raise at the start of step N (a failing workload must exit non-zero
  and be reported as failed).
- ``LLMCTL_LOSS_FILE=PATH``: rank 0 appends one JSON line per logged step
  (``{"step": N, "train/loss": ...}`` or ``{"step": N, "val/loss": ...}``) at full precision.
- ``LLMCTL_CKPT_PAUSE_S=S``: sleep between a checkpoint's write and its completion marker (a
  SIGKILL then leaves a written but unmarked checkpoint).
- ``LLMCTL_EXIT_PAUSE_S=S``: sleep after the last step (its checkpoint committed, the run tagged
  ``llmctl.completed``) before exiting: a stop can then land after the work is done.
"""

from __future__ import annotations

import json
import os
from typing import Optional

FAIL_AT_STEP_ENV = "LLMCTL_FAIL_AT_STEP"
LOSS_FILE_ENV = "LLMCTL_LOSS_FILE"
CKPT_PAUSE_ENV = "LLMCTL_CKPT_PAUSE_S"
EXIT_PAUSE_ENV = "LLMCTL_EXIT_PAUSE_S"


def fail_at_step() -> int:
    """The step to fail at, or 0 for never."""
    return int(os.environ.get(FAIL_AT_STEP_ENV, "0") or 0)


def pause_before_exit() -> None:
    """Sleep ``$LLMCTL_EXIT_PAUSE_S`` seconds (a stop signal meanwhile only sets the preemption flag)."""
    import time

    time.sleep(float(os.environ.get(EXIT_PAUSE_ENV, "0") or 0))


def checkpoint_pause_s() -> float:
    """Seconds to wait before a checkpoint's marker, 0 for none."""
    return float(os.environ.get(CKPT_PAUSE_ENV, "0") or 0)


class LossFile:
    """``$LLMCTL_LOSS_FILE`` on rank 0: full-precision losses for tests (no-op when unset)."""

    def __init__(self, enabled: bool):
        self.path: Optional[str] = os.environ.get(LOSS_FILE_ENV) if enabled else None

    def write(self, step: int, metrics: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
