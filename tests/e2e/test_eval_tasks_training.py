"""``eval.tasks`` during training: lm-eval scores of each scored checkpoint, in the run, at its step.

A real launch (torchrun with two FSDP ranks, sharded DCP checkpoints, a sqlite MLflow store)
scoring the docs' local multiple-choice task at steps 5 and 10 (rank 0 scores, rank 1 waits); the
score at step 10 is held to lm-eval run by hand (``python -m workloads.pretrain.harness``, lm-eval's
``hf`` model) on ``llmctl export`` of step 10. Bad ``eval.*`` settings are refused before a run exists.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, mlflow_runs, run_cli, with_faults

pytestmark = pytest.mark.slow

TASKS = ROOT / "examples" / "eval-tasks"
TRAIN = ["experiment=smoke", "train.steps=10", "train.val_every=5", "checkpoint.every=5"]
SCORED = ["eval.tasks=[python_facts_mc]", f"eval.include_path={TASKS}", "eval.limit=6", "eval.every=5"]


def test_eval_tasks_score_every_checkpoint_into_the_run(cli_env: dict[str, str], tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    env = {k: v for k, v in cli_env.items() if k != "OMP_NUM_THREADS"}
    out = run_cli(["launch", *TRAIN, *SCORED, "parallel.dp_shard=2"], tmp_path, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "lm-eval | step 5 in " in out.stdout and "lm-eval | step 10 in " in out.stdout, out.stdout[-3000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (run,) = mlflow_runs(uri)
    rid, client = run.info.run_id, MlflowClient(tracking_uri=uri)
    assert run.info.status == "FINISHED"
    for key in ("eval/python_facts_mc/acc", "eval/python_facts_mc/acc_norm", "eval/python_facts_mc/acc_stderr"):
        assert [m.step for m in client.get_metric_history(rid, key)] == [5, 10], key
    assert [m.step for m in client.get_metric_history(rid, "val/loss")] == [0, 5, 10]  # the same x axis
    # each scoring's wall time, set apart in the closing line (the plan's estimate leaves it out)
    scoring = client.get_metric_history(rid, "time/tasks_s")
    assert [m.step for m in scoring] == [5, 10] and all(m.value > 0 for m in scoring), scoring
    closing = next(ln for ln in (out.stdout + out.stderr).splitlines() if f"run {rid} FINISHED in" in ln)
    assert f"; lm-eval scoring {sum(m.value for m in scoring):.0f} s apart)" in closing, closing
    assert run.data.params["lm_eval.task.python_facts_mc.version"] == "1.0"
    for step in (5, 10):
        names = {a.path for a in client.list_artifacts(rid, f"eval/step-{step}/lm_eval")}
        assert f"eval/step-{step}/lm_eval/samples_python_facts_mc.jsonl" in names, names
        result = client.download_artifacts(rid, f"eval/step-{step}/lm_eval/results.json", str(tmp_path / f"r{step}"))
        assert json.loads(Path(result).read_text())["limit"] == 6

    # the step-10 score is lm-eval's on the step-10 checkpoint, scored by hand on its export
    hf = tmp_path / "hf"
    exp = run_cli(["export", rid, "--step", "10", "--dtype", "fp32", "--out", str(hf)], tmp_path, cli_env)
    assert exp.returncode == 0, exp.stdout[-3000:] + exp.stderr[-3000:]
    cmd = [sys.executable, "-m", "workloads.pretrain.harness", "--hf", str(hf), "--tasks", "python_facts_mc"]
    cmd += ["--include-path", str(TASKS), "--limit", "6", "--out", str(tmp_path / "by-hand.json")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    by_hand = json.loads((tmp_path / "by-hand.json").read_text())["scores"]
    at_10 = {k: [m.value for m in client.get_metric_history(rid, k) if m.step == 10][0] for k in by_hand}
    assert at_10 == by_hand


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["eval.tasks=[python_facts_mcq]", f"eval.include_path={TASKS}"], "unknown lm-eval task 'python_facts_mcq'"),
        (["eval.tasks=[python_facts_mc]", f"eval.include_path={TASKS}", "eval.every=3"], "'eval.every': 3"),
        (["eval.tasks=[python_facts_mc]", f"eval.include_path={TASKS}", "eval.limit=0"], "'eval.limit'"),
        (["eval.tasks=[python_facts_mc]", "eval.include_path=/no/such/dir"], "eval.include_path=/no/such/dir"),
    ],
)
def test_bad_eval_tasks_are_refused_before_a_run_exists(
    cli_env: dict[str, str], tmp_path: Path, overrides: list[str], message: str
) -> None:
    out = run_cli(["launch", *TRAIN, *overrides], tmp_path, cli_env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 3 and len(lines) == 1 and message in lines[0], out.stdout[-2000:] + out.stderr[-2000:]
    db = tmp_path / "mlflow.db"
    assert not db.exists() or not mlflow_runs(f"sqlite:///{db}")  # no run was created
    assert not (tmp_path / "llmctl-runs").exists() or not any((tmp_path / "llmctl-runs").iterdir())


def test_a_misspelt_task_is_refused_without_indexing_lm_evals_tasks(cli_env: dict[str, str], tmp_path: Path) -> None:
    """lm-eval's built-in task index, summarised, comes from the summary llmctl ships for the lm-eval
    it pins (a machine's first check) or from llmctl's cache: either refuses a typo with lm-eval unable
    to index its built-ins (faults injected from here); with neither, the same fault breaks the
    check, so they are what answered."""
    args = ["launch", *TRAIN, "eval.tasks=[python_facts_mcq]", f"eval.include_path={TASKS}"]
    first = run_cli(args, tmp_path, cli_env)
    assert first.returncode == 3 and "unknown lm-eval task 'python_facts_mcq'" in first.stderr, first.stderr[-2000:]
    broken = with_faults(cli_env, LLMCTL_TEST_NO_BUILTIN_TASK_INDEX="1")
    shipped = run_cli(args, tmp_path, {**broken, "LLMCTL_CACHE_DIR": str(tmp_path / "empty-cache")})
    assert (shipped.returncode, shipped.stderr) == (3, first.stderr), shipped.stderr[-2000:]

    unshipped = {**with_faults(cli_env, LLMCTL_TEST_NO_SHIPPED_TASK_INDEX="1"), "LLMCTL_CACHE_DIR": str(tmp_path / "c")}
    built = run_cli(args, tmp_path, unshipped)  # lm-eval indexes its tasks; the summary is cached
    assert (built.returncode, built.stderr) == (3, first.stderr), built.stderr[-2000:]
    neither = {**unshipped, "LLMCTL_TEST_NO_BUILTIN_TASK_INDEX": "1"}
    cached = run_cli(args, tmp_path, neither)
    assert (cached.returncode, cached.stderr) == (3, first.stderr), cached.stderr[-2000:]
    cold = run_cli(args, tmp_path, {**neither, "LLMCTL_CACHE_DIR": str(tmp_path / "another-empty-cache")})
    assert cold.returncode != 0 and "injected fault (LLMCTL_TEST_NO_BUILTIN_TASK_INDEX)" in cold.stderr, cold.stderr


def test_plan_names_the_scored_steps_and_leaves_their_time_out(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *TRAIN, *SCORED], tmp_path, cli_env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lm-eval:     python_facts_mc at step(s) 5, 10; its time is not in the estimate below" in out.stdout
    many = run_cli(["plan", *TRAIN, "eval.tasks=[a,b]", "train.steps=1000", "checkpoint.every=100"], tmp_path, cli_env)
    assert "lm-eval:     a, b at 10 steps (every 100 and the last)" in many.stdout, many.stdout[-2000:]
