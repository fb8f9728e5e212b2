"""``benchmarks/fault_kinds.py`` end to end with one trial of one fault kind, so the benchmark cannot rot.

The benchmark is issue #32's record that every kind of fault leaves its run closed, billed to the
job's end, with no process left and a loadable checkpoint; run rarely, by hand, it would break
unnoticed as the CLI and the controller change. Here it runs as a user runs it (a subprocess, no
arguments), narrowed by its own knobs to a SIGHUP to the controller (the signal path its SIGTERM kind
shares), through every check it makes of a trial, and must report 1/1 and its headline last. Each
kind's fault itself is an e2e test of its own (tests/e2e/test_fault_close.py, test_lifecycle.py): a
second kind here (the lost tracking server: minutes on a loaded CI machine) added no check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT


@pytest.mark.slow
def test_the_benchmark_runs_a_fault_kind_as_a_user_runs_it(cache_dir: Path) -> None:
    env = {
        **os.environ,
        "FAULT_TRIALS": "1",
        "FAULT_KINDS": "sighup",
        "LLMCTL_CACHE_DIR": str(cache_dir),
    }
    out = subprocess.run(
        [sys.executable, "benchmarks/fault_kinds.py"], cwd=ROOT, env=env, text=True, capture_output=True, timeout=1500
    )
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "sighup: 1/1" in lines, out.stdout[-3000:]
    assert lines[-1] == "fault_kinds: 1/1", out.stdout[-3000:]
