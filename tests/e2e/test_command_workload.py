"""``workload=command``: programs nobody here wrote, run through the real CLI under llmctl's plan,
tracking, cost, sweeps and recovery (``workloads/command``, docs/workloads.md).

- a transformers ``Trainer`` script (``programs/hf_trainer.py``, a tiny Llama made here,
  ``report_to=["mlflow"]``): its losses land in llmctl's run (the only run in the experiment); a
  stop (``llmctl down``: SIGTERM) makes it save and exit 75, the run is KILLED as preempted, and
  ``llmctl resume`` continues it from its own checkpoint (``resume_from_checkpoint``) in the same
  run: every training step is logged exactly once across the two attempts;
- a plain torchrun DDP loop on 2 gloo processes (``programs/ddp.py``);
- the budget guard: SIGTERM before ``--max-cost`` is passed, exit 4, the ledger summing to
  ``cost/actual_usd`` (``programs/steps.py``);
- a 2-trial grid and a 2-trial TPE search over the script's ``--learning_rate``, one parent run each
  (and the same script as a managed job on the localhost Slurm cluster, recovered after ``scancel``:
  tests/sky/test_slurm_launch.py);
- bad input: one line naming the key, exit 3, nothing created.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_outcome, mlflow_client, mlflow_runs, run_cli, save_tiny_llama

from llmctl.cost import ledger
from llmctl.run.outcomes import Outcome

pytestmark = pytest.mark.slow

PROGRAMS = Path(__file__).with_name("programs")
ROOT = Path(__file__).resolve().parents[2]


def _here(tmp_path: Path, *names: str) -> Path:
    """The programs a user keeps in the directory they launch from."""
    for name in names:
        shutil.copy(PROGRAMS / name, tmp_path / name)
    return tmp_path


def _the_run(tmp_path: Path):
    runs = mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert len(runs) == 1, [(r.info.run_id, r.info.run_name) for r in runs]  # one run per job, not two
    return runs[0]


def _steps(uri: str, run_id: str, key: str) -> list[int]:
    points = sorted(mlflow_client(uri).get_metric_history(run_id, key), key=lambda m: (m.timestamp, m.step))
    return [m.step for m in points]


@pytest.fixture()
def tiny_llama(tmp_path: Path) -> Path:
    return save_tiny_llama(tmp_path / "tiny")


def _launch(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """``llmctl ARGS`` running in the background, its stdout and stderr in one pipe, as a terminal shows them."""
    return subprocess.Popen(
        [sys.executable, "-m", "llmctl", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("stop", ["down", "ctrl-c"])
def test_a_transformers_trainer_script_is_tracked_stopped_and_resumed_in_one_run(
    cli_env: dict[str, str], tmp_path: Path, tiny_llama: Path, stop: str
) -> None:
    """Stopped by ``llmctl down`` (SIGTERM) or by Ctrl-C to llmctl: either way the program is asked to
    stop the contract's way (SIGTERM), saves and exits 75; the resume logs every step exactly once."""
    _here(tmp_path, "hf_trainer.py")
    # 0.5 s each: the stop lands well before the last one, even on a loaded machine (24 were not
    # enough once in CI: llmctl down, starting beside the Slurm harness's start, landed after the last)
    steps = 60
    args = [
        "launch",
        "workload=command",
        "workload.run=python hf_trainer.py --model tiny",
        f"workload.args.max_steps={steps}",
        "workload.args.save_steps=50",  # no periodic save: the one that counts is the stop's
        "workload.args.step_sleep=0.5",
    ]
    launch = _launch(args, tmp_path, cli_env)
    try:
        runs_dir = tmp_path / "llmctl-runs"

        def logged_three() -> bool:
            logs = list(runs_dir.glob("*/output.log")) if runs_dir.is_dir() else []
            return bool(logs) and logs[0].read_text().count("'loss'") >= 3

        _wait_for(logged_three, 240, "three logged losses")
        rid = next(p.name for p in runs_dir.iterdir() if (p / "output.log").is_file())
        if stop == "down":
            down = run_cli(["down", rid], tmp_path, cli_env)
            assert down.returncode == 0, down.stdout + down.stderr
        else:
            launch.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends llmctl
        out, _ = launch.communicate(timeout=600)  # a hang guard, as the ones below
    finally:
        if launch.poll() is None:
            launch.kill()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = _the_run(tmp_path)
    assert run.info.status == "KILLED"
    status = run.data.tags["llmctl.status"]
    if stop == "down":
        assert launch.returncode == 75, out[-3000:]
        assert status.startswith("stopped by llmctl down after the program saved its state (exit 75)"), status
    else:
        assert launch.returncode == 130, out[-3000:]
        assert status.startswith("interrupted (Ctrl-C) after the program saved its state"), status
        assert f"llmctl: run {rid} interrupted (Ctrl-C) after the program saved its state" in out, out[-3000:]
        assert f"resume with: llmctl resume {rid}" in out and "KeyboardInterrupt" not in out, out[-3000:]
    first = _steps(uri, rid, "loss")
    assert first and first == list(range(1, len(first) + 1)) and len(first) < steps, first
    saved = sorted((tmp_path / "llmctl-runs" / rid / "checkpoints").glob("checkpoint-*"))
    assert [p.name for p in saved] == [f"checkpoint-{first[-1]}"], saved  # the stop's own save

    res = run_cli(["resume", rid], tmp_path, cli_env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "the program continues from its own state" in res.stdout
    run = _the_run(tmp_path)
    assert run.info.run_id == rid and run.info.status == "FINISHED"
    # each step once: the second attempt started after the first one's last step, not from 1
    assert _steps(uri, rid, "loss") == list(range(1, steps + 1))
    assert_outcome(uri, rid, Outcome.FINISHED, res.returncode, attempt=2)
    starts = {k: json.loads(v) for k, v in run.data.tags.items() if k.startswith("llmctl.workload_start.")}
    assert [s["attempt"] for _, s in sorted(starts.items())] == [1, 2]
    assert run.data.params["workload.args.max_steps"] == str(steps) and "model.dim" not in run.data.params

    # the program finished: resuming again reruns nothing, bills no attempt 3, logs no step twice
    again = run_cli(["resume", rid], tmp_path, cli_env)
    assert again.returncode == 3, again.stdout[-2000:] + again.stderr[-2000:]
    assert "nothing to resume" in again.stderr.strip().splitlines()[-1], again.stderr
    assert_outcome(uri, rid, Outcome.FINISHED, 0, attempt=2)
    assert _steps(uri, rid, "loss") == list(range(1, steps + 1))

    # `llmctl runs` shows the program's own loss, named, at the step it last reached
    (row,) = json.loads(run_cli(["runs", "--json"], tmp_path, cli_env).stdout)
    loss = mlflow_client(uri).get_run(rid).data.metrics["loss"]
    assert (row["train_loss"], row["loss_name"], row["steps"]) == (loss, "loss", steps), row
    table = run_cli(["runs"], tmp_path, cli_env).stdout
    assert f"{loss:.4f} (loss)" in table and f" {steps}/" in table, table


def test_a_torchrun_ddp_script_on_two_gloo_processes(cli_env: dict[str, str], tmp_path: Path) -> None:
    _here(tmp_path, "ddp.py")
    scratch = tmp_path / "tmp"  # the run's temporary files: the ranks' exit records live here, then go
    scratch.mkdir()
    out = run_cli(
        [
            "launch",
            "workload=command",
            "workload.run=python ddp.py",
            "workload.torchrun=true",
            "infra.nproc_per_node=2",
        ],
        tmp_path,
        {**cli_env, "TMPDIR": str(scratch)},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "program | 2 ranks, replicas equal: True, LLMCTL_ATTEMPT=1" in out.stdout
    assert not list(scratch.glob("llmctl-exit-*")), "the exit records' folder outlived the run"
    run = _the_run(tmp_path)
    assert run.info.status == "FINISHED"
    assert _steps(f"sqlite:///{tmp_path / 'mlflow.db'}", run.info.run_id, "ddp/loss") == [1, 2, 3, 4, 5]


def test_the_budget_guard_stops_the_program_with_sigterm(cli_env: dict[str, str], tmp_path: Path) -> None:
    """$3,600/h is $1/s: the program gets SIGTERM when the spend plus its 2 s grace and the 5 s
    reserve would pass $30, i.e. ~23 s into the attempt's billing, long before its 400 steps end."""
    _here(tmp_path, "steps.py")
    out = run_cli(
        [
            "launch",
            "--max-cost",
            "30",
            "workload=command",
            "workload.run=python steps.py --steps 400 --step_s 0.2",
            "infra.price_per_gpu_hour=3600",
            "checkpoint.preempt_grace_s=2",
        ],
        tmp_path,
        cli_env,
    )
    assert out.returncode == 4, out.stdout[-3000:] + out.stderr[-3000:]
    assert "budget | stopping the program (SIGTERM)" in out.stdout and "program | stopped at step" in out.stdout
    run = _the_run(tmp_path)
    tags = assert_outcome(f"sqlite:///{tmp_path / 'mlflow.db'}", run.info.run_id, Outcome.BUDGET_STOP, 4, attempt=1)
    assert "(the program stopped on SIGTERM)" in tags["llmctl.status"]
    assert float(tags["cost/actual_usd"]) <= 30.0
    state = json.loads((tmp_path / "llmctl-runs" / run.info.run_id / "checkpoints" / "state.json").read_text())
    assert 0 < state["step"] < 400


def _sweep(tmp_path: Path):
    runs = mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parents = [r for r in runs if r.data.tags.get("llmctl.sweep_role") == "parent" or "sweep.metric" in r.data.params]
    return parents, [r for r in runs if r not in parents]


@pytest.mark.parametrize(
    "how",
    [
        ["workload.args.learning_rate=0.001,0.01"],
        [
            "--search",
            "tpe",
            "--trials",
            "2",
            "--seed",
            "3",
            "workload.args.learning_rate=tag(log, interval(1e-4, 1e-1))",
        ],
    ],
    ids=["grid", "tpe"],
)
def test_a_sweep_over_the_scripts_learning_rate(
    cli_env: dict[str, str], tmp_path: Path, tiny_llama: Path, how: list[str]
) -> None:
    """The transformers script's own ``--learning_rate``: one parent run and one run per trial; the
    parent reports the best trial's ``train_loss`` (the metric transformers logs at the end)."""
    _here(tmp_path, "hf_trainer.py")
    args = ["launch", "-m", "--wait", "--metric", "train_loss", "workload=command"]
    job = ["workload.run=python hf_trainer.py --model tiny", "workload.args.max_steps=4"]
    out = run_cli([*args, *job, *how], tmp_path, cli_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    parents, trials = _sweep(tmp_path)
    assert len(parents) == 1 and len(trials) == 2, [r.data.tags.get("mlflow.runName") for r in parents + trials]
    assert all(t.info.status == "FINISHED" for t in trials)
    lrs = sorted(float(t.data.params["workload.args.learning_rate"]) for t in trials)
    if how[0] != "--search":
        assert lrs == [0.001, 0.01]
    else:
        assert all(1e-4 <= lr <= 1e-1 for lr in lrs) and lrs[0] != lrs[1]
    for t in trials:  # transformers' callback logged its own TrainingArguments into the trial's run
        assert float(t.data.params["learning_rate"]) == float(t.data.params["workload.args.learning_rate"])
    best = min(trials, key=lambda t: t.data.metrics["train_loss"])
    assert parents[0].data.metrics["train_loss"] == pytest.approx(best.data.metrics["train_loss"])
    assert parents[0].data.tags["llmctl.sweep.best_run_id"] == best.info.run_id


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["workload=command"], "Bad value for 'workload.run': workload=command needs the program to run"),
        (
            ["workload=command", "workload.run=python missing.py"],
            "Bad value for 'workload.run': missing.py does not exist",
        ),
        (["workload=command", "workload.run=no-such-program --x 1"], "no program 'no-such-program' on PATH"),
        (
            ["workload=command", "workload.run=python steps.py --lr 0.1", "workload.args.lr=0.2"],
            "Bad value for 'workload.args.lr': --lr is already in workload.run",
        ),
        (
            ["workload=command", "workload.run=bash -c true", "workload.torchrun=true"],
            "Bad value for 'workload.torchrun': torchrun starts Python programs",
        ),
        (
            ["workload=command", "workload.run=python steps.py", "workload.env.HF_TOKEN=abc"],
            "Bad value for 'workload.env.HF_TOKEN': a secret would be stored",
        ),
        (
            ["workload=command", "workload.run=python steps.py", "workload.secrets=[LLMCTL_NOT_SET_KEY]"],
            "Bad value for 'workload.secrets': LLMCTL_NOT_SET_KEY is not set in this environment",
        ),
        (
            ["workload=command", "workload.run=python steps.py", "workload.secrets=[not-a-name]"],
            "Bad value for 'workload.secrets': 'not-a-name' is not a variable name",
        ),
        # a forgotten workload=command: the bundled trainer would run and record a run instead
        (["workload.run=python steps.py"], "Bad value for 'workload.run': only workload=command reads it"),
        (["workload.args.lr=0.2"], "Bad value for 'workload.args': only workload=command reads it"),
    ],
    ids=[
        "no-program",
        "no-script",
        "not-on-path",
        "twice",
        "torchrun-not-python",
        "secret",
        "secret-unset",
        "bad-name",
        "run-without-command",
        "args-without-command",
    ],
)
def test_bad_input_is_one_line_and_creates_nothing(
    cli_env: dict[str, str], tmp_path: Path, overrides: list[str], needle: str
) -> None:
    _here(tmp_path, "steps.py")
    out = run_cli(["launch", *overrides], tmp_path, cli_env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 3 and needle in lines[-1] and "Fix: " in lines[-1], out.stderr[-2000:]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "llmctl-runs").exists()


