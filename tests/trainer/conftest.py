"""Fixtures for the bundled pretraining workload: typed tiny configs and a subprocess runner."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_loss_file, with_injector

REPO = Path(__file__).resolve().parents[2]


def tiny_cfg(**dotlist):
    """The trainer's typed config (a ``TrainerCfg``, as ``config.load`` returns it) with
    conf/model/tiny.yaml, a short schedule, and ``key=value`` overrides."""
    from omegaconf import OmegaConf

    from workloads.protocol.schema import TrainerCfg

    cfg = OmegaConf.structured(TrainerCfg)
    cfg.model = OmegaConf.merge(cfg.model, OmegaConf.load(REPO / "conf/model/tiny.yaml"))
    base = {
        "train.steps": 30,
        "train.batch_size": 8,
        "train.seq_len": 64,
        "train.warmup_steps": 3,
        "train.log_every": 5,
        "train.val_every": 15,
        "train.val_batches": 2,
    }
    base.update(dotlist)
    return OmegaConf.to_object(OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in base.items()])))


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
    return with_injector(env)


def run_workload(
    args: list[str], env: dict[str, str], launcher: list[str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
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


@pytest.fixture(scope="session")
def workload():
    """Namespace of helpers: ``workload.run(args, env[, launcher=workload.torchrun(n)])``,
    ``workload.losses(stdout)``, ``workload.loss_file(path)``, ``workload.cfg(**dotlist)``."""

    class _W:
        run = staticmethod(run_workload)
        losses = staticmethod(parse_losses)
        torchrun = staticmethod(torchrun)
        loss_file = staticmethod(read_loss_file)
        cfg = staticmethod(tiny_cfg)

    return _W


def torchrun(nproc: int) -> list[str]:
    """Launcher prefix for ``run_workload``: ``nproc`` gloo ranks on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


@pytest.fixture(scope="session")
def moto_s3():
    """A real local S3 endpoint (moto server mode; s3fs cannot use in-process ``mock_aws``).

    Returns the environment that points boto/s3fs at it; create buckets with ``make_bucket``.
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    yield env
    server.stop()


@pytest.fixture()
def s3_bucket(moto_s3, monkeypatch, request):
    """A fresh bucket on the moto endpoint, with this process's env pointed at it: (url, env)."""
    import re

    import s3fs

    for k, v in moto_s3.items():
        monkeypatch.setenv(k, v)
    name = "ckpt-" + re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
    return f"s3://{name}", dict(moto_s3)


@pytest.fixture(scope="session")
def fake_gcs():
    """A local GCS JSON-API endpoint (gcp-storage-emulator, in memory; ``gcs_emulator.py``) for gcsfs.

    Returns the environment that points gcsfs at it. gcsfs's experimental HNS probe speaks gRPC to
    the Storage Control API, which the emulator lacks (a 60 s timeout per bucket): it is switched off."""
    import socket
    import subprocess
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("gcs_emulator.py")), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b?project=test", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("gcp-storage-emulator did not start")
    # the env var works for processes started from here; this process may have imported gcsfs
    # already, so its "gs" protocol is pointed at the plain filesystem too
    import fsspec
    import gcsfs.core

    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
    yield {"STORAGE_EMULATOR_HOST": url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    proc.terminate()
    proc.wait(10)


@pytest.fixture()
def one_process(monkeypatch):
    """The trainer's environment for one process without torchrun (its 1-rank group and mesh made
    in this process); the group is destroyed after."""
    import torch.distributed as dist

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this process")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
