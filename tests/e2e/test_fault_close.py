"""Faults while a run is being run or closed, end to end (issue #32): the controller's SSH session drops
(SIGHUP), and the tracking server dies while the controller closes the attempt. Each ends with the run
in a true terminal state, its attempt closed and billed to when the job ended, and no worker left.
Real parts: the CLI in subprocesses, the workload, a real ``mlflow server`` killed and restarted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
from helpers import assert_outcome, free_port, mlflow_client, run_cli, start_mlflow_server, with_faults
from test_lifecycle import SMALL, _run_id, _start, _wait_training, _workers

from llmctl.controller.procs import descendants, pid_alive
from llmctl.cost import ledger
from llmctl.run.outcomes import RULES, Outcome

GRACE_S = 20.0  # checkpoint.preempt_grace_s, the workload's default: the spec's bound on the stop


@pytest.mark.slow
def test_sighup_to_the_controller_stops_the_workers_with_a_checkpoint(cli_env: dict[str, str], tmp_path: Path) -> None:
    """An SSH session that drops sends the controller SIGHUP: it is taken like SIGTERM (the workers
    checkpoint and stop), and the attempt is closed: PREEMPTED, resumable, nothing left running."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    loss_file = tmp_path / "losses.jsonl"
    env = {**cli_env, "LLMCTL_LOSS_FILE": str(loss_file)}
    proc = _start(["launch", *SMALL, "train.steps=100000", f"checkpoint.preempt_grace_s={GRACE_S}"], tmp_path, env)
    _wait_training(loss_file, proc, after=0)
    rid = _run_id(tmp_path)
    workers = _workers(tmp_path / "llmctl-runs" / rid)
    group = [workers, *descendants(workers)]
    os.kill(proc.pid, signal.SIGHUP)
    _, said = proc.communicate(timeout=GRACE_S + 480)  # the grace period, plus closing on a loaded machine
    assert proc.returncode == RULES[Outcome.PREEMPTED].exit_code, said[-3000:]
    tags = assert_outcome(uri, rid, Outcome.PREEMPTED, proc.returncode, attempt=1)
    stopped = json.loads(tags["llmctl.preempted"])  # the workers' own record: they got the stop and saved
    assert stopped["checkpoint"] is not None and stopped["start"] == 1, stopped  # scoped to its start
    assert not [p for p in group if pid_alive(p)], "a worker outlived its controller"


