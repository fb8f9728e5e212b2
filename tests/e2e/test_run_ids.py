"""Run ids as llmctl prints them, and ``llmctl down`` of a run whose pid is no longer its own.

Real parts: the CLI in subprocesses against a real sqlite MLflow store, and real live processes
standing in for whatever the OS gave a run's recorded pid to. No torchrun: the runs are created
in the store directly, as launch leaves them (a FINISHED run, a RUNNING run whose controller died).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import mlflow_client, run_cli

from llmctl.controller.procs import start_time


def _store(tmp: Path) -> tuple[str, Any, str]:
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    mc = mlflow_client(uri)
    return uri, mc, mc.create_experiment("ids")


def _run(mc: Any, exp: str, status: str = "FINISHED") -> str:
    rid = mc.create_run(exp, tags={"llmctl.status": status.lower()}).info.run_id
    if status != "RUNNING":
        mc.set_terminated(rid, status)
    return rid


def _rename(db: Path, old: str, new: str) -> None:
    """Give a run the id ``new``: MLflow's ids are random, and a shared prefix is what is tested."""
    with sqlite3.connect(db) as con:
        for table in ("runs", "tags"):
            con.execute(f"UPDATE {table} SET run_uuid = ? WHERE run_uuid = ?", (new, old))


def _sleeper() -> subprocess.Popen[bytes]:
    """An unrelated live python process: what now holds a pid the run once recorded."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def _record_pids(tmp: Path, rid: str, pids: dict[str, int]) -> None:
    rdir = tmp / "llmctl-runs" / rid
    rdir.mkdir(parents=True, exist_ok=True)
    (rdir / "pids.json").write_text(json.dumps(pids))


def test_every_command_takes_the_short_id_the_tables_print(cli_env: dict[str, str], tmp_path: Path) -> None:
    uri, mc, exp = _store(tmp_path)
    rid = _run(mc, exp)
    other = _run(mc, exp)
    short = rid[:12]  # as `llmctl runs`, plan's "measured: run ..." and the sweep table print it
    if other.startswith(short):
        pytest.skip("two random ids share 12 characters")
    (tmp_path / "llmctl-runs" / rid).mkdir(parents=True)
    (tmp_path / "llmctl-runs" / rid / "output.log").write_text("step 1/1 | loss 1.0\n")

    status = run_cli(["status", short], tmp_path, cli_env)
    assert status.returncode == 0 and f"run:         {rid} " in status.stdout, status.stdout + status.stderr
    logs = run_cli(["logs", short], tmp_path, cli_env)
    assert logs.returncode == 0 and "step 1/1" in logs.stdout, logs.stderr
    # resume, eval and export find the run (then stop at what the bare run lacks, naming its full id)
    for args in (["resume", short], ["eval", short], ["export", short]):
        out = run_cli(args, tmp_path, cli_env)
        assert out.returncode == 3 and f"run {rid} has no config.yaml" in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr


def test_an_ambiguous_or_unknown_id_is_refused_with_what_to_do(cli_env: dict[str, str], tmp_path: Path) -> None:
    uri, mc, exp = _store(tmp_path)
    a, b = _run(mc, exp), _run(mc, exp)
    _rename(tmp_path / "mlflow.db", a, "abcd1" + a[5:])
    _rename(tmp_path / "mlflow.db", b, "abcd2" + b[5:])

    for cmd in ("status", "down"):
        out = run_cli([cmd, "abcd"], tmp_path, cli_env)
        assert out.returncode == 3, (cmd, out.stdout, out.stderr)
        assert "ambiguous" in out.stderr and "abcd1" + a[5:] in out.stderr and "abcd2" + b[5:] in out.stderr
        assert "Traceback" not in out.stderr
    assert run_cli(["status", "abcd2"], tmp_path, cli_env).returncode == 0  # one more character: unique

    unknown = run_cli(["down", "ffff0000"], tmp_path, cli_env)
    assert unknown.returncode == 3 and "no run 'ffff0000'" in unknown.stderr and "llmctl runs" in unknown.stderr
    assert "Traceback" not in unknown.stderr


def test_down_of_a_finished_run_leaves_the_process_that_now_has_its_pid(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    uri, mc, exp = _store(tmp_path)
    rid = _run(mc, exp, "FINISHED")
    other = _sleeper()
    try:
        # the pid reused, and even its start time matching: an ended run is never signalled
        _record_pids(
            tmp_path,
            rid,
            {
                "controller": other.pid,
                "workers": other.pid,
                "controller_start": start_time(other.pid),
                "workers_start": start_time(other.pid),
            },
        )
        out = run_cli(["down", rid], tmp_path, cli_env)
        assert other.poll() is None, "the unrelated process was left alone"
        assert out.returncode == 0, out.stderr
        assert f"run {rid} has already ended: FINISHED" in out.stdout, out.stdout
        assert "stopped" not in out.stdout
        assert mc.get_run(rid).info.status == "FINISHED"
    finally:
        other.kill()
        other.wait()


def test_down_of_a_running_run_signals_only_its_own_process(cli_env: dict[str, str], tmp_path: Path) -> None:
    """A RUNNING run whose controller died: its recorded pid, now another process's (another start
    time), is left alone and the run is closed; the same pid with the recorded start time is stopped."""
    uri, mc, exp = _store(tmp_path)
    rid = _run(mc, exp, "RUNNING")
    other = _sleeper()
    try:
        _record_pids(tmp_path, rid, {"controller": other.pid, "controller_start": start_time(other.pid) - 1})
        out = run_cli(["down", rid], tmp_path, cli_env)
        assert out.returncode == 0 and "nothing to stop" in out.stdout, out.stdout + out.stderr
        assert other.poll() is None, "a process that is not the run's survived"
        assert mc.get_run(rid).info.status == "KILLED"  # nobody runs it: closed

        mine = _run(mc, exp, "RUNNING")
        _record_pids(tmp_path, mine, {"controller": other.pid, "controller_start": start_time(other.pid)})
        out = run_cli(["down", mine], tmp_path, cli_env)
        assert out.returncode == 0 and f"run {mine} stopped" in out.stdout, out.stdout + out.stderr
        assert other.wait(timeout=30) == -15  # SIGTERM: the process the run recorded was stopped
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
