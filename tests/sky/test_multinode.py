"""Two nodes for real: the run script SkyPilot executes on every node (``sky_task.RUN``), run on two
hosts with addresses of their own (network namespaces: tests/netns_hosts.py) as node 0 and node 1 of
a 2-node task (``SKYPILOT_NODE_IPS``, ``SKYPILOT_NODE_RANK``, as SkyPilot sets them), each starting
its own torchrun agent whose processes rendezvous with node 0 over the hosts' network. The losses are
those of one process, step by step: HSDP replicating across the hosts and sharding within each, and
FSDP sharding across them, whose checkpoint (written by ranks on both hosts) one process resumes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import mlflow_server, read_loss_file, with_injector
from netns_hosts import Host, hosts, missing
from sky_helpers import REMOTE_URI

from llmctl.backends.sky import task as sky_task
from llmctl.config.compose import compose, to_yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
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


@pytest.fixture(autouse=True)
def _needs_hosts() -> None:
    if missing():
        pytest.skip(missing())  # tests/ci_policy.py fails this skip under CI


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_", "SKYPILOT_"))}


def _node_task(
    tmp_path: Path, cfg: Any, run_id: str = "mn", tracking_uri: str = "", experiment_id: str = "1"
) -> tuple[str, dict[str, str]]:
    """The 2-node SkyPilot task of ``cfg``: its run script and the environment every node gets (the
    resolved config where the file mount puts it, in the nodes' HOME). Without ``tracking_uri`` the
    nodes track nothing (no MLflow variables)."""
    task = sky_task.task_config(
        cfg,
        run_id=run_id,
        tracking_uri=tracking_uri or REMOTE_URI,
        experiment_id=experiment_id,
        local_config="<unused>",
        environ={},
    )
    assert task["num_nodes"] == 2
    run_dir = tmp_path / "home" / ".llmctl" / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    envs = {k: v for k, v in task["envs"].items() if tracking_uri or not k.startswith("MLFLOW_")}
    return task["run"], {**_base_env(), **envs, "HOME": str(tmp_path / "home")}


def _two_nodes(tmp_path: Path, cfg: Any, env: dict[str, str]) -> list[subprocess.CompletedProcess[str]]:
    """The task's run script started on each of two hosts as SkyPilot starts it; how each node ended."""
    script, node_env = _node_task(tmp_path, cfg)
    with hosts(2) as machines:
        return _run_nodes(machines, script, {**node_env, **env}, tmp_path)


def _run_nodes(machines: list[Host], script: str, env: dict[str, str], tmp_path: Path) -> list[Any]:
    procs = _start_nodes(machines, script, env, tmp_path)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(procs, outs)]


def _one_process(cfg: Any, tmp_path: Path, name: str, *overrides: str) -> dict[str, dict[int, float]]:
    """The same job in one process on this host: its losses."""
    config = tmp_path / f"{name}.yaml"
    config.write_text(to_yaml(cfg))
    args = ["--config", str(config), "parallel.dp_replicate=1", "parallel.dp_shard=1", *overrides]
    env = with_injector({**_base_env(), "LLMCTL_LOSS_FILE": str(tmp_path / f"{name}.jsonl")})
    cmd = [sys.executable, "-m", "workloads.pretrain", *args]
    ref = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, env=env, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return read_loss_file(tmp_path / f"{name}.jsonl")


def _assert_same_losses(got: dict[str, dict[int, float]], want: dict[str, dict[int, float]]) -> None:
    for kind in ("train", "val"):
        assert sorted(got[kind]) == sorted(want[kind]), kind
        diffs = {s: abs(got[kind][s] - v) for s, v in want[kind].items()}
        assert max(diffs.values()) <= 1e-5, (kind, diffs)


