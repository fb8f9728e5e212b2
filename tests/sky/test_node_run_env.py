"""The run script every SkyPilot node executes (``node_run.sh``) gives multi-node trainers NCCL's
debugging aids (flight-recorder dump on a collective timeout, NCCL warnings), keeps a value the user
set, and leaves single-node runs alone. Run for real with bash; the "python" it starts prints the
environment torchrun would have inherited."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from sky_helpers import node_python, version_env

from llmctl.backends.sky import task as sky_task

AIDS = ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_TRACE_BUFFER_SIZE", "NCCL_DEBUG")


def _env_seen(tmp_path: Path, nodes: int, **extra: str) -> dict[str, str]:
    (tmp_path / ".llmctl" / "runs" / "r1" / "program").mkdir(parents=True, exist_ok=True)
    fake = node_python(tmp_path / "python", 'echo "ARGS=$*"\nenv')
    script = tmp_path / "run.sh"
    script.write_text(sky_task.RUN)
    env = {k: v for k, v in os.environ.items() if k not in AIDS}
    env.update(
        **version_env(),
        LLMCTL_PYTHON=str(fake),
        LLMCTL_RUN_ID="r1",
        HOME=str(tmp_path),
        SKYPILOT_NUM_GPUS_PER_NODE="8",
        SKYPILOT_NODE_IPS="10.0.0.1\n10.0.0.2",
        SKYPILOT_NUM_NODES=str(nodes),
        **{"SKYPILOT_NODE_RANK": "0", **extra},
    )
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_multi_node_runs_get_the_nccl_aids(tmp_path: Path) -> None:
    seen = _env_seen(tmp_path, nodes=2)
    assert seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(seen["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert seen["NCCL_DEBUG"] == "WARN"


def test_the_users_own_setting_wins(tmp_path: Path) -> None:
    seen = _env_seen(tmp_path, nodes=2, NCCL_DEBUG="INFO", TORCH_NCCL_TRACE_BUFFER_SIZE="50")
    assert seen["NCCL_DEBUG"] == "INFO" and seen["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"


def test_one_node_is_left_alone(tmp_path: Path) -> None:
    seen = _env_seen(tmp_path, nodes=1)
    assert not any(k in seen for k in AIDS), {k: seen[k] for k in AIDS if k in seen}


@pytest.mark.parametrize("workload", ["pretrain", "command"])
def test_every_workload_gets_its_run_folder(tmp_path: Path, workload: str) -> None:
    """``LLMCTL_RUN_DIR`` (docs/workloads.md: set for every program) on a node as on infra=local: the
    folder holding the run's resolved config.yaml."""
    seen = _env_seen(tmp_path, nodes=1, LLMCTL_WORKLOAD=workload)
    assert seen["LLMCTL_RUN_DIR"] == str(tmp_path / ".llmctl" / "runs" / "r1")


def test_the_first_node_is_the_rendezvous(tmp_path: Path) -> None:
    """torchrun's master address is the first of SkyPilot's node IPs, on every node."""
    seen = _env_seen(tmp_path, nodes=2)
    assert "--master_addr=10.0.0.1 " in seen["ARGS"], seen["ARGS"]


def test_a_command_workload_node_names_its_own_address(tmp_path: Path) -> None:
    """Each node's guard gets its own line of SkyPilot's node list (where the other nodes reach it):
    torchrun would otherwise take the machine's hostname, which need not resolve to it."""
    seen = _env_seen(tmp_path, nodes=2, LLMCTL_WORKLOAD="command", SKYPILOT_NODE_RANK="1")
    assert "--local-addr=10.0.0.2" in seen["ARGS"] and "--rdzv-endpoint=10.0.0.1:" in seen["ARGS"], seen["ARGS"]


def test_a_node_with_another_llmctl_is_refused(tmp_path: Path) -> None:
    """A node whose llmctl is not the controller's build (a shared-filesystem Python, a venv kept from
    another launch) starts nothing: one line naming both, exit 3; the run's log says what it runs."""
    other = "llmctl 0.0.9 (build 000000000000)"
    fake = tmp_path / "python"
    answer = f'if [ "$*" = "-m llmctl --version" ]; then echo "{other}"; exit 0; fi'
    fake.write_text(f'#!/bin/sh\n{answer}\necho "STARTED $*"\n')
    fake.chmod(0o755)
    script = tmp_path / "run.sh"
    script.write_text(sky_task.RUN)
    env = {
        **os.environ,
        **version_env(),
        "LLMCTL_PYTHON": str(fake),
        "LLMCTL_RUN_ID": "r1",
        "HOME": str(tmp_path),
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
        "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NODE_RANK": "1",
    }
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert out.returncode == 3 and "STARTED" not in out.stdout, out
    assert out.stdout.splitlines() == [f"llmctl on node 1: {other}"]
    (refusal,) = out.stderr.strip().splitlines()
    assert f"node 1 runs {other}, the controller {version_env()['LLMCTL_VERSION_LINE']}: not started" in refusal
    assert "Fix: " in refusal
