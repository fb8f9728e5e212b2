"""``--cpu-report``: each test's CPU, its children's included, lands in the report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT


def test_a_tests_children_count_in_its_cpu(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text("from cpu_usage import pytest_addoption, pytest_runtest_protocol\n")
    (tmp_path / "test_burn.py").write_text(
        "import subprocess, sys\n\n"
        "def test_child_burns():\n"
        "    subprocess.run([sys.executable, '-c', 'sum(i * i for i in range(10_000_000))'], check=True)\n\n"
        "def test_idle():\n"
        "    pass\n"
    )
    report = tmp_path / "cpu"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "-n",
            "0",
            "-o",
            "addopts=",
            f"--cpu-report={report}",
            "test_burn.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line.split("\t") for f in report.glob("*.tsv") for line in f.read_text().splitlines()]
    cpu = {nodeid: float(c) for nodeid, _, c in rows}
    assert set(cpu) == {"test_burn.py::test_child_burns", "test_burn.py::test_idle"}, rows
    # the child's work is the test's: more CPU than a test that does nothing
    assert cpu["test_burn.py::test_child_burns"] > cpu["test_burn.py::test_idle"], rows
