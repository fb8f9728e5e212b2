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
  from its own cache.

Each patches a module of llmctl (or of a library it calls) when it is first imported (workload
processes, which import no llmctl, are untouched).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
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


PATCHES: dict[str, Callable[[Any], None]] = {}
if BEFORE_CLOSE:
    PATCHES["llmctl.run.lifecycle"] = _patch_close
if RAISE_ON:
    PATCHES["llmctl.backends.local"] = _patch_echo
if CTRL_C_AFTER_OPEN:
    PATCHES["llmctl.cost.ledger"] = _patch_open_attempt
if NO_BUILTIN_TASK_INDEX:
    PATCHES["lm_eval.tasks"] = _patch_task_manager


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.pop(name, None)
        if patch is None:
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
            patch(module)

        loader.exec_module = exec_and_patch
        return spec


if PATCHES:
    sys.meta_path.insert(0, _PatchOnImport())
