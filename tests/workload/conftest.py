"""Fixtures for the bundled pretraining workload: typed tiny configs and a subprocess runner."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def tiny_cfg(**dotlist):
    """RootCfg with conf/model/tiny.yaml, a short schedule, and ``key=value`` overrides."""
    from omegaconf import OmegaConf

    from llmctl.schema import RootCfg

    cfg = OmegaConf.structured(RootCfg)
    cfg.model = OmegaConf.merge(cfg.model, OmegaConf.load(REPO / "conf/model/tiny.yaml"))
    base = {"train.steps": 30, "train.batch_size": 8, "train.seq_len": 64, "train.warmup_steps": 3,
            "train.log_every": 5, "train.val_every": 15, "train.val_batches": 2}
    base.update(dotlist)
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in base.items()]))


@pytest.fixture()
def write_tiny_config(tmp_path: Path, cache_dir: Path):
    """Write a resolved tiny config (the form llmctl hands to the workload); returns its path."""
    from omegaconf import OmegaConf

    def write(**dotlist) -> Path:
        path = tmp_path / f"config-{len(list(tmp_path.glob('config-*.yaml')))}.yaml"
        OmegaConf.save(tiny_cfg(**{"data.cache_dir": str(cache_dir), **dotlist}), path)
        return path

    return write


@pytest.fixture()
def workload_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_workload(args: list[str], env: dict[str, str], launcher: list[str] | None = None,
                 timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m workloads.pretrain ARGS`` (or under ``launcher``, e.g. torchrun) from the repo root."""
    cmd = (launcher or [sys.executable]) + ["-m", "workloads.pretrain", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=timeout)


def parse_losses(stdout: str) -> dict[str, dict[int, float]]:
    """{'train': {step: loss}, 'val': {step: loss}} from the rank-0 log lines."""
    train = {int(s): float(v) for s, v in re.findall(r"^step\s+(\d+)/\d+ \| loss ([\d.]+)", stdout, re.M)}
    val = {int(s): float(v) for s, v in re.findall(r"^val step (\d+) \| val/loss ([\d.]+)", stdout, re.M)}
    return {"train": train, "val": val}


@pytest.fixture()
def make_tiny_cfg():
    return tiny_cfg


@pytest.fixture()
def workload():
    """Namespace of helpers: ``workload.run(args, env)`` and ``workload.losses(stdout)``."""

    class _W:
        run = staticmethod(run_workload)
        losses = staticmethod(parse_losses)

    return _W