def test_a_named_secret_reaches_the_program_and_nowhere_else(cli_env: dict[str, str], tmp_path: Path) -> None:
    """``workload.secrets=[NAME]``: the program sees the value; the run's params, tags, artifacts and
    the run's folder (output.log, config.yaml) hold the name at most, never the value."""
    program = tmp_path / "uses_key.py"
    program.write_text(
        "import hashlib, os\n"
        "key = os.environ['LLMCTL_TEST_API_KEY']\n"
        "print('program | key sha256', hashlib.sha256(key.encode()).hexdigest()[:16], flush=True)\n"
    )
    secret = f"s3cr3t-{uuid.uuid4().hex}"  # made here: no file of the tree (nor its diff) holds it
    env = {**cli_env, "LLMCTL_TEST_API_KEY": secret}
    args = ["launch", "workload=command", "workload.run=python uses_key.py", "workload.secrets=[LLMCTL_TEST_API_KEY]"]
    out = run_cli(args, tmp_path, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"program | key sha256 {hashlib.sha256(secret.encode()).hexdigest()[:16]}" in out.stdout
    assert secret not in out.stdout + out.stderr
    run = _the_run(tmp_path)
    assert run.data.params["workload.secrets"] == "['LLMCTL_TEST_API_KEY']"
    assert secret not in json.dumps([run.data.params, run.data.tags])
    stored = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "uses_key.py"]
    assert any(p.name == "output.log" for p in stored) and any(p.name == "config.yaml" for p in stored)
    leaked = [str(p) for p in stored if secret.encode() in p.read_bytes()]
    assert leaked == [], leaked  # mlflow.db, artifacts, the run's folder


