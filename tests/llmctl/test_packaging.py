"""The config tree ships inside the wheel, so an installed llmctl finds conf/ without a clone."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT


@pytest.mark.slow
def test_wheel_carries_conf_and_finds_it(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wheel = next(tmp_path.glob("llmctl-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "llmctl/conf/config.yaml",
        "llmctl/conf/model/1b.yaml",
        "llmctl/conf/infra/local.yaml",
        "llmctl/conf/experiment/smoke.yaml",
        "workloads/pretrain/train.py",
        "llmctl/cli.py",
        "llmctl/backends/sky/node_run.sh",  # what every SkyPilot node runs, read beside its module
    ):
        assert expected in names, expected
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    out = subprocess.run(
        [sys.executable, "-c", "from llmctl.config.compose import conf_dir; print(conf_dir())"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(out.stdout.strip()) == site / "llmctl" / "conf"
