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
from llmctl.run.outcomes import RULES, Outcome

ROOT = Path(__file__).resolve().parents[1]
# tests/inject/sitecustomize.py: the faults and traces tests ask of llmctl and the trainer, each armed
# by its variable alone (every subprocess environment the tests build has it on PYTHONPATH)
INJECT = ROOT / "tests" / "inject"


def with_injector(env: dict[str, str]) -> dict[str, str]:
    """``env`` (changed in place, and returned) with the fault injector first on ``PYTHONPATH``."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(INJECT), env.get("PYTHONPATH")) if p)
    return env


def cli_env_at(home: Path, cache_dir: Path) -> dict[str, str]:
    """The environment the real CLI runs in: this one without MLflow/llmctl settings, a private HOME
    (created here), the session's tokenizer cache, telemetry off. ``cli_env`` for one test; a module
    fixture that launches a run its tests share builds its own with this."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}
    env.update(
        {
            "LLMCTL_CACHE_DIR": str(cache_dir),
            "PYTHONUNBUFFERED": "1",
            "HOME": str(home),
            "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    home.mkdir(parents=True, exist_ok=True)
    return with_injector(env)


def loss_env(loss_file: Path, **extra: str) -> dict[str, str]:
    """A trainer's environment outside llmctl (none of this shell's MLflow/llmctl settings), its rank
    0's losses traced to ``loss_file`` at full precision (``LLMCTL_LOSS_FILE``, injected)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}
    return with_injector({**env, "PYTHONUNBUFFERED": "1", "LLMCTL_LOSS_FILE": str(loss_file), **extra})


def with_faults(env: Mapping[str, str], **faults: str) -> dict[str, str]:
    """``env`` with ``tests/inject/sitecustomize.py`` loaded at start-up and ``faults`` (its
    ``LLMCTL_TEST_*`` variables) armed: faults injected into the controller from the tests."""
    return with_injector({**env, **faults})


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


def start_mlflow_server(
    root: Path,
    port: int,
    *extra: str,
    env: Optional[Mapping[str, str]] = None,
    log: Any = subprocess.DEVNULL,
    startup_s: float = 300,
    host: str = "127.0.0.1",
) -> subprocess.Popen[bytes]:
    """A real ``mlflow server`` on ``host``:``port`` (sqlite store and proxied artifacts under ``root``),
    in a process group of its own, returned once healthy. The caller stops the group: uvicorn
    outlives the ``mlflow`` process on SIGTERM."""
    root.mkdir(parents=True, exist_ok=True)
    # MLflow 3's server also starts GenAI job consumers (huey workers: a Python start-up and ~250 MB
    # each) that nothing here uses; on a 2-core CI machine they compete with the tests for the CPU
    server_env = {**(env if env is not None else os.environ), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("mlflow")),
            "server",
            *extra,
            "--host",
            host,
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
        env=server_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + startup_s  # generous for a loaded machine; not a timing assertion
    while True:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                tail = (root / "server.log").read_text()[-3000:] if (root / "server.log").exists() else ""
                raise RuntimeError(f"mlflow server did not start: {tail}") from None
            time.sleep(0.5)


@contextlib.contextmanager
def mlflow_server(
    root: Path, *extra: str, env: Optional[Mapping[str, str]] = None, startup_s: float = 300, host: str = "127.0.0.1"
) -> Iterator[str]:
    """``start_mlflow_server`` on a free port for the ``with`` block, its log in ``root/server.log``;
    its whole process group is killed afterwards (they would pile up over a test session). ``host``:
    the address it listens on (one of ``netns_hosts``' gateways serves several hosts)."""
    log = open(root / "server.log", "wb")  # noqa: SIM115 - the server's stdout, for its lifetime
    try:
        port = free_port()
        proc = start_mlflow_server(root, port, *extra, env=env, log=log, startup_s=startup_s, host=host)
        try:
            yield f"http://{host}:{port}"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)  # a test's server owes nobody a graceful shutdown
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group's stragglers
    finally:
        log.close()


def mlflow_runs(tracking_uri: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exps = client.search_experiments()
    return client.search_runs([e.experiment_id for e in exps]) if exps else []


# ----------------------------------------------------------------- the outcome table (llmctl/run/outcomes.py)

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


def save_tiny_llama(path: Path) -> Path:
    """A tiny transformers Llama (vocab 128, 2 layers of 32) saved at ``path``, seed 0: what a user's
    own training script fine-tunes in the command-workload tests."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


PAIR_WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "dog",
    "ran",
    "far",
    "away",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
]


def write_pairs(path: Path, n: int = 64, seed: int = 0, long_prompt_at: int | None = None) -> Path:
    """``n`` text pairs whose chosen answer starts "yes" and ends "indeed", the rejected "no ... never":
    a preference a tiny model learns in a few steps."""
    import json
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = 60 if i + 1 == long_prompt_at else 6
        prompt = "Q: " + " ".join(rng.choice(PAIR_WORDS) for _ in range(words)) + "\nA:"
        answer = " ".join(rng.choice(PAIR_WORDS) for _ in range(5))
        rows.append({"prompt": prompt, "chosen": f" yes {answer} indeed", "rejected": f" no {answer} never"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Hook:
    """The messages each path of a ``webhook_server`` received, in order."""

    def __init__(self) -> None:
        import threading

        self.received: dict[str, list[dict[str, Any]]] = {}
        self.lock = threading.Lock()

    def at(self, path: str) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.received.get(path, []))


@contextlib.contextmanager
def webhook_server() -> Iterator[tuple[Hook, str]]:
    """A JSON webhook endpoint on 127.0.0.1 (``notify.url``'s receiver): what it got, and its base URL."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = Hook()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with seen.lock:
                seen.received.setdefault(self.path, []).append(body)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield seen, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