def test_hsdp_across_two_hosts_reproduces_one_process(tmp_path: Path, cache_dir: Path) -> None:
    overrides = ["infra=slurm", "infra.nodes=2", "parallel.dp_replicate=2", "parallel.dp_shard=2"]
    cfg = compose([*overrides, f"data.cache_dir={cache_dir}", f"tracking.uri={REMOTE_URI}", *TRAIN]).cfg
    nodes = _two_nodes(tmp_path, cfg, {})
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(n.stdout[-3000:] for n in nodes)
    out = nodes[0].stdout
    assert "mesh dp_replicate 2 x dp_shard 2 x tp 1" in out and "world 4 on cpu" in out, out[-3000:]
    want = _one_process(cfg, tmp_path, "single")
    assert not (tmp_path / "node1.jsonl").exists()  # only the global rank 0 writes
    assert sorted(want["train"]) == list(range(1, 7)) and sorted(want["val"]) == [0, 3, 6]
    _assert_same_losses(read_loss_file(tmp_path / "node0.jsonl"), want)


def test_fsdp_across_two_hosts_then_one_process_resumes_its_checkpoint(tmp_path: Path, cache_dir: Path) -> None:
    """One process per host, FSDP sharding across the hosts, a checkpoint every 3 steps on the shared
    filesystem, the job failing at step 8 (injected): one process on this host resumes from step 6
    (world size 2 -> 1) and ends where one process trained straight through ends."""
    ckpt = tmp_path / "ckpt"
    overrides = ["infra=slurm", "infra.nodes=2", "parallel.dp_replicate=1", "parallel.dp_shard=2"]
    train = [*TRAIN, "train.steps=9", "checkpoint.every=3", f"checkpoint.dir={ckpt}"]
    cfg = compose([*overrides, f"data.cache_dir={cache_dir}", f"tracking.uri={REMOTE_URI}", *train]).cfg
    nodes = _two_nodes(tmp_path, cfg, {"LLMCTL_FAIL_AT_STEP": "8"})
    assert all(n.returncode != 0 for n in nodes), "the injected failure at step 8 ends the job on both hosts"
    assert "world 2 on cpu" in nodes[0].stdout and "LLMCTL_FAIL_AT_STEP=8" in nodes[0].stdout, nodes[0].stdout[-3000:]
    assert sorted(p.name for p in ckpt.iterdir() if (p / ".complete").is_file()) == ["step-3", "step-6"]

    want = _one_process(cfg, tmp_path, "straight", "checkpoint.dir=null")
    resumed = _one_process(cfg, tmp_path, "resumed")
    crossed = read_loss_file(tmp_path / "node0.jsonl")
    before = {k: {s: v for s, v in want[k].items() if s <= 6} for k in want}
    _assert_same_losses({k: {s: v for s, v in crossed[k].items() if s <= 6} for k in crossed}, before)
    after = {k: {s: v for s, v in want[k].items() if s > 6} for k in want}
    _assert_same_losses(resumed, after)


def test_a_lost_host_ends_the_other_within_the_collective_timeout(tmp_path: Path, cache_dir: Path) -> None:
    """Host 1 goes away mid-run, once both hosts wrote a checkpoint, as a lost node does: its link goes
    down, then its processes die, so no connection is ever reset. Host 0's rank, waiting in a
    collective, ends the job after
    ``parallel.collective_timeout_s`` (not torch's default, nor forever), and one process resumes from
    the newest complete checkpoint written across the hosts."""
    ckpt = tmp_path / "ckpt"
    overrides = ["infra=slurm", "infra.nodes=2", "parallel.dp_replicate=1", "parallel.dp_shard=2"]
    train = [*TRAIN, "train.steps=100000", "checkpoint.every=2", f"checkpoint.dir={ckpt}"]
    timeout = ["parallel.collective_timeout_s=15"]
    cfg = compose([*overrides, *timeout, f"data.cache_dir={cache_dir}", f"tracking.uri={REMOTE_URI}", *train]).cfg
    script, env = _node_task(tmp_path, cfg)
    with hosts(2) as machines:
        procs = _start_nodes(machines, script, env, tmp_path)
        try:
            _wait_for(ckpt / "step-4" / ".complete", procs)  # a checkpoint both hosts wrote
            machines[1].lose()
            out = procs[0].communicate(timeout=15 + 300)[0]  # the timeout, and a loaded machine's slack
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    assert procs[0].returncode != 0, out[-3000:]
    assert "Timed out waiting 15000ms" in out, out[-3000:]  # gloo's words: the configured timeout ended it
    newest = max(int(p.name.split("-")[1]) for p in ckpt.iterdir() if (p / ".complete").is_file())
    assert newest >= 4
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "workloads.pretrain",
            "--config",
            str(tmp_path / "home" / ".llmctl/runs/mn/config.yaml"),
            "parallel.dp_shard=1",
        ],
        cwd=REPO,
        text=True,
        capture_output=True,
        env=with_injector({**_base_env(), "LLMCTL_FAIL_AT_STEP": str(newest + 2)}),
        timeout=600,
    )
    assert f"resumed from step {newest}" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"LLMCTL_FAIL_AT_STEP={newest + 2}" in again.stderr  # it went on training from there


