"""``notify.*`` through the real CLI: a webhook server on 127.0.0.1 (this test's own) receives one
message per event, for a run that finishes, one that fails, one its budget stops and a sweep; a dead
endpoint is reported once and the run goes on; the URL's secret path reaches no record.

The runs are ``workload=command`` programs (``programs/steps.py``): the events are the lifecycle's,
the same for the bundled trainer, and these start in a second, not twenty.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any, Iterator

import pytest
from helpers import Hook, mlflow_client, mlflow_runs, run_cli, webhook_server

pytestmark = pytest.mark.slow

PROGRAMS = Path(__file__).with_name("programs")
FACTS = {"event", "run_id", "run_name", "attempt", "page", "spend_usd"}


@pytest.fixture(scope="module")
def hook() -> Iterator[tuple[Hook, str]]:
    with webhook_server() as served:
        yield served


def _steps_here(tmp_path: Path) -> Path:
    shutil.copy(PROGRAMS / "steps.py", tmp_path / "steps.py")
    return tmp_path


def _events(messages: list[dict[str, Any]]) -> list[str]:
    return [m["llmctl"]["event"] for m in messages]


def _dead_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then closed: connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_finished_run_tells_its_start_and_end_and_a_dead_endpoint_once(
    hook: tuple[Hook, str], cli_env: dict[str, str], tmp_path: Path
) -> None:
    """Two events to two endpoints: the live one gets both, with the run's id, page and spend and no
    config value; the dead one is reported once (not per event) and the run finishes all the same.
    Its URL's path (a webhook's token) is nowhere in the run's params, tags, config.yaml or log."""
    seen, base = hook
    token = "T0-B0-sekret-token-4c1d"
    dead = f"http://127.0.0.1:{_dead_port()}/{token}"
    out = run_cli(
        [
            "launch",
            "workload=command",
            "workload.run=python steps.py --steps 3 --step_s 0.05",
            f"notify.url=[{dead},{base}/finished/{token}]",
            "notify.on=[started,finished]",
        ],
        _steps_here(tmp_path),
        cli_env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [run] = mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    rid = run.info.run_id
    messages = seen.at(f"/finished/{token}")
    assert _events(messages) == ["started", "finished"]
    for m in messages:
        assert set(m["llmctl"]) == FACTS and m["llmctl"]["run_id"] == rid and rid in m["llmctl"]["page"]
        assert token not in m["text"]
    started, finished = messages
    assert f"run {rid}" in started["text"] and started["llmctl"]["attempt"] == 1
    assert f"run {rid} FINISHED" in finished["text"] and finished["llmctl"]["spend_usd"] == 0.0
    failures = [line for line in out.stderr.splitlines() if "notification to" in line]
    assert len(failures) == 1 and f"127.0.0.1:{dead.split(':')[2].split('/')[0]}/…" in failures[0], out.stderr
    assert "ConnectionRefusedError" in failures[0]
    assert token not in out.stdout + out.stderr
    mc = mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    recorded = json.dumps([run.data.params, run.data.tags])
    config = Path(mc.download_artifacts(rid, "config.yaml", str(tmp_path / "art"))).read_text()
    log = (tmp_path / "llmctl-runs" / rid / "output.log").read_text()
    assert token not in recorded + config + log
    assert "127.0.0.1" in run.data.params["notify.url"]  # recorded, as its host


def test_a_failed_run_and_a_budget_stop_tell_by_default(
    hook: tuple[Hook, str], cli_env: dict[str, str], tmp_path: Path
) -> None:
    """The default ``notify.on``: no start message; a program that exits 3 is ``failed``; a program
    stopped by ``--max-cost`` ($3,600/h: $1/s; the guard keeps its grace and reserve, so ~23 s in, as in
    test_command_workload's budget test: time for the program to start on a loaded machine) is
    ``budget_stop``, saying so."""
    seen, base = hook
    (tmp_path / "fail.py").write_text("import sys\nprint('program | giving up', flush=True)\nsys.exit(3)\n")
    failed = run_cli(
        ["launch", "workload=command", "workload.run=python fail.py", f"notify.url=[{base}/failed]"],
        _steps_here(tmp_path),
        cli_env,
    )
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    [message] = seen.at("/failed")
    assert message["llmctl"]["event"] == "failed" and "FAILED" in message["text"]

    stopped = run_cli(
        [
            "launch",
            "--max-cost",
            "30",
            "workload=command",
            "workload.run=python steps.py --steps 400 --step_s 0.2",
            "infra.price_per_gpu_hour=3600",
            "checkpoint.preempt_grace_s=1",
            "tracking.experiment=budget",
            f"notify.url=[{base}/budget]",
        ],
        tmp_path,
        cli_env,
    )
    assert stopped.returncode == 4, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    [message] = seen.at("/budget")
    assert message["llmctl"]["event"] == "budget_stop" and "stopped: budget $30.00 reached" in message["text"]
    run = next(
        r for r in mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}") if r.info.run_id == message["llmctl"]["run_id"]
    )
    assert message["llmctl"]["spend_usd"] == float(run.data.tags["cost/actual_usd"]) > 0  # the ledger's figure


def test_a_sweep_tells_its_end_once_and_its_trials_nothing(
    hook: tuple[Hook, str], cli_env: dict[str, str], tmp_path: Path
) -> None:
    """Two trials, one ``sweep_end`` message (the URL from a variable, as a webhook's should be), with
    the sweep's id and parent run; the trials' own ends are the sweep's to tell."""
    seen, base = hook
    env = {**cli_env, "TEAM_WEBHOOK": f"{base}/sweep"}
    out = run_cli(
        [
            "launch",
            "-m",
            "--wait",
            "workload=command",
            "workload.run=python steps.py --steps 2 --step_s 0.05",
            "workload.args.lr=0.1,0.2",
            "notify.url=[TEAM_WEBHOOK]",
        ],
        _steps_here(tmp_path),
        env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [message] = seen.at("/sweep")
    facts = message["llmctl"]
    assert facts["event"] == "sweep_end" and facts["outcome"] == "finished" and facts["sweep_id"] in message["text"]
    runs = mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert facts["run_id"] in {r.info.run_id for r in runs} and len(runs) == 3
    assert all(base not in json.dumps(r.data.params) for r in runs)  # the variable's name is what is recorded
    assert {r.data.params.get("notify.url") for r in runs} - {None} == {"['TEAM_WEBHOOK']"}


@pytest.mark.parametrize(
    "override, says",
    [
        ("notify.on=[finished,exploded]", "'notify.on': exploded"),
        ("notify.url=[ftp://example.invalid/x]", "'notify.url': 'ftp://example.invalid/x' is neither"),
        ("notify.url=[NOT_SET_ANYWHERE]", "'notify.url': NOT_SET_ANYWHERE is not set"),
        ("notify.timeout_s=0", "'notify.timeout_s': 0"),
        ("notify.url=https://h.example/x", "a list is expected. Fix: notify.url=[https://h.example/x]"),
    ],
)
def test_bad_notify_settings_are_refused_before_anything_exists(
    override: str, says: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    out = run_cli(["launch", "model=tiny", override], tmp_path, cli_env)
    assert out.returncode == 3 and says in out.stderr and "Fix:" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "mlflow.db").exists()
