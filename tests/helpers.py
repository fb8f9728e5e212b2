"""Helpers the tests import: the real CLI in a subprocess, reading a real MLflow store, and checking a
run against the outcome table."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import pytest

from llmctl.cost import ledger
from llmctl.run.lifecycle import RULES, Outcome

ROOT = Path(__file__).resolve().parents[1]


def run_cli(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess, exactly as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "llmctl", *args],
        cwd=cwd,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
        **kwargs,
    )


def pip_target(target: Path, *requirements: str) -> subprocess.CompletedProcess[str]:
    """``pip install --no-deps --target``: packages the venv must not hold (pins that clash with it,
    or heavy dependency trees a test does not import), for a test to put first on ``sys.path``."""
    return subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *requirements],
        capture_output=True,
        text=True,
        timeout=900,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(
    root: Path, *extra: str, env: Optional[Mapping[str, str]] = None, startup_s: float = 300
) -> Iterator[str]:
    """A real ``mlflow server`` on 127.0.0.1 (sqlite store and proxied artifacts under ``root``), healthy
    before it is yielded. Its whole process group is killed afterwards: uvicorn and MLflow's job
    consumers outlive the ``mlflow`` process on SIGTERM and would pile up over a test session."""
    port = free_port()
    log = open(root / "server.log", "wb")  # noqa: SIM115 - the server's stdout, for its lifetime
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("mlflow")),
            "server",
            *extra,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
        ],
        cwd=root,
        env=dict(env) if env is not None else None,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s  # generous for a loaded machine; not a timing assertion
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log_tail = (root / "server.log").read_text()[-3000:]
                    raise RuntimeError(f"mlflow server did not start: {log_tail}") from None
                time.sleep(0.5)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)  # a test's server owes nobody a graceful shutdown
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group's stragglers
        log.close()


def mlflow_runs(tracking_uri: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exps = client.search_experiments()
    return client.search_runs([e.experiment_id for e in exps]) if exps else []


# ----------------------------------------------------------------- the outcome table (llmctl/run/lifecycle.py)

STATUS_PREFIX = {
    Outcome.FINISHED: "finished",
    Outcome.BUDGET_STOP: "stopped: budget $",
    Outcome.PREEMPTED: "preempted at step ",
    Outcome.INTERRUPTED: "interrupted",
    Outcome.KILLED: "killed: SIGTERM",
    Outcome.FAILED: "workload exited with code",
}


def mlflow_client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def assert_outcome(uri: str, run_id: str, outcome: Outcome, exit_code: int, attempt: int) -> dict[str, str]:
    """The run as the table says, after attempt ``attempt`` ended with ``outcome``; returns its tags."""
    mc = mlflow_client(uri)
    run = mc.get_run(run_id)
    rule, tags = RULES[outcome], run.data.tags
    assert (run.info.status, exit_code) == (rule.mlflow_status, rule.exit_code), (outcome, tags.get("llmctl.status"))
    assert tags["llmctl.status"].startswith(STATUS_PREFIX[outcome]), tags["llmctl.status"]
    rows = ledger.attempts(tags)
    assert [a.n for a in rows] == list(range(1, attempt + 1)) and tags["llmctl.attempt"] == str(attempt)
    assert all(a.end is not None and a.end >= a.start for a in rows), "every attempt is closed"
    assert tags[f"llmctl.attempt.{attempt}.status"] == tags["llmctl.status"][:500]
    billed = sum((a.end - a.start) / 3600 * a.usd_per_hour for a in rows)
    assert float(tags["cost/actual_usd"]) == pytest.approx(billed, rel=1e-6, abs=1e-9)  # a tag: one value, no chart
    assert float(tags["cost/attempts"]) == attempt
    return tags


def controller_codes(tmp: Path, sweep_id: str) -> dict[int, int]:
    """Each trial controller's exit code, as the supervisor logged it ("trial 2 FINISHED (controller exit 4)")."""
    log = (tmp / "llmctl-runs" / "sweeps" / sweep_id / "supervisor.log").read_text()
    return {int(i): int(c) for i, c in re.findall(r"trial (\d+) \w+ \(controller exit (-?\d+)\)", log)}


def read_loss_file(path: Path) -> dict[str, dict[int, float]]:
    """{'train': {step: loss}, 'val': {step: loss}} at full precision from ``$LLMCTL_LOSS_FILE``."""
    import json

    out: dict[str, dict[int, float]] = {"train": {}, "val": {}}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        kind = "train" if "train/loss" in rec else "val"
        out[kind][rec["step"]] = rec[f"{kind}/loss"]
    return out
