"""Every outcome of an attempt × every entry point (launch, resume, sweep trial), held against the one
table ``llmctl.run.outcomes.RULES``: the MLflow status, the ``llmctl.status`` tag, the exit code and the
ledger rows. Real parts: the CLI in subprocesses, torchrun + the workload, a sqlite MLflow store,
the sweep supervisor. Nothing here depends on this machine's speed: every stop is triggered by
what the run has logged, and the budget stops come from a price so high that the guard's own
reserve (5 s of billing) passes the limit at the first step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import STATUS_PREFIX, assert_outcome, controller_codes, mlflow_client, run_cli

from llmctl.cost import ledger
from llmctl.run.outcomes import RULES, Outcome, classify

PRICE = 360_000.0  # $/h = $100 per second: the guard's 5 s reserve alone is $500
SMALL = ["experiment=smoke", "train.log_every=1", "train.val_every=1000", "checkpoint.every=2", "train.val_batches=1"]


# ----------------------------------------------------------------------------- the table itself


def test_outcomes_from_what_the_controller_and_the_workload_recorded() -> None:
    from llmctl.controller.procs import Interrupted
    from llmctl.errors import LaunchError

    stop = json.dumps({"step": 3, "spent_usd": 1.5, "max_cost_usd": 1.0, "checkpoint": True})
    pre = json.dumps({"step": 7, "checkpoint": 7, "saved": True, "signal": "SIGTERM"})
    cases = [  # (exit code, error, stop request, tags) -> outcome, llmctl.status
        ((0, None, None, {}), Outcome.FINISHED, "finished"),
        (
            (0, None, None, {"llmctl.budget_stop": stop}),
            Outcome.BUDGET_STOP,
            "stopped: budget $1.00 reached at step 3 (spent $1.50; checkpoint saved)",
        ),
        ((0, None, None, {"llmctl.preempted": pre}), Outcome.FINISHED, "finished"),  # recovered, then done
        (
            (1, None, signal.SIGTERM, {"llmctl.preempted": pre}),
            Outcome.PREEMPTED,
            "preempted at step 7 (checkpoint step-7) — resume with: llmctl resume r1",
        ),
        ((1, None, None, {}), Outcome.FAILED, "workload exited with code 1"),
        ((1, None, signal.SIGTERM, {}), Outcome.KILLED, STATUS_PREFIX[Outcome.KILLED]),  # workers hung past the grace
        ((None, LaunchError("no cluster"), None, {}), Outcome.FAILED, "failed to start: no cluster"),
        (
            (None, Interrupted(signal.SIGINT), signal.SIGINT, {"llmctl.preempted": pre}),
            Outcome.INTERRUPTED,
            "interrupted (Ctrl-C)",
        ),
        (
            (None, Interrupted(signal.SIGTERM), signal.SIGTERM, {"llmctl.preempted": pre}),
            Outcome.KILLED,
            STATUS_PREFIX[Outcome.KILLED],
        ),
    ]
    for (code, error, stop_request, tags), want, status in cases:
        got, reason = classify(code, error, tags, "r1", stop_request)
        assert got is want, (code, error, tags)
        assert reason.startswith(status), reason
    codes = {o: r.exit_code for o, r in RULES.items()}
    assert codes == {
        Outcome.FINISHED: 0,
        Outcome.BUDGET_STOP: 4,
        Outcome.PREEMPTED: 75,
        Outcome.INTERRUPTED: 130,
        Outcome.KILLED: 143,
        Outcome.FAILED: 1,
    }
    assert len(set(codes.values())) == len(codes), "each outcome has its own exit code"


def test_docs_show_the_table() -> None:
    from helpers import ROOT

    text = (ROOT / "docs" / "concepts.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    for outcome, rule in RULES.items():
        row = next((r for r in rows if r.startswith(f"| `{outcome.value}`")), None)
        assert row is not None, f"docs/concepts.md has no row for {outcome.value}"
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == rule.mlflow_status and cells[3] == str(rule.exit_code), row


# ----------------------------------------------------------------------------- helpers


def _start(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "llmctl", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _steps(loss_file: Path) -> list[int]:
    if not loss_file.exists():
        return []
    return [json.loads(line)["step"] for line in loss_file.read_text().splitlines() if "train/loss" in line]


def _wait_training(loss_file: Path, proc: subprocess.Popen[str], after: int, timeout: float = 300) -> None:
    """Until the attempt logged a step past ``after`` (it is training, checkpoints on their way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the attempt ended before it was stopped"
        if len([s for s in _steps(loss_file) if s > after]) >= 2:
            return
        time.sleep(0.05)
    raise AssertionError("no training step logged")


def _pending(pid: int) -> int:
    """The signals waiting for ``pid`` (thread- and process-directed), as a bit mask; every bit once
    the process is gone (the controller's escalation went on to SIGKILL: seen once in CI under
    xdist, the SIGINT never showed as pending; the run's outcome is still checked after)."""
    mask = 0
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return ~0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            mask |= int(line.split()[1], 16)
    return mask


def _wait_pending(pid: int, sig: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not _pending(pid) & (1 << (sig - 1)):
        assert time.monotonic() < deadline, f"{signal.Signals(sig).name} never reached pid {pid}"
        time.sleep(0.02)


def _wait_stopped(pids: list[int], timeout: float = 300) -> None:
    """Until every thread of ``pids`` is stopped (state T) or gone. SIGSTOP takes effect only when a
    process next runs, and a SIGTERM that arrives before then is taken first (the kernel delivers
    the lower signal number first): the workers would note the preemption, then freeze, and the
    SIGTERM would never show as pending (the controller's grace timer, not the second SIGTERM,
    would then be what stopped them)."""

    def running(pid: int) -> bool:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except FileNotFoundError:
            return False
        for task in tasks:
            try:
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, IndexError):
                continue
            if state not in ("T", "t", "Z", "X"):
                return True
        return False

    deadline = time.monotonic() + timeout
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, f"SIGSTOP never stopped {pids}"
        time.sleep(0.02)


def kill_controller(controller: int, workers: int) -> None:
    """Two SIGTERMs to a controller whose workers are frozen: the first is passed on as a preemption
    they cannot act on yet (seen pending in /proc), the second makes the controller stop them without
    waiting (SIGINT, seen pending too); then they run again and exit without a checkpoint. Each step
    waits for the effect of the last, so the order holds at any speed."""
    from llmctl.controller.procs import descendants, signal_tree

    frozen = [workers, *descendants(workers)]
    signal_tree(workers, signal.SIGSTOP)
    _wait_stopped(frozen)
    os.kill(controller, signal.SIGTERM)
    _wait_pending(workers, signal.SIGTERM)
    os.kill(controller, signal.SIGTERM)
    _wait_pending(workers, signal.SIGINT)
    signal_tree(workers, signal.SIGCONT)


def _workers(run_dir: Path) -> int:
    deadline = time.monotonic() + 60
    while not (run_dir / "pids.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return int(json.loads((run_dir / "pids.json").read_text())["workers"])


def _stop(proc: subprocess.Popen[str], how: str, cwd: Path) -> tuple[int, str, str]:
    """``interrupt``: Ctrl-C; ``preempt``: one SIGTERM (what llmctl down sends); ``kill``: see
    ``kill_controller``. Returns the exit code, what the job printed (stdout) and what llmctl itself
    said (stderr)."""
    if how == "kill":
        kill_controller(proc.pid, _workers(cwd / "llmctl-runs" / _run_id(cwd)))
    else:
        os.kill(proc.pid, signal.SIGINT if how == "interrupt" else signal.SIGTERM)
    out, err = proc.communicate(timeout=600)  # a hang guard: closing under CI's load takes a minute and more
    return proc.returncode, out, err


def _run_id(cwd: Path) -> str:
    return max((cwd / "llmctl-runs").iterdir(), key=lambda p: p.stat().st_mtime).name


def _fast_history(uri: str, overrides: list[str]) -> None:
    """A FINISHED run that measured this shape at 10M tok/s: the estimate then passes any --max-cost,
    and the real (slower) run meets its budget in the middle."""
    from mlflow.entities import Metric, Param

    from llmctl.config.compose import compose
    from llmctl.cost import history
    from llmctl.cost.estimate import shape_key
    from llmctl.plan.make import make_plan

    plan = make_plan(compose(overrides + [f"tracking.uri={uri}"]))
    mc = mlflow_client(uri)
    exp = mc.get_experiment_by_name("history") or mc.get_experiment(mc.create_experiment("history"))
    run = mc.create_run(
        exp.experiment_id,
        tags={history.TAG_SHAPE: shape_key(plan.cfg), history.TAG_ACCELERATOR: plan.hardware.accelerator},
    )
    mc.log_batch(
        run.info.run_id,
        metrics=[Metric(history.STEADY, 1e7, 0, 0), Metric(history.OVERHEAD, 0.0, 0, 0)],
        params=[Param("infra.nodes", "1"), Param("train.batch_size", "8"), Param("train.val_batches", "1")],
    )
    mc.set_terminated(run.info.run_id, "FINISHED")


# ----------------------------------------------------------------------------- launch


@pytest.mark.slow
@pytest.mark.parametrize("outcome", [Outcome.FINISHED, Outcome.FAILED, Outcome.INTERRUPTED, Outcome.KILLED])
def test_launch_outcomes(outcome: Outcome, cli_env: dict[str, str], tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    loss_file = tmp_path / "losses.jsonl"
    env = {**cli_env, "LLMCTL_LOSS_FILE": str(loss_file)}
    if outcome in (Outcome.FINISHED, Outcome.FAILED):
        if outcome is Outcome.FAILED:
            env["LLMCTL_FAIL_AT_STEP"] = "2"
        out = run_cli(["launch", *SMALL, "train.steps=2"], tmp_path, env)
        code, job, said = out.returncode, out.stdout, out.stderr
    else:
        proc = _start(["launch", *SMALL, "train.steps=100000"], tmp_path, env)
        _wait_training(loss_file, proc, after=0)
        code, job, said = _stop(proc, "interrupt" if outcome is Outcome.INTERRUPTED else "kill", tmp_path)
    assert code == RULES[outcome].exit_code, job[-3000:] + said[-3000:]
    rid = _run_id(tmp_path)
    assert_outcome(uri, rid, outcome, code, attempt=1)
    assert "Traceback" not in said  # llmctl's own words: one line, whatever the job printed
    if outcome is not Outcome.FINISHED:
        assert said.strip().splitlines()[-1].startswith(f"error: run {rid} "), said


@pytest.mark.slow
def test_budget_stop_then_resume_with_a_larger_budget(cli_env: dict[str, str], tmp_path: Path) -> None:
    """The issue's scenario: a budget that stops mid-run (exit 4, checkpoint written), then
    ``resume --max-cost <larger>`` finishes, billed as two attempts whose sum is the run's cost."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = [*SMALL, "train.steps=20", f"infra.price_per_gpu_hour={PRICE}"]
    _fast_history(uri, args)
    out = run_cli(["launch", *args, "--max-cost", "1"], tmp_path, cli_env)
    assert out.returncode == 4, out.stdout[-3000:] + out.stderr[-3000:]
    assert "stopped: budget $1.00 reached at step" in out.stderr
    rid = _run_id(tmp_path)
    tags = assert_outcome(uri, rid, Outcome.BUDGET_STOP, out.returncode, attempt=1)
    step = json.loads(tags["llmctl.budget_stop"])["step"]
    assert 0 < step < 20 and "checkpoint saved" in tags["llmctl.status"]
    assert (tmp_path / "llmctl-runs" / rid / "checkpoints" / f"step-{step}" / ".complete").is_file()
    assert ledger.figures(mlflow_client(uri).get_run(rid))["train/steps_done"] == step  # the stop step was logged

    # the old limit still holds: refused before anything changes
    again = run_cli(["resume", rid], tmp_path, cli_env)
    assert again.returncode == 3 and "already spent" in again.stderr and "--max-cost" in again.stderr, again.stderr
    assert mlflow_client(uri).get_run(rid).data.tags["llmctl.attempt"] == "1"

    out = run_cli(["resume", rid, "--max-cost", "1000000000"], tmp_path, cli_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"resumed from step {step}" in out.stdout
    tags = assert_outcome(uri, rid, Outcome.FINISHED, out.returncode, attempt=2)
    assert tags["llmctl.max_cost_usd"] == "1000000000.00" and "llmctl.budget_stop" not in tags
    assert tags["llmctl.attempt.1.status"].startswith("stopped: budget")
    assert float(tags["llmctl.attempt.1.usd_per_hour"]) == float(tags["llmctl.attempt.2.usd_per_hour"]) == PRICE
    run = mlflow_client(uri).get_run(rid)
    assert float(run.data.tags["cost/actual_usd"]) > 1.0  # both attempts billed at $100/s
    assert sorted(m.step for m in mlflow_client(uri).get_metric_history(rid, "train/loss")) == list(range(1, 21))


# ----------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_resume_outcomes_in_one_run(cli_env: dict[str, str], tmp_path: Path) -> None:
    """One run, seven attempts: launch preempted, then a resume ending in each outcome in turn."""
    from workloads.protocol.checkpoint_layout import latest_complete

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    loss_file = tmp_path / "losses.jsonl"
    env = {**cli_env, "LLMCTL_LOSS_FILE": str(loss_file)}
    args = [*SMALL, "train.steps=100000"]
    _fast_history(uri, args)

    proc = _start(["launch", *args], tmp_path, env)
    _wait_training(loss_file, proc, after=0)
    code, _, said = _stop(proc, "preempt", tmp_path)
    rid = _run_id(tmp_path)
    assert_outcome(uri, rid, Outcome.PREEMPTED, code, attempt=1)
    # a SIGTERM nobody announced, state saved: information with the way on, not an error
    last_line = said.strip().splitlines()[-1]
    assert last_line.startswith(f"llmctl: run {rid} preempted at step") and "llmctl resume" in last_line, said
    assert "error:" not in said, said
    ckpts = str(tmp_path / "llmctl-runs" / rid / "checkpoints")

    def last() -> int:
        step = latest_complete(ckpts)
        assert step is not None
        return step

    from_steps = [0]

    def stopped(attempt: int, how: str, outcome: Outcome) -> None:
        before = max(_steps(loss_file))
        from_steps.append(last())
        proc = _start(["resume", rid], tmp_path, env)
        _wait_training(loss_file, proc, after=before)
        code, job, said = _stop(proc, how, tmp_path)
        assert code == RULES[outcome].exit_code, job[-3000:] + said[-3000:]
        assert_outcome(uri, rid, outcome, code, attempt)

    def ran(attempt: int, outcome: Outcome, args: list[str], extra_env: dict[str, str]) -> dict[str, str]:
        from_steps.append(last())
        out = run_cli(["resume", rid, *args], tmp_path, {**env, **extra_env})
        assert out.returncode == RULES[outcome].exit_code, out.stdout[-3000:] + out.stderr[-3000:]
        return assert_outcome(uri, rid, outcome, out.returncode, attempt)

    ran(2, Outcome.FAILED, [], {"LLMCTL_FAIL_AT_STEP": str(last() + 2)})
    stopped(3, "interrupt", Outcome.INTERRUPTED)
    stopped(4, "kill", Outcome.KILLED)
    stopped(5, "preempt", Outcome.PREEMPTED)
    ran(
        6,
        Outcome.BUDGET_STOP,
        [f"train.steps={last() + 10}", f"infra.price_per_gpu_hour={PRICE}", "--max-cost", "1"],
        {},
    )
    tags = ran(
        7, Outcome.FINISHED, [f"train.steps={last() + 2}", "infra.price_per_gpu_hour=0", "--max-cost", "1000000000"], {}
    )
    assert [int(tags[f"llmctl.attempt.{n}.from_step"]) for n in range(1, 8)] == from_steps
    statuses = [tags[f"llmctl.attempt.{n}.status"].split(":")[0].split(" at ")[0] for n in range(1, 8)]
    assert statuses == [
        "preempted",
        "workload exited with code 1",
        "interrupted (Ctrl-C)",
        "killed",
        "preempted",
        "stopped",
        "finished",
    ], statuses
    assert [int(tags[f"llmctl.attempt.{n}.world_size"]) for n in range(1, 8)] == [1] * 7


# ----------------------------------------------------------------------------- sweep trials


def _sweep(tmp: Path) -> tuple[Any, list[Any]]:
    mc = mlflow_client(f"sqlite:///{tmp / 'mlflow.db'}")
    runs = mc.search_runs([e.experiment_id for e in mc.search_experiments()])
    [parent] = [r for r in runs if r.data.tags.get("llmctl.kind") == "sweep"]
    children = sorted(
        (r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id),
        key=lambda r: int(r.data.tags["llmctl.trial"]),
    )
    return parent, children


@pytest.mark.slow
def test_sweep_trial_outcomes_finished_failed_budget(cli_env: dict[str, str], tmp_path: Path) -> None:
    """Four trials: free and fine, free and broken, priced and stopped by its share of --max-cost,
    priced and broken. Each child run and its controller's exit code follow the table."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = [*SMALL, "train.steps=20"]
    _fast_history(uri, args)
    out = run_cli(
        [
            "launch",
            "-m",
            "--max-parallel",
            "2",
            "--wait",
            "--max-cost",
            "1",
            *args,
            f"infra.price_per_gpu_hour=0,{PRICE}",
            "data.val_fraction=0.05,0.000001",
        ],
        tmp_path,
        cli_env,
    )
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]  # a trial failed
    sid = next(w.rstrip(":") for w in out.stdout.split() if w.startswith("sweep-"))
    last = out.stdout.splitlines()[-1]  # not piped: the final table once, then the verdict on its own line
    assert last.startswith(f"llmctl: sweep {sid} "), out.stdout[-3000:]
    parent, children = _sweep(tmp_path)
    codes = controller_codes(tmp_path, sid)
    want = [Outcome.FINISHED, Outcome.FAILED, Outcome.BUDGET_STOP, Outcome.FAILED]
    for child, outcome in zip(children, want):
        assert_outcome(uri, child.info.run_id, outcome, codes[int(child.data.tags["llmctl.trial"])], attempt=1)
    budget = json.loads(children[2].data.tags["llmctl.budget_stop"])
    assert budget["max_cost_usd"] == pytest.approx(0.5)  # its share: half the sweep's $1 (the other priced trial's)
    assert parent.info.status == "FAILED"


@pytest.mark.slow
def test_sweep_trial_outcomes_interrupted_and_killed(cli_env: dict[str, str], tmp_path: Path) -> None:
    """Two long trials: Ctrl-C to one trial's controller, ``kill_controller`` on the other's."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = run_cli(
        ["launch", "-m", "--max-parallel", "2", *SMALL, "train.steps=100000", "train.seed=0,1"], tmp_path, cli_env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    sid = next(w.rstrip(":") for w in out.stdout.split() if w.startswith("sweep-"))
    sdir = tmp_path / "llmctl-runs" / "sweeps" / sid
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # both trials training
        st = json.loads((sdir / "state.json").read_text()) if (sdir / "state.json").exists() else {"trials": {}}
        running = {int(i): t for i, t in st["trials"].items() if t["state"] == "RUNNING"}
        logs = [tmp_path / "llmctl-runs" / t["run_id"] / "output.log" for t in running.values()]
        if len(running) == 2 and all(p.exists() and p.read_text().count(" | loss ") >= 2 for p in logs):
            break
        time.sleep(0.2)
    else:
        pytest.fail("trials did not start training: " + (sdir / "supervisor.log").read_text())
    os.kill(running[0]["pid"], signal.SIGINT)
    kill_controller(running[1]["pid"], _workers(tmp_path / "llmctl-runs" / running[1]["run_id"]))
    while time.monotonic() < deadline and not json.loads((sdir / "state.json").read_text()).get("done"):
        time.sleep(0.5)
    parent, children = _sweep(tmp_path)
    codes = controller_codes(tmp_path, sid)
    assert_outcome(uri, children[0].info.run_id, Outcome.INTERRUPTED, codes[0], attempt=1)
    assert_outcome(uri, children[1].info.run_id, Outcome.KILLED, codes[1], attempt=1)
    assert parent.info.status == "FAILED"  # not every trial finished, and the sweep was not cancelled


def test_a_run_launched_before_capabilities_came_from_skypilot_still_resumes() -> None:
    """Its stored config.yaml carries infra keys the schema retired; resume drops exactly those."""
    from llmctl.config.compose import compose
    from llmctl.run.resume import compose_resume

    stored = compose(["experiment=smoke", "infra=runpod", "tracking.uri=http://mlflow.example:5000"]).cfg
    stored["infra"].update({"max_nodes": 1, "supports_spot": True, "supports_autostop": True})
    choices = {"model": "tiny", "data": "pydoc", "train": "default", "parallel": "auto", "infra": "runpod"}
    again = compose_resume(stored, choices, ["train.steps=80"]).cfg
    assert again["train"]["steps"] == 80 and again["infra"]["provider"] == "runpod"
    assert "max_nodes" not in again["infra"] and again["infra"]["accelerator_aliases"]["H100"] == "H100-SXM"