# --------------------------------------------------------------------------- every rank's fate


def _fates_launch(tmp_path: Path, cli_env: dict[str, str], fate: str, *extra: str) -> subprocess.Popen[str]:
    _here(tmp_path, "fates.py")
    args = [
        "launch",
        "workload=command",
        f"workload.run=python fates.py --fate {fate}",
        "workload.torchrun=true",
        "infra.nproc_per_node=2",
        *extra,
    ]
    return _launch(args, tmp_path, cli_env)


def _both_ranks_ready(tmp_path: Path) -> str:
    runs_dir = tmp_path / "llmctl-runs"

    def ready() -> bool:
        logs = list(runs_dir.glob("*/output.log")) if runs_dir.is_dir() else []
        return bool(logs) and all(f"fates | rank {r} ready" in logs[0].read_text() for r in (0, 1))

    _wait_for(ready, 240, "both ranks ready")
    return next(p.name for p in runs_dir.iterdir() if (p / "output.log").is_file())


def _stopped_by_down(tmp_path: Path, cli_env: dict[str, str], launch: subprocess.Popen[str], wait_s: float) -> str:
    try:
        rid = _both_ranks_ready(tmp_path)
        down = run_cli(["down", rid], tmp_path, cli_env)
        assert down.returncode == 0, down.stdout + down.stderr
        out, _ = launch.communicate(timeout=wait_s)
    finally:
        if launch.poll() is None:
            launch.kill()
    return out


