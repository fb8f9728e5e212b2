"""A training step across two hosts against the same step on one host, on this machine (CPU, gloo).

    sudo python benchmarks/two_hosts.py        # root: the hosts are network namespaces

The same job, FSDP over 2 processes (``parallel.dp_shard=2``, the smoke model, batch 16 x 128
tokens), started two ways with torchrun: (1) one host, both processes on it (``--nproc_per_node 2``:
gloo over that host's loopback); (2) two hosts, one process each (``--nnodes 2``, rendezvous at the
first host's address: every all-gather and reduce-scatter crosses the hosts' bridge as it would a
LAN). The hosts are network namespaces on one bridge (``tests/netns_hosts.py``, what the multi-host
tests use), so both ways share this machine's CPUs: the ratio is what the network path between
hosts costs a step here (veth and a bridge against loopback), not what a real cluster's network
would. ``ROUNDS`` rounds alternating, each way's time of its training loop (the trainer's
``N steps in X s``: after start-up, validation included) as its median; prints
``two_hosts: <2 hosts / 1 host> (step time)``.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from netns_hosts import Host, hosts, missing  # noqa: E402 - tests/ on the path first

ROUNDS, STEPS, PORT = 5, 40, 29511
TRAIN = [
    "model=smoke",
    f"train.steps={STEPS}",
    "train.batch_size=16",
    "train.seq_len=128",
    "train.log_every=10",
    "train.val_every=0",
    "checkpoint.every=0",
    "parallel.dp_replicate=1",
    "parallel.dp_shard=2",
]
LOOP = re.compile(r"(\d+) steps in ([\d.]+)s")


def config(work: Path) -> Path:
    """The job's resolved config (``llmctl config show``), as a node is given it."""
    out = subprocess.run(
        [sys.executable, "-m", "llmctl", "config", "show", *TRAIN, f"data.cache_dir={work / 'cache'}"],
        cwd=work,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
        capture_output=True,
        text=True,
    )
    path = work / "run.yaml"
    path.write_text(out.stdout)
    return path


def torchrun(host: Host, cfg: Path, *, nnodes: int, node_rank: int, nproc: int, master: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--nproc_per_node={nproc}",
        f"--master_addr={master}",
        f"--master_port={PORT}",
        "-m",
        "workloads.pretrain",
        "--config",
        str(cfg),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # one thread per process: 2 processes, 2 cores
    return host.popen(cmd, env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def loop_seconds(procs: list[subprocess.Popen[str]]) -> float:
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("a node failed:\n" + "\n---\n".join(o[-3000:] for o in outs))
    found = LOOP.search(outs[0])
    if not found or int(found.group(1)) != STEPS:
        sys.exit(f"no training-loop time in rank 0's output:\n{outs[0][-3000:]}")
    return float(found.group(2))


def main() -> None:
    if missing():
        sys.exit(f"two_hosts: {missing()}")
    with tempfile.TemporaryDirectory(prefix="llmctl-two-hosts-") as tmp, hosts(2) as (first, second):
        cfg = config(Path(tmp))
        one_host, two_hosts = [], []
        for i in range(ROUNDS + 1):  # round 0 builds the corpus cache and warms the page cache: not counted
            one = loop_seconds([torchrun(first, cfg, nnodes=1, node_rank=0, nproc=2, master=first.address)])
            two = loop_seconds(
                [
                    torchrun(host, cfg, nnodes=2, node_rank=rank, nproc=1, master=first.address)
                    for rank, host in enumerate((first, second))
                ]
            )
            if i:
                one_host.append(one)
                two_hosts.append(two)
            print(f"round {i}{' (warm-up)' if not i else ''}: 1 host {one:.2f} s, 2 hosts {two:.2f} s", flush=True)
    a, b = statistics.median(one_host), statistics.median(two_hosts)
    per_step = f"{a / STEPS * 1000:.0f} ms/step against {b / STEPS * 1000:.0f}"
    print(f"{STEPS} steps: 1 host {a:.2f} s, 2 hosts {b:.2f} s ({per_step})")
    print(f"two_hosts: {b / a:.2f}x (step time, 2 hosts / 1 host, CPU/gloo over a veth bridge on one machine)")


if __name__ == "__main__":
    main()
