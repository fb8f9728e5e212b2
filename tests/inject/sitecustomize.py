"""Faults the tests (and benchmarks/fault_kinds.py) inject into llmctl's controller, from outside
the product: a process started with this folder first on ``PYTHONPATH`` loads this file at start-up
(``helpers.with_faults``), and each fault below is armed only when its variable is set. The product
has no switch for any of them.

- ``LLMCTL_TEST_BEFORE_CLOSE=CMD``: run CMD (split like a shell's words, no shell) just before the
  controller closes an attempt: a test stops the tracking server there, so the close itself fails.
- ``LLMCTL_TEST_RAISE_ON=TEXT``: the controller raises ``RuntimeError`` when it echoes a line of the
  workload's output containing TEXT: an unexpected controller-side error in the middle of a run.
- ``LLMCTL_TEST_CTRL_C_AFTER_OPEN=1``: Ctrl-C (SIGINT) to the controller right after it opened the
  run's attempt in the ledger, before anything else of the attempt exists.
- ``LLMCTL_TEST_NO_BUILTIN_TASK_INDEX=1``: lm-eval cannot index its built-in tasks (its
  ``TaskManager`` raises unless told ``include_defaults=False``): what llmctl knows of them must come
  from its own cache or the summary it ships.
- ``LLMCTL_TEST_NO_SHIPPED_TASK_INDEX=1``: llmctl ships no summary of lm-eval's tasks (its folder is
  missing).

And in the bundled trainer's processes (every rank), at the seams it has anyway:

- ``LLMCTL_FAIL_AT_STEP=N``: ``Trainer.train_step`` raises at the start of step N (a failing workload
  must exit non-zero and be reported as failed).
- ``LLMCTL_LOSS_FILE=PATH``: rank 0 appends one JSON line per logged step (``{"step": N, "train/loss":
  ...}`` or ``{"step": N, "val/loss": ...}``, with the other metrics of that log) at full precision,
  from ``MetricSink.log``, whether or not a run is tracked.
- ``LLMCTL_CKPT_PAUSE_S=S``: rank 0 sleeps S seconds before a checkpoint's completion marker
  (``Checkpointer._write_marker``): a SIGKILL then leaves a written but unmarked checkpoint, and a
  stop's emergency save lasts that much longer.
- ``LLMCTL_EXIT_PAUSE_S=S``: sleep after training returned (its checkpoint committed, the run tagged
  ``llmctl.completed``) before exiting: a stop can then land after the work is done.

Each patches a module when it is first imported; a process that never imports it is untouched. The
tests' subprocess environments put this folder on ``PYTHONPATH`` (``helpers.INJECT``), so a variable
alone arms its fault.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any, Callable

BEFORE_CLOSE = os.environ.get("LLMCTL_TEST_BEFORE_CLOSE")
RAISE_ON = os.environ.get("LLMCTL_TEST_RAISE_ON")
CTRL_C_AFTER_OPEN = os.environ.get("LLMCTL_TEST_CTRL_C_AFTER_OPEN") == "1"
NO_BUILTIN_TASK_INDEX = os.environ.get("LLMCTL_TEST_NO_BUILTIN_TASK_INDEX") == "1"
NO_SHIPPED_TASK_INDEX = os.environ.get("LLMCTL_TEST_NO_SHIPPED_TASK_INDEX") == "1"
FAIL_AT_STEP = int(os.environ.get("LLMCTL_FAIL_AT_STEP", "0") or 0)
LOSS_FILE = os.environ.get("LLMCTL_LOSS_FILE")
CKPT_PAUSE_S = float(os.environ.get("LLMCTL_CKPT_PAUSE_S", "0") or 0)
EXIT_PAUSE_S = float(os.environ.get("LLMCTL_EXIT_PAUSE_S", "0") or 0)


def _patch_close(lifecycle: Any) -> None:
    close = lifecycle._close

    def before_close(*args: Any, **kwargs: Any) -> Any:
        subprocess.run(shlex.split(BEFORE_CLOSE or ""), check=False, timeout=120)
        return close(*args, **kwargs)

    lifecycle._close = before_close


class _RaisingEcho:
    """The controller's stdout: the workload's lines are echoed through it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def write(self, text: str) -> int:
        if RAISE_ON and RAISE_ON in text:
            raise RuntimeError(f"injected fault (LLMCTL_TEST_RAISE_ON): the workload printed {RAISE_ON!r}")
        return self._inner.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _patch_echo(local: Any) -> None:
    sys.stdout = _RaisingEcho(sys.stdout)


