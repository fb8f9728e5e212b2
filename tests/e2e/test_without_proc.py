"""Ctrl-C and ``llmctl down`` stop every worker of a two-rank run when llmctl cannot read ``/proc``
(macOS has none; psutil, llmctl's process table, reads it on Linux). The controller and ``down`` run
in a mount namespace of their own with an empty tmpfs over ``/proc`` (``unshare``, as root); the test,
outside it, sees every process and checks that none of the run's survives. Each rank leads a session
of its own (torchrun starts it so), so stopping torchrun's process group alone would not reach them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import assert_outcome, mlflow_client
from test_lifecycle import SMALL, _run_id, _wait_training

from llmctl.run.outcomes import RULES, Outcome

# the command after it runs where /proc is an empty folder; its own pid stays the launched process's
HIDE_PROC = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs none /proc && exec "$@"', "sh"]


def _hidden_proc_supported() -> str:
    """Why /proc cannot be hidden here ('' when it can)."""
    if os.geteuid() != 0:
        return "hiding /proc needs root (a mount namespace)"
    if not shutil.which("unshare"):
        return "unshare (util-linux) is not installed"
    probe = subprocess.run([*HIDE_PROC, "ls", "/proc"], capture_output=True, text=True)
    return "" if probe.returncode == 0 and not probe.stdout.strip() else f"cannot hide /proc: {probe.stderr.strip()}"


def _run_processes(controller: int) -> list[psutil.Process]:
    """Everything below the controller: torchrun's agent and the ranks (seen from outside)."""
    return psutil.Process(controller).children(recursive=True)


def _survivors(procs: list[psutil.Process]) -> list[int]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl_c", "down"])
def test_a_stop_reaches_every_rank_with_proc_hidden(how: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    why_not = _hidden_proc_supported()
    if why_not:
        pytest.skip(why_not)  # tests/ci_policy.py fails this skip under CI
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    loss_file = tmp_path / "losses.jsonl"
    env = {**cli_env, "LLMCTL_LOSS_FILE": str(loss_file)}
    args = ["launch", *SMALL, "parallel.dp_shard=2", "train.steps=100000", f"tracking.uri={uri}"]
    proc = subprocess.Popen(
        [*HIDE_PROC, sys.executable, "-m", "llmctl", *args],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_training(loss_file, proc, after=0)
        run = _run_processes(proc.pid)
        assert len([p for p in run if "workloads.pretrain" in " ".join(p.cmdline())]) >= 2, run
        rid = _run_id(tmp_path)
        if how == "ctrl_c":
            proc.send_signal(signal.SIGINT)
        else:
            down = subprocess.run(
                [*HIDE_PROC, sys.executable, "-m", "llmctl", "down", rid],
                cwd=tmp_path,
                env=env,
                text=True,
                capture_output=True,
                timeout=300,
            )
            assert down.returncode == 0, down.stdout + down.stderr
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    outcome = Outcome.INTERRUPTED if how == "ctrl_c" else Outcome.PREEMPTED
    assert proc.returncode == RULES[outcome].exit_code, out[-3000:] + err[-3000:]
    if how == "ctrl_c":
        assert_outcome(uri, rid, outcome, proc.returncode, attempt=1)
    else:  # the user's own stop, with the ranks' emergency save: KILLED, exit 75, resumable
        tags = mlflow_client(uri).get_run(rid).data.tags
        assert tags["llmctl.status"].startswith("stopped by llmctl down at step"), tags["llmctl.status"]
        assert json.loads(tags["llmctl.preempted"])["checkpoint"] is not None  # saved, or already saved
    deadline = time.monotonic() + 30  # a rank's exit is the kernel's: give a loaded machine a moment
    while _survivors(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _survivors(run) == [], "a worker outlived its controller"
