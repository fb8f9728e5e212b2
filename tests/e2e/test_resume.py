"""``llmctl resume`` end to end: real torchrun (2 gloo ranks), real sqlite MLflow, real moto S3.

One uninterrupted reference run is shared by the module; each scenario stops a run (SIGTERM to
the workers as a spot reclaim does, ``llmctl down``, or SIGKILL in the middle of a checkpoint
write), resumes it with ``llmctl resume`` and compares the per-step fp32 losses with the reference.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from helpers import cli_env_at, mlflow_runs, run_cli

pytestmark = pytest.mark.slow

STEPS = 30
RUN = [
    "experiment=smoke",
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.val_every=15",
    "checkpoint.every=5",
    "parallel.dp_shard=2",
]
WORKLOAD_METRICS = ("train/loss", "train/lr", "train/grad_norm", "val/loss", "perf/tokens_per_s")


def _env(base: dict[str, str], loss_file: Path) -> dict[str, str]:
    return {**base, "LLMCTL_LOSS_FILE": str(loss_file)}


def _losses(path: Path) -> dict[int, float]:
    """Train loss per step; a step recomputed after a resume keeps its last value."""
    out: dict[int, float] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "train/loss" in rec:
            out[rec["step"]] = rec["train/loss"]
    return out


def _assert_same_losses(got: dict[int, float], ref: dict[int, float], tol: float = 1e-6) -> None:
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - ref[s]) for s in ref)
    assert worst <= tol, {s: (got[s], ref[s]) for s in ref if abs(got[s] - ref[s]) > tol}


@pytest.fixture(scope="module")
def base_env(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return cli_env_at(tmp_path_factory.mktemp("home"), cache_dir)


@pytest.fixture(scope="module")
def reference_run(base_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The uninterrupted run: where it was launched from (its store and run directory) and its id."""
    tmp = tmp_path_factory.mktemp("reference")
    out = run_cli(["launch", *RUN], tmp, _env(base_env, tmp / "losses.jsonl"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (run,) = mlflow_runs(f"sqlite:///{tmp / 'mlflow.db'}")
    return tmp, run.info.run_id


@pytest.fixture(scope="module")
def reference(reference_run: tuple[Path, str]) -> dict[int, float]:
    """Its per-step train losses, what every resumed run must reproduce."""
    return _losses(reference_run[0] / "losses.jsonl")


def _start(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "llmctl", "launch", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _wait_for_step(loss_file: Path, step: int, proc: subprocess.Popen[str], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it was interrupted"
        if loss_file.exists() and any(s >= step for s in _losses(loss_file)):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def _pids(cwd: Path) -> tuple[str, dict[str, int]]:
    (rdir,) = list((cwd / "llmctl-runs").iterdir())
    return rdir.name, json.loads((rdir / "pids.json").read_text())


def _signal_job(pgid: int, sig: int) -> None:
    """The whole job, as a node's shutdown does: torchrun and its workers (each in its own session)."""
    kids = subprocess.run(["pgrep", "-P", str(pgid)], capture_output=True, text=True).stdout.split()
    for pid in [pgid, *map(int, kids)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def moto_s3():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield {
        "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    server.stop()


def _run(uri: str, run_id: str):
    return next(r for r in mlflow_runs(uri) if r.info.run_id == run_id)


def _assert_one_run_two_attempts(uri: str, run_id: str, world_sizes: tuple[str, str] = ("2", "2")) -> None:
    from mlflow.tracking import MlflowClient

    (run,) = mlflow_runs(uri)  # never a second run
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["llmctl.attempt"] == "2"
    assert tags["llmctl.attempt.1.status"].startswith(("preempted", "workload exited")), tags["llmctl.attempt.1.status"]
    assert tags["llmctl.attempt.2.status"] == "finished"
    assert (tags["llmctl.attempt.1.world_size"], tags["llmctl.attempt.2.world_size"]) == world_sizes
    for n in (1, 2):
        assert datetime.fromisoformat(tags[f"llmctl.attempt.{n}.end"]) >= datetime.fromisoformat(
            tags[f"llmctl.attempt.{n}.start"]
        )
    mc = MlflowClient(tracking_uri=uri)
    for key in WORKLOAD_METRICS:
        steps = [m.step for m in mc.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), (key, sorted(steps))  # no step logged twice
    assert sorted(m.step for m in mc.get_metric_history(run_id, "train/loss")) == list(range(1, STEPS + 1))
    assert sorted(m.step for m in mc.get_metric_history(run_id, "val/loss")) == [0, 15, 30]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigterm_at_a_random_step_then_resume_is_exact(seed: int, reference, base_env, tmp_path: Path) -> None:
    at = random.Random(seed).randint(2, 8)  # early: `llmctl down` itself takes a few steps' time
    loss_file = tmp_path / "losses.jsonl"
    env = _env(base_env, loss_file)
    proc = _start(RUN, tmp_path, env)
    _wait_for_step(loss_file, at, proc)
    run_id, pids = _pids(tmp_path)
    if seed == 0:  # what `llmctl down` sends: SIGTERM to the controller, which passes it on
        os.kill(pids["controller"], signal.SIGTERM)  # (`llmctl down` itself needs seconds to start)
    else:  # a spot reclaim: SIGTERM to every process of the job
        _signal_job(pids["workers"], signal.SIGTERM)
    # a hang guard, as those below: closing under CI's load takes a minute and more
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 75, out[-2000:] + err[-2000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = _run(uri, run_id)
    status = run.data.tags["llmctl.status"]
    assert run.info.status == "KILLED" and status.startswith("preempted at step ")
    assert f"resume with: llmctl resume {run_id}" in status
    stopped = json.loads(run.data.tags["llmctl.preempted"])
    assert stopped["saved"] or stopped["checkpoint"] == stopped["step"]  # emergency save (or a regular one)

    res = run_cli(["resume", run_id], tmp_path, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"from step {stopped['step']}" in res.stdout
    assert f"resumed from step {stopped['step']}" in res.stdout
    _assert_same_losses(_losses(loss_file), reference)
    _assert_one_run_two_attempts(uri, run_id)
    if seed == 0:  # `logs` shows where each attempt starts (issue #34, item 10)
        shown = run_cli(["logs", run_id], tmp_path, env).stdout
        heads = [ln for ln in shown.splitlines() if ln.startswith("== attempt ")]
        assert [h.split()[2] for h in heads] == ["1", "2"], shown[-3000:]
        first, second = shown.split(heads[1])
        assert "step" in first and f"resumed from step {stopped['step']}" in second, shown[-3000:]


def test_sigkill_during_a_checkpoint_write_resumes_from_the_previous_one(reference, base_env, tmp_path: Path) -> None:
    loss_file = tmp_path / "losses.jsonl"
    env = _env(base_env, loss_file)
    # Every commit pauses, step-5's too, so the pause is paid once in full before step-10's. It only
    # has to outlast what follows the "step-10 written" line here: the controller passing the line on,
    # this loop reading it, a pgrep and a kill, a few process wake-ups. The asserts after the kill
    # (step-10 written, not marked) say so if it ever did not.
    proc = _start(RUN, tmp_path, {**env, "LLMCTL_CKPT_PAUSE_S": "15"})
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    for line in proc.stdout:  # step-5 is committed after its pause; kill inside step-10's
        if "step-10 written, pausing" in line or time.monotonic() > deadline:
            break
    run_id, pids = _pids(tmp_path)
    ckpts = tmp_path / "llmctl-runs" / run_id / "checkpoints"
    assert (ckpts / "step-5" / ".complete").exists()
    _signal_job(pids["workers"], signal.SIGKILL)  # a dead node: no warning
    proc.communicate(timeout=600)
    assert proc.returncode == 1
    assert (ckpts / "step-10" / ".metadata").exists() and not (ckpts / "step-10" / ".complete").exists()

    res = run_cli(["resume", run_id], tmp_path, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "resumed from step 5" in res.stdout
    got = _losses(loss_file)
    assert got[STEPS] == reference[STEPS]
    _assert_same_losses(got, reference)
    _assert_one_run_two_attempts(f"sqlite:///{tmp_path / 'mlflow.db'}", run_id)


def test_resume_from_s3_on_one_process(reference, base_env, moto_s3, tmp_path: Path) -> None:
    import s3fs

    os.environ.update(moto_s3)
    try:
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("resume-s3")
    finally:
        for k in moto_s3:
            os.environ.pop(k, None)
    loss_file = tmp_path / "losses.jsonl"
    env = {**_env(base_env, loss_file), **moto_s3}
    proc = _start([*RUN, "checkpoint.dir=s3://resume-s3/run"], tmp_path, env)
    _wait_for_step(loss_file, 7, proc)
    run_id, pids = _pids(tmp_path)
    _signal_job(pids["workers"], signal.SIGTERM)
    proc.communicate(timeout=600)
    assert proc.returncode == 75
    res = run_cli(["resume", run_id, "parallel.dp_shard=1"], tmp_path, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "1 process(es)" in res.stdout and "s3://resume-s3/run" in res.stdout
    _assert_same_losses(_losses(loss_file), reference)
    _assert_one_run_two_attempts(f"sqlite:///{tmp_path / 'mlflow.db'}", run_id, ("2", "1"))


def test_resume_refuses_bad_overrides_and_finished_runs(reference_run: tuple[Path, str], base_env) -> None:
    # the reference run: finished, and each refusal must leave it as it was (checked last)
    cwd, rid = reference_run
    bad = run_cli(["resume", rid, "train.lrr=1"], cwd, base_env)
    assert bad.returncode == 3 and "train.lrr" in bad.stderr, bad.stderr
    typed = run_cli(["resume", rid, "train.steps=abc"], cwd, base_env)
    assert typed.returncode == 3 and "train.steps" in typed.stderr, typed.stderr
    done = run_cli(["resume", rid], cwd, base_env)
    assert done.returncode == 3 and "train.steps=<N>" in done.stderr, done.stderr
    model = run_cli(["resume", rid, "model=smoke"], cwd, base_env)
    assert model.returncode == 3 and "keeps its model" in model.stderr
    assert run_cli(["resume", "nosuchrun"], cwd, base_env).returncode == 3
    (run,) = mlflow_runs(f"sqlite:///{cwd / 'mlflow.db'}")  # untouched by the refusals
    assert run.info.status == "FINISHED" and run.data.tags["llmctl.attempt"] == "1"