def _patch_open_attempt(ledger: Any) -> None:
    opened = ledger.open_attempt

    def open_attempt(*args: Any, **kwargs: Any) -> Any:
        n = opened(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # the controller's handler raises here
        return n

    ledger.open_attempt = open_attempt


def _patch_task_manager(tasks: Any) -> None:
    real = tasks.TaskManager

    class WithoutBuiltins(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, include_defaults: bool = True, **kwargs: Any) -> None:
            if include_defaults:
                raise RuntimeError("injected fault (LLMCTL_TEST_NO_BUILTIN_TASK_INDEX): no built-in task index")
            super().__init__(*args, include_defaults=include_defaults, **kwargs)

    tasks.TaskManager = WithoutBuiltins


def _patch_shipped_index(index: Any) -> None:
    index.SHIPPED = index.SHIPPED.with_name("no-shipped-lm-eval-indexes")


def _patch_fail_at_step(train: Any) -> None:
    step_once = train.Trainer.train_step

    def train_step(self: Any, step: int) -> Any:
        if step == FAIL_AT_STEP:
            raise RuntimeError(f"LLMCTL_FAIL_AT_STEP={FAIL_AT_STEP}: injected failure at step {step}")
        return step_once(self, step)

    train.Trainer.train_step = train_step


def _patch_exit_pause(train: Any) -> None:
    run = train.train

    def train_then_linger(*args: Any, **kwargs: Any) -> Any:
        out = run(*args, **kwargs)
        time.sleep(EXIT_PAUSE_S)  # a stop signal meanwhile only sets the preemption flag
        return out

    train.train = train_then_linger


def _patch_loss_file(metrics: Any) -> None:
    log = metrics.MetricSink.log

    def log_and_trace(self: Any, values: dict[str, Any], step: int) -> None:
        if int(os.environ.get("RANK", "0")) == 0 and ("train/loss" in values or "val/loss" in values):
            with open(LOSS_FILE or "", "a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")
        log(self, values, step)

    metrics.MetricSink.log = log_and_trace


def _patch_checkpoint_pause(dcp: Any) -> None:
    write_marker = dcp.Checkpointer._write_marker

    def pause_then_mark(self: Any, step: int, *args: Any) -> None:
        print(f"checkpoint | step-{step} written, pausing {CKPT_PAUSE_S:g}s before its marker", flush=True)
        time.sleep(CKPT_PAUSE_S)
        write_marker(self, step, *args)

    dcp.Checkpointer._write_marker = pause_then_mark


PATCHES: dict[str, list[Callable[[Any], None]]] = {}
for armed, module, patch in (
    (BEFORE_CLOSE, "llmctl.run.lifecycle", _patch_close),
    (RAISE_ON, "llmctl.backends.local", _patch_echo),
    (CTRL_C_AFTER_OPEN, "llmctl.cost.ledger", _patch_open_attempt),
    (NO_BUILTIN_TASK_INDEX, "lm_eval.tasks", _patch_task_manager),
    (NO_SHIPPED_TASK_INDEX, "workloads.planner.lm_eval_index", _patch_shipped_index),
    (FAIL_AT_STEP, "workloads.pretrain.train", _patch_fail_at_step),
    (EXIT_PAUSE_S, "workloads.pretrain.train", _patch_exit_pause),
    (LOSS_FILE, "workloads.pretrain.components.metrics", _patch_loss_file),
    (CKPT_PAUSE_S, "workloads.pretrain.checkpoint.dcp", _patch_checkpoint_pause),
):
    if armed:
        PATCHES.setdefault(module, []).append(patch)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patches = PATCHES.pop(name, None)
        if patches is None:
            return None
        sys.meta_path.remove(self)  # find the real module
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if PATCHES:
                sys.meta_path.insert(0, self)
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            for one in patches:
                one(module)

        loader.exec_module = exec_and_patch
        return spec


if PATCHES:
    sys.meta_path.insert(0, _PatchOnImport())