def _assert_saved_stop(tmp_path: Path, code: int) -> Any:
    """The run as a command workload's saved stop leaves it: KILLED, exit 75, resumable, attempt closed."""
    assert code == 75
    run = _the_run(tmp_path)
    status = run.data.tags["llmctl.status"]
    assert run.info.status == "KILLED", status
    assert status.startswith("stopped by llmctl down after the program saved its state (exit 75)"), status
    assert json.loads(run.data.tags["llmctl.preempted"])["saved"] is True
    [attempt] = ledger.attempts(run.data.tags)
    assert attempt.end is not None and attempt.end >= attempt.start
    return run


def test_a_rank_killed_by_a_signal_fails_the_run_though_the_other_saved(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    """Rank 1 SIGKILLed, rank 0 then stopped by torchrun saves and exits 75: a crash, not a preemption."""
    launch = _fates_launch(tmp_path, cli_env, "sigkill")
    try:
        out, _ = launch.communicate(timeout=300)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 1, out[-3000:]
    assert "rank 1 was killed by SIGKILL" in out, out[-3000:]
    run = _the_run(tmp_path)
    assert_outcome(f"sqlite:///{tmp_path / 'mlflow.db'}", run.info.run_id, Outcome.FAILED, launch.returncode, 1)
    assert "llmctl.preempted" not in run.data.tags and "llmctl resume" not in out
    assert "fates | rank 0 saved" in (tmp_path / "llmctl-runs" / run.info.run_id / "output.log").read_text()


def test_os_exit_75_on_every_rank_after_a_stop_is_a_saved_stop(cli_env: dict[str, str], tmp_path: Path) -> None:
    launch = _fates_launch(tmp_path, cli_env, "os_exit")
    out = _stopped_by_down(tmp_path, cli_env, launch, 120)
    assert launch.returncode == 75, out[-3000:]
    _assert_saved_stop(tmp_path, launch.returncode)


def test_a_save_longer_than_torchruns_shutdown_timeout_gets_the_promised_grace(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    """A 40 s save under ``preempt_grace_s=90``: torchrun's agent would SIGKILL the ranks 30 s after a
    stop it passed on; the guard stops the ranks itself, so the save completes."""
    launch = _fates_launch(tmp_path, cli_env, "slow_save --save-s 40", "checkpoint.preempt_grace_s=90")
    out = _stopped_by_down(tmp_path, cli_env, launch, 300)
    assert launch.returncode == 75, out[-3000:]
    run = _assert_saved_stop(tmp_path, launch.returncode)
    log = (tmp_path / "llmctl-runs" / run.info.run_id / "output.log").read_text()
    assert "fates | rank 0 saved" in log and "fates | rank 1 saved" in log, log[-3000:]