def _start_nodes(machines: list[Host], script: str, env: dict[str, str], tmp_path: Path) -> list[Any]:
    ips = "\n".join(m.address for m in machines)
    procs = []
    for rank, machine in enumerate(machines):
        node_env = {
            **env,
            "LLMCTL_PYTHON": sys.executable,
            "SKYPILOT_NUM_NODES": str(len(machines)),
            "SKYPILOT_NODE_RANK": str(rank),
            "SKYPILOT_NUM_GPUS_PER_NODE": "0",
            "SKYPILOT_NODE_IPS": ips,
            "LLMCTL_LOSS_FILE": str(tmp_path / f"node{rank}.jsonl"),
        }
        run, out = ["bash", "-c", script], subprocess.PIPE
        procs.append(machine.popen(run, with_injector(node_env), cwd=REPO, stdout=out, stderr=subprocess.STDOUT))
    return procs


def _wait_for(path: Path, procs: list[Any], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a node ended before the host was lost"
        if path.exists():
            return
        time.sleep(0.2)
    raise AssertionError(f"{path} never appeared")


def test_a_command_workload_under_torchrun_spans_two_hosts_as_one_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``workload=command workload.torchrun=true`` on two hosts, one rank each: each node's guard starts
    torchrun with the node's rank and node 0's address as the rendezvous; the user's DDP program (no
    llmctl import) is one process group across the hosts and logs into the one MLflow run, on a
    tracking server both hosts reach; each guard counts its rank's exit."""
    from mlflow.tracking import MlflowClient

    launch_dir = tmp_path / "launch"  # where the user launches from: their program's directory
    launch_dir.mkdir()
    shutil.copy(REPO / "tests" / "e2e" / "programs" / "ddp.py", launch_dir / "ddp.py")
    monkeypatch.chdir(launch_dir)
    (tmp_path / "mlflow").mkdir()
    with hosts(2) as machines, mlflow_server(tmp_path / "mlflow", host=machines[0].gateway) as uri:
        mc = MlflowClient(tracking_uri=uri)
        experiment = mc.create_experiment("llmctl")
        rid = mc.create_run(experiment).info.run_id
        command = ["workload=command", "workload.run=python ddp.py --steps 5", "workload.torchrun=true"]
        infra = ["infra=slurm", "infra.nodes=2", "infra.nproc_per_node=1", f"tracking.uri={uri}"]
        cfg = compose([*command, *infra]).cfg
        script, env = _node_task(tmp_path, cfg, run_id=rid, tracking_uri=uri, experiment_id=experiment)
        shutil.copytree(launch_dir, tmp_path / "home" / ".llmctl" / "runs" / rid / "program")  # the file mount
        nodes = _run_nodes(machines, script, env, tmp_path)
        losses = [m.step for m in mc.get_metric_history(rid, "ddp/loss")]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(n.stdout[-3000:] for n in nodes)
    assert "program | 2 ranks, replicas equal: True" in nodes[0].stdout, nodes[0].stdout[-3000:]
    assert losses == [1, 2, 3, 4, 5]  # global rank 0's, into the one run
