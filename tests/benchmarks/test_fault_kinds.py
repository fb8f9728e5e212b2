"""``benchmarks/fault_kinds.py`` end to end with one trial of two fault kinds, so the benchmark cannot rot.

The benchmark is issue #32's record that every kind of fault leaves its run closed, billed to the
job's end, with no process left and a loadable checkpoint; run rarely, by hand, it would break
unnoticed as the CLI and the controller change. Here it runs as a user runs it (a subprocess, no
arguments), narrowed by its own knobs to a SIGHUP to the controller and a server lost while closing
(the two kinds that go through the most parts: the signal path, the real ``mlflow server`` and
``llmctl status``), and must report each 1/1 and its headline last."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT


@pytest.mark.slow
def test_two_fault_kinds_one_trial_each(cache_dir: Path) -> None:
    env = {
        **os.environ,
        "FAULT_TRIALS": "1",
        "FAULT_KINDS": "sighup,tracking_lost_on_close",
        "LLMCTL_CACHE_DIR": str(cache_dir),
    }
    out = subprocess.run(
        [sys.executable, "benchmarks/fault_kinds.py"], cwd=ROOT, env=env, text=True, capture_output=True, timeout=1500
    )
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "sighup: 1/1" in lines and "tracking_lost_on_close: 1/1" in lines, out.stdout[-3000:]
    assert lines[-1] == "fault_kinds: 2/2", out.stdout[-3000:]
