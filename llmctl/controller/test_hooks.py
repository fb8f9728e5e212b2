"""Faults that tests and benchmarks ask of the controller, from the environment, read here and
nowhere else (the trainer's are ``workloads/pretrain/components/test_hooks.py``). Each is off unless
its variable is set; llmctl never sets them, and they exist only so a test can fail a real part at
a chosen moment.

- ``LLMCTL_TEST_BEFORE_CLOSE=CMD``: run CMD (split like a shell's words, no shell) just before the
  controller closes an attempt: a test stops the tracking server there, so the close itself fails.
- ``LLMCTL_TEST_RAISE_ON=TEXT``: the local backend raises ``RuntimeError`` when a line of the
  workload's output contains TEXT: an unexpected controller-side error in the middle of a run.
"""

from __future__ import annotations

import os
import shlex
import subprocess

BEFORE_CLOSE_ENV = "LLMCTL_TEST_BEFORE_CLOSE"
RAISE_ON_ENV = "LLMCTL_TEST_RAISE_ON"


def before_close() -> None:
    cmd = os.environ.get(BEFORE_CLOSE_ENV)
    if cmd:
        subprocess.run(shlex.split(cmd), check=False, timeout=120)


def check_line(line: str) -> None:
    text = os.environ.get(RAISE_ON_ENV)
    if text and text in line:
        raise RuntimeError(f"injected fault ({RAISE_ON_ENV}): the workload printed {text!r}")
