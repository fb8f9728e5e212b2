"""The GPU suite is invisible to a plain ``pytest`` (CI) and, selected with ``-m gpu`` on a machine
without CUDA, collects without errors and skips every test with the reason."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "tests/gpu", *args],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=300,
    )


def test_default_run_deselects_the_gpu_suite() -> None:
    out = _pytest("--collect-only", "-q")
    assert out.returncode == 5, out.stdout[-2000:] + out.stderr  # 5: no tests selected
    assert re.search(r"(\d+) deselected", out.stdout) and "test_gpu.py::" not in out.stdout, out.stdout[-2000:]


def test_gpu_marker_selects_every_test_and_skips_them_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the suite would run, not skip")
    collected = _pytest("-m", "gpu", "--collect-only", "-q")
    ids = [line for line in collected.stdout.splitlines() if "test_gpu.py::" in line]
    assert collected.returncode == 0 and len(ids) >= 6, collected.stdout[-2000:] + collected.stderr
    ran = _pytest("-m", "gpu", "-q")
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr
    assert f"{len(ids)} skipped" in ran.stdout and "error" not in ran.stdout.lower(), ran.stdout[-2000:]