@pytest.mark.slow
def test_a_trainer_save_longer_than_torchruns_shutdown_timeout_gets_the_promised_grace(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    """Two ranks under torchrun, ``preempt_grace_s=90`` and an emergency save that takes 40 s (a pause
    before its marker, injected): torchrun's agent, stopped itself, SIGKILLs its ranks 30 s after its
    own stop (torch 2.11's fixed shutdown timeout); llmctl stops the ranks instead, so the save
    completes and the run ends a saved stop (75), resumable from the step it stopped at."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    loss_file = tmp_path / "losses.jsonl"
    env = {**cli_env, "LLMCTL_LOSS_FILE": str(loss_file), "LLMCTL_CKPT_PAUSE_S": "40"}
    args = [*SMALL, "checkpoint.every=0", "parallel.dp_shard=2", "train.steps=100000", "checkpoint.preempt_grace_s=90"]
    proc = _start(["launch", *args], tmp_path, env)
    _wait_training(loss_file, proc, after=0)
    rid = _run_id(tmp_path)
    os.kill(proc.pid, signal.SIGTERM)  # what llmctl down sends
    out, said = proc.communicate(timeout=90 + 480)
    assert proc.returncode == RULES[Outcome.PREEMPTED].exit_code, out[-3000:] + said[-3000:]
    tags = assert_outcome(uri, rid, Outcome.PREEMPTED, proc.returncode, attempt=1)
    stopped = json.loads(tags["llmctl.preempted"])
    step = stopped["checkpoint"]
    assert step is not None and f"step-{step} written, pausing 40s" in out, out[-3000:]
    assert (tmp_path / "llmctl-runs" / rid / "checkpoints" / f"step-{step}" / ".complete").is_file()


def _serve(root: Path, port: int) -> subprocess.Popen[bytes]:
    """A real ``mlflow server`` on ``port`` (its own process group: the test kills all of it), on the
    same port again after a restart, so the run's tracking URI stays valid."""
    return start_mlflow_server(root, port)


@contextlib.contextmanager
def _servers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for proc in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_a_tracking_server_lost_mid_close_is_closed_later_to_the_jobs_end(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    """The server dies just as the controller starts closing a finished attempt: it says so (and how
    the run gets closed) and exits with the run's outcome; once the server is back, ``llmctl status``
    closes the run as the controller judged it, billed to when the job ended, not to when it looked."""
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    with _servers() as servers:
        servers.append(_serve(tmp_path / "server", port))
        env = {
            **with_faults(cli_env, LLMCTL_TEST_BEFORE_CLOSE=f"kill -s KILL -- -{servers[0].pid}"),
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",  # fail fast while the server is gone
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
        }
        out = run_cli(["launch", *SMALL, "train.steps=2", f"tracking.uri={uri}"], tmp_path, env)
        assert out.returncode == RULES[Outcome.FINISHED].exit_code, out.stderr[-3000:]
        rid = _run_id(tmp_path)
        assert f"`llmctl status {rid}` closes it once the tracking store is reachable" in out.stderr, out.stderr[-3000:]
        ended = json.loads((tmp_path / "llmctl-runs" / rid / "job_end.json").read_text())
        assert (ended["code"], ended["outcome"]) == (0, "finished")

        servers.append(_serve(tmp_path / "server", port))
        assert mlflow_client(uri).get_run(rid).info.status == "RUNNING"  # what the lost close left
        looked = time.time()
        status = run_cli(["status", rid, "--tracking-uri", uri], tmp_path, env)
        assert status.returncode == 0 and "run closed as FINISHED" in status.stdout, status.stdout + status.stderr
    run = mlflow_client(f"sqlite:///{tmp_path / 'server' / 'mlflow.db'}").get_run(rid)
    assert run.info.status == "FINISHED" and run.data.tags["llmctl.status"] == "finished"
    [attempt] = ledger.attempts(run.data.tags)
    assert attempt.end == pytest.approx(ended["time"], abs=1e-3) and attempt.end < looked  # the job's end
    assert run.info.end_time == int(ended["time"] * 1000)
    assert run.data.tags["llmctl.attempt.1.status"] == "finished"


@pytest.mark.slow
def test_a_stop_after_the_last_step_is_a_finished_run(cli_env: dict[str, str], tmp_path: Path) -> None:
    """benchmarks/chaos_resume.py's lost trial: SIGTERM once every step ran and the final checkpoint is
    committed. torchrun, signalled, exits 1 although its workers end 0; the workload's
    ``llmctl.completed`` fact (of this start) makes that FINISHED, exit 0, and ``resume`` finds
    nothing to resume."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**cli_env, "LLMCTL_EXIT_PAUSE_S": "600"}  # the workers linger after their work is done
    proc = _start(["launch", *SMALL, "train.steps=2", "parallel.dp_shard=2"], tmp_path, env)
    mc, deadline = None, time.monotonic() + 600
    while True:  # until the workload says it is done (checkpoint committed)
        assert proc.poll() is None and time.monotonic() < deadline, "the launch ended before its workers were done"
        if (tmp_path / "llmctl-runs").exists() and (tmp_path / "mlflow.db").exists():
            mc = mc or mlflow_client(uri)
            with contextlib.suppress(Exception):  # the run may not exist yet
                if "llmctl.completed" in mc.get_run(_run_id(tmp_path)).data.tags:
                    break
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)
    _, said = proc.communicate(timeout=300)
    assert proc.returncode == RULES[Outcome.FINISHED].exit_code, said[-3000:]
    rid = _run_id(tmp_path)
    tags = assert_outcome(uri, rid, Outcome.FINISHED, proc.returncode, attempt=1)
    assert tags["llmctl.status"].startswith("finished: all 2 steps (final checkpoint step-2)"), tags["llmctl.status"]
    again = run_cli(["resume", rid], tmp_path, cli_env)
    assert again.returncode == 3 and "nothing to resume" in again.stderr, again.stderr[-2000:]


@pytest.mark.slow
def test_an_unexpected_controller_error_closes_the_run_and_is_raised(cli_env: dict[str, str], tmp_path: Path) -> None:
    """An error in the controller mid-run (here injected as the workload prints its second step; in
    the field a cloud API's or the tracking server's): the workers are stopped, the attempt and the run
    are closed FAILED with the error named, and only then is it raised (traceback, exit 1)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = with_faults(cli_env, LLMCTL_TEST_RAISE_ON=" 2/100000 |")
    out = run_cli(["launch", *SMALL, "train.steps=100000"], tmp_path, env, timeout=600)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert "Traceback" in out.stderr and last.startswith("RuntimeError: injected fault"), out.stderr[-3000:]
    rid = _run_id(tmp_path)
    run = mlflow_client(uri).get_run(rid)
    assert run.info.status == "FAILED" and run.data.tags["llmctl.status"].startswith("failed: RuntimeError: injected")
    [attempt] = ledger.attempts(run.data.tags)
    assert attempt.end is not None and run.data.tags["llmctl.attempt.1.status"] == run.data.tags["llmctl.status"]
    workers = _workers(tmp_path / "llmctl-runs" / rid)
    assert not pid_alive(workers), "the workers outlived the controller's error"


def test_ctrl_c_while_the_run_opens_closes_it(cli_env: dict[str, str], tmp_path: Path) -> None:
    """Ctrl-C after the run exists and its attempt is open in the ledger, before its first line: the
    run is closed KILLED (interrupted), its attempt billed and closed, no worker started; not a run
    left RUNNING that ``llmctl status`` would bill to now forever."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = with_faults(cli_env, LLMCTL_TEST_CTRL_C_AFTER_OPEN="1")
    out = run_cli(["launch", *SMALL, "train.steps=2"], tmp_path, env, timeout=300)
    assert out.returncode == RULES[Outcome.INTERRUPTED].exit_code, out.stdout[-3000:] + out.stderr[-3000:]
    [run] = mlflow_client(uri).search_runs([mlflow_client(uri).get_experiment_by_name("llmctl").experiment_id])
    rid = run.info.run_id
    assert f"error: run {rid} interrupted; marked KILLED" in out.stderr
    tags = assert_outcome(uri, rid, Outcome.INTERRUPTED, out.returncode, attempt=1)
    assert tags["llmctl.status"] == "interrupted (Ctrl-C)"
    assert not (tmp_path / "llmctl-runs" / rid / "output.log").exists(), "no workload was started"
