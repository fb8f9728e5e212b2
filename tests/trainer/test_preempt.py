"""Preemption inside the workload: SIGTERM to one rank stops every rank after the same step with an
emergency checkpoint; a grace period too short for a save leaves the previous checkpoint standing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from workloads.protocol.checkpoint_layout import list_checkpoints

REPO = Path(__file__).resolve().parents[2]
SHORT = {"train.steps": 400, "train.log_every": 1, "train.val_every": 0, "checkpoint.every": 3}


def _start(config: Path, env: dict[str, str], launcher: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*launcher, "-m", "workloads.pretrain", "--config", str(config)],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait_steps(loss_file: Path, n: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None
        if loss_file.exists() and len(loss_file.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError("too slow")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_sigterm_to_one_rank_stops_all_after_the_same_step(workload, write_tiny_config, workload_env, tmp_path):
    ck = tmp_path / "ck"
    config = write_tiny_config(**SHORT, **{"checkpoint.dir": str(ck)})
    loss_file = tmp_path / "losses.jsonl"
    proc = _start(config, {**workload_env, "LLMCTL_LOSS_FILE": str(loss_file)}, workload.torchrun(2))
    _wait_steps(loss_file, 4, proc)
    workers = _children(proc.pid)
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGTERM)  # one rank only: the all-reduced flag brings the other along
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-2000:]
    line = next(x for x in out.splitlines() if x.startswith("preempt |"))
    step = int(line.split("after step ")[1].split(";")[0])
    assert ("(emergency save)" in line) == (step % 3 != 0), line  # a step already saved is not saved twice
    assert list_checkpoints(str(ck)).get(step) is True
    assert step < 400


def test_no_time_for_an_emergency_save_keeps_the_previous_checkpoint(
    workload, write_tiny_config, workload_env, tmp_path
):
    ck = tmp_path / "ck"
    config = write_tiny_config(**SHORT, **{"checkpoint.dir": str(ck), "checkpoint.preempt_grace_s": 0})
    loss_file = tmp_path / "losses.jsonl"
    proc = _start(config, {**workload_env, "LLMCTL_LOSS_FILE": str(loss_file)}, [sys.executable])
    _wait_steps(loss_file, 4, proc)
    os.kill(proc.pid, signal.SIGUSR1)  # the "preemption notice" signal behaves like SIGTERM
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-2000:]
    line = next(x for x in out.splitlines() if x.startswith("preempt |"))
    step = int(line.split("after step ")[1].split(";")[0])
    assert line.startswith("preempt | SIGUSR1:") and "(emergency save)" not in line, line
    assert ("emergency save skipped" in line) == (step % 3 != 0), line
    done = {s for s, ok in list_checkpoints(str(ck)).items() if ok}
    assert max(done) == step - step % 3  # only the regular checkpoints: the previous one stands
    rerun_losses = tmp_path / "rerun.jsonl"
    rerun = workload.run(
        ["--config", str(config), "train.steps=" + str(max(done) + 2)],
        {**workload_env, "LLMCTL_LOSS_FILE": str(rerun_losses)},
    )
    assert rerun.returncode == 0 and f"resumed from step {max(done)}" in rerun.stdout, rerun.stderr[-2000:]
    trained = [json.loads(x)["step"] for x in rerun_losses.read_text().splitlines() if "train/loss" in x]
    assert trained == [max(done) + 1, max(done) + 2]  # from the previous checkpoint, not the stop step
