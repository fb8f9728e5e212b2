"""``status``, ``logs`` and ``down`` by MLflow run id for local runs, and ``runs`` of a resumed one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import cli_env_at, mlflow_runs, run_cli

pytestmark = pytest.mark.slow

TINY = ["experiment=smoke", "train.steps=4", "train.val_every=4", "train.log_every=2", "checkpoint.every=0"]
RESUMED = [
    "experiment=smoke",
    "train.steps=2",
    "train.log_every=1",
    "train.val_every=1000",
    "checkpoint.every=2",
    "train.val_batches=1",
]


@pytest.fixture(scope="module")
def resumed(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run launched to step 2 and resumed to step 4 (a finished run with two attempts), shared by
    the tests that only read it: {cwd, env, run_id, resume (the resume's output)}."""
    cwd = tmp_path_factory.mktemp("runs-local")
    env = cli_env_at(cwd / "home", cache_dir)
    launched = run_cli(["launch", *RESUMED], cwd, env)
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    (run,) = mlflow_runs(f"sqlite:///{cwd / 'mlflow.db'}")
    rid = run.info.run_id
    out = run_cli(["resume", rid, "train.steps=4"], cwd, env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return {"cwd": cwd, "env": env, "run_id": rid, "resume": out}


def test_status_and_logs_of_a_finished_run(resumed: dict[str, Any]) -> None:
    cwd, env = resumed["cwd"], resumed["env"]
    (run,) = mlflow_runs(f"sqlite:///{cwd / 'mlflow.db'}")
    assert run.info.run_id == resumed["run_id"] and run.info.status == "FINISHED"
    out = run_cli(["status", run.info.run_id], cwd, env)
    assert out.returncode == 0 and "FINISHED" in out.stdout and "exited" in out.stdout, out.stdout + out.stderr
    assert run.info.run_id in run_cli(["status"], cwd, env).stdout
    logs = run_cli(["logs", run.info.run_id], cwd, env)
    assert logs.returncode == 0 and "step" in logs.stdout
    missing = run_cli(["logs", "nosuchrun"], cwd, env)
    assert missing.returncode == 3 and "no run 'nosuchrun'" in missing.stderr


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def test_down_stops_a_running_local_run(cli_env: dict[str, str], tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmctl", "launch", *TINY, "train.steps=100000"],
        cwd=tmp_path,
        env=cli_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        pids_file = None
        while time.monotonic() < deadline and pids_file is None:
            found = list((tmp_path / "llmctl-runs").glob("*/pids.json")) if (tmp_path / "llmctl-runs").exists() else []
            pids_file = found[0] if found else None
            time.sleep(0.5)
        assert pids_file is not None, "the run started"
        run_id = pids_file.parent.name
        # down once training runs: a stop while the workers still import torch, before they can save,
        # is a stop without a checkpoint (exit 143), truthfully, and not what this test is about
        log = pids_file.parent / "output.log"
        while time.monotonic() < deadline and not re.search(r"^step +\d+/", _text(log), re.M):
            time.sleep(0.5)
        assert re.search(r"^step +\d+/", _text(log), re.M), _text(log)[-2000:]
        workers = json.loads(pids_file.read_text())["workers"]
        assert "alive" in run_cli(["status", run_id], tmp_path, cli_env).stdout
        out = run_cli(["down", run_id], tmp_path, cli_env)
        assert out.returncode == 0, out.stderr
        _, said = proc.communicate(timeout=60)
        with pytest.raises(ProcessLookupError):
            os.killpg(workers, 0)
        (run,) = mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
        assert run.info.status == "KILLED"
        # the launching terminal: the stop the user asked for, as information (exit 75: not finished, resumable)
        assert proc.returncode == 75, said
        assert f"llmctl: run {run_id} stopped by llmctl down at step " in said, said
        assert f"resume with: llmctl resume {run_id}" in said and "error:" not in said and "preempted" not in said
        assert run.data.tags["llmctl.status"].startswith("stopped by llmctl down at step ")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_runs_shows_the_steps_of_a_resumed_run(resumed: dict[str, Any]) -> None:
    """Resumed from step 2 to 4, the table says 4/4: the steps done and ``train.steps`` of the newest
    attempt, not the first attempt's (MLflow keeps the launch's params)."""
    cwd, env, rid, out = resumed["cwd"], resumed["env"], resumed["run_id"], resumed["resume"]
    assert "from step 2" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    listed = run_cli(["runs", "--json"], cwd, env)
    (row,) = json.loads(listed.stdout)
    assert (row["run_id"], row["steps"], row["steps_target"], row["attempts"]) == (rid, 4, 4, 2), row
    table = run_cli(["runs"], cwd, env).stdout
    assert " 4/4 " in next(line for line in table.splitlines() if rid[:12] in line), table


def test_resume_onto_bad_data_is_refused_and_leaves_the_run_as_it_was(resumed: dict[str, Any]) -> None:
    """The data preflight runs at resume too (llmctl.plan.data_check): refused before attempt 3 exists."""
    cwd, env, rid = resumed["cwd"], resumed["env"], resumed["run_id"]
    bad = cwd / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)) + '{"text": "cut short\n')
    out = run_cli(["resume", rid, "train.steps=6", "data=files", f"data.source={bad}"], cwd, env)
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
    said = out.stderr.strip()
    assert said.startswith(f"error: {bad}:6: not JSON (") and said.endswith("Fix: one JSON object per line"), said
    (run,) = mlflow_runs(f"sqlite:///{cwd / 'mlflow.db'}")
    assert run.info.status == "FINISHED" and run.data.tags["llmctl.attempt"] == "2"
