"""Two nodes for real: the run script SkyPilot executes on every node (``sky_task.RUN``), run twice
on 127.0.0.1 as node 0 and node 1 of a 2-node task (``SKYPILOT_NODE_IPS``, ``SKYPILOT_NODE_RANK``),
each starting its own torchrun agent with 2 processes. HSDP replicates across the nodes and shards
within each: the losses are those of one process, step by step."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_loss_file, with_injector
from sky_helpers import REMOTE_URI

from llmctl.backends.sky import task as sky_task
from llmctl.config.compose import compose, to_yaml

pytestmark = pytest.mark.slow

TRAIN = [
    "model=tiny",
    "train.steps=6",
    "train.batch_size=8",
    "train.seq_len=64",
    "train.log_every=1",
    "train.val_every=3",
    "train.val_batches=2",
    "train.warmup_steps=2",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_on_one_host_reproduce_one_process(tmp_path: Path, cache_dir: Path) -> None:
    cfg = compose(
        [
            "infra=slurm",
            "infra.nodes=2",
            "parallel.dp_replicate=2",
            "parallel.dp_shard=2",
            f"data.cache_dir={cache_dir}",
            f"tracking.uri={REMOTE_URI}",
            *TRAIN,
        ]
    ).cfg
    task = sky_task.task_config(
        cfg,
        run_id="mn",
        tracking_uri=REMOTE_URI,
        experiment_id="1",
        local_config="<unused>",
        workdir=str(tmp_path),
        environ={},
    )
    assert task["num_nodes"] == 2 and task["envs"]["LLMCTL_NPROC_PER_NODE"] == "2"
    home = tmp_path / "home"
    (home / ".llmctl/runs/mn").mkdir(parents=True)
    (home / ".llmctl/runs/mn/config.yaml").write_text(to_yaml(cfg))  # what the file mount puts there
    repo = Path(__file__).resolve().parents[2]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_", "SKYPILOT_"))}
    envs = {k: v for k, v in task["envs"].items() if not k.startswith("MLFLOW_")}  # no tracking server here
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = with_injector(
            {
                **base,
                **envs,
                "HOME": str(home),
                "LLMCTL_PYTHON": sys.executable,
                "LLMCTL_MASTER_PORT": port,
                "SKYPILOT_NUM_NODES": "2",
                "SKYPILOT_NODE_RANK": str(rank),
                "SKYPILOT_NUM_GPUS_PER_NODE": "0",
                "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
                "LLMCTL_LOSS_FILE": str(tmp_path / f"node{rank}.jsonl"),
            }
        )
        procs.append(
            subprocess.Popen(
                ["bash", "-c", task["run"]],
                cwd=repo,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert "mesh dp_replicate 2 x dp_shard 2 x tp 1" in outs[0] and "world 4 on cpu" in outs[0], outs[0][-3000:]

    single = tmp_path / "single.yaml"
    single.write_text(to_yaml(cfg))
    ref = subprocess.run(
        [
            sys.executable,
            "-m",
            "workloads.pretrain",
            "--config",
            str(single),
            "parallel.dp_replicate=1",
            "parallel.dp_shard=1",
        ],
        cwd=repo,
        text=True,
        capture_output=True,
        env=with_injector({**base, "LLMCTL_LOSS_FILE": str(tmp_path / "single.jsonl")}),
        timeout=600,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    want, got = read_loss_file(tmp_path / "single.jsonl"), read_loss_file(tmp_path / "node0.jsonl")
    assert not (tmp_path / "node1.jsonl").exists()  # only the global rank 0 writes
    assert sorted(want["train"]) == list(range(1, 7)) and sorted(want["val"]) == [0, 3, 6]
    for kind in ("train", "val"):
        assert sorted(got[kind]) == sorted(want[kind])
        diffs = {s: abs(got[kind][s] - v) for s, v in want[kind].items()}
        assert max(diffs.values()) <= 1e-5, (kind, diffs)
