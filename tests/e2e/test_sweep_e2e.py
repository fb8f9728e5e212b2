"""``llmctl launch -m`` end to end: real supervisor, real torchrun trials, one real sqlite store."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_outcome, controller_codes, run_cli

from llmctl.run.outcomes import Outcome

pytestmark = pytest.mark.slow

STEPS, LOG_EVERY, VAL_EVERY = 4, 1, 2
TINY = [
    "experiment=smoke",
    f"train.steps={STEPS}",
    f"train.log_every={LOG_EVERY}",
    f"train.val_every={VAL_EVERY}",
    "checkpoint.every=0",
    "train.val_batches=1",
]


def _client(tmp: Path) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")


def _sweep_runs(tmp: Path) -> tuple[Any, list[Any]]:
    mc = _client(tmp)
    runs = mc.search_runs([e.experiment_id for e in mc.search_experiments()])
    [parent] = [r for r in runs if r.data.tags.get("llmctl.kind") == "sweep"]
    children = sorted(
        (r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id),
        key=lambda r: int(r.data.tags["llmctl.trial"]),
    )
    return parent, children


def _sweep_id(stdout: str) -> str:
    return next(w.rstrip(":") for w in stdout.split() if w.startswith("sweep-"))


def _processes_mentioning(*needles: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if any(n in line for n in needles) and "ps -eo" not in line]


def test_sweep_of_four_trials_two_at_a_time(cli_env: dict[str, str], tmp_path: Path) -> None:
    t0 = time.monotonic()
    env = {k: v for k, v in cli_env.items() if k != "OMP_NUM_THREADS"}  # the supervisor splits the cores
    out = run_cli(
        ["launch", "-m", "--max-parallel", "2", "--wait", *TINY, "train.lr=1e-3,3e-4", "train.seed=0,1"], tmp_path, env
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    sid = _sweep_id(out.stdout)
    parent, children = _sweep_runs(tmp_path)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["llmctl.sweep_id"] == sid and parent.data.params["sweep.max_parallel"] == "2"
    assert [c.info.status for c in children] == ["FINISHED"] * 4
    assert [c.data.tags["llmctl.trial.overrides"].split()[-2:] for c in children] == [
        ["train.lr=0.001", "train.seed=0"],
        ["train.lr=0.001", "train.seed=1"],
        ["train.lr=0.0003", "train.seed=0"],
        ["train.lr=0.0003", "train.seed=1"],
    ]
    assert {c.data.tags["llmctl.sweep_id"] for c in children} == {sid}
    assert [c.data.params["train.lr"] for c in children] == ["0.001", "0.001", "0.0003", "0.0003"]

    # no metric point lost: 4 trials wrote one sqlite file at the same time
    mc = _client(tmp_path)
    for c in children:
        train = mc.get_metric_history(c.info.run_id, "train/loss")
        val = mc.get_metric_history(c.info.run_id, "val/loss")
        tok = mc.get_metric_history(c.info.run_id, "perf/tokens_per_s")
        assert sorted(m.step for m in train) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
        assert sorted(m.step for m in val) == list(range(0, STEPS + 1, VAL_EVERY))
        assert len(tok) == STEPS // LOG_EVERY

    # two trials at once each took half the cores (the trainer once ignored the supervisor's split)
    share = max(1, (os.cpu_count() or 1) // 2)
    for c in children:
        log = (tmp_path / "llmctl-runs" / c.info.run_id / "output.log").read_text()
        assert f"world 1 on cpu ({share} threads/proc)" in log, log[-2000:]

    # at most two trials trained at once (first and last metric timestamps of each)
    spans = []
    for c in children:
        ts = [m.timestamp for key in ("val/loss", "train/loss") for m in mc.get_metric_history(c.info.run_id, key)]
        spans.append((min(ts), max(ts)))
    for s, _ in spans:
        assert sum(1 for a, b in spans if a <= s <= b) <= 2, spans

    # the best trial, by val/loss (min), is named and tagged
    best = min(children, key=lambda c: c.data.metrics["val/loss"])
    assert parent.data.tags["llmctl.sweep.best_run_id"] == best.info.run_id
    # and its metrics are the parent's own, so a runs table sorts sweeps by result (issue #34, item 9)
    parent_metrics = mc.get_run(parent.info.run_id).data.metrics
    assert parent_metrics["val/loss"] == best.data.metrics["val/loss"]
    assert parent_metrics["train/loss"] == best.data.metrics["train/loss"]
    assert not [k for k in parent_metrics if k.startswith("cost/")], "the parent is no second bill"
    assert f"run {best.info.run_id}" in out.stdout
    # piped, the final table keeps every value whole (rich's 80 columns cut them: issue #34, item 8)
    final = out.stdout.rsplit(f"{sid}: FINISHED\n", 1)[-1]
    rows = [ln for ln in final.splitlines() if ln.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    assert len(rows) == 4 and all("FINISHED" in ln for ln in rows) and "…" not in out.stdout, out.stdout
    assert all(c.info.run_id[:12] in final and c.data.params["train.lr"] in final for c in children), final

    status = run_cli(["status", sid], tmp_path, cli_env)
    assert status.returncode == 0, status.stderr
    assert "supervisor exited" in status.stdout and "4 FINISHED" in status.stdout
    assert status.stdout.count("FINISHED") >= 5 and "best:" in status.stdout
    assert "total cost:  $0.00" in status.stdout  # local infra: price_per_gpu_hour 0
    for c in children:
        assert c.info.run_id[:12] in status.stdout
    assert _processes_mentioning(sid, *(c.info.run_id for c in children)) == []
    print(f"4-trial sweep: {time.monotonic() - t0:.1f} s")


def test_failing_trial_does_not_stop_the_others(cli_env: dict[str, str], tmp_path: Path) -> None:
    # data.val_fraction=0.000001 passes the schema but leaves the workload no validation batch:
    # that one trial fails at start, at run time, like a real bad hyperparameter would
    out = run_cli(
        [
            "launch",
            "-m",
            "--max-parallel",
            "2",
            "--wait",
            *TINY,
            "train.steps=2",
            "data.val_fraction=0.05,0.04,0.000001,0.03",
        ],
        tmp_path,
        cli_env,
    )
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    parent, children = _sweep_runs(tmp_path)
    assert [c.info.status for c in children] == ["FINISHED", "FINISHED", "FAILED", "FINISHED"]
    assert "exited with code" in children[2].data.tags["llmctl.status"]
    assert parent.info.status == "FAILED" and "1 FAILED" in parent.data.tags["llmctl.status"]
    assert "3 FINISHED" in parent.data.tags["llmctl.status"]


def test_down_cancels_running_and_pending_trials(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(
        ["launch", "-m", "--max-parallel", "2", *TINY, "train.steps=100000", "train.seed=0,1,2"], tmp_path, cli_env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    sid = _sweep_id(out.stdout)  # returned at once: the sweep runs in the background
    sdir = tmp_path / "llmctl-runs" / "sweeps" / sid
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # until both running trials are really training
        state = json.loads((sdir / "state.json").read_text()) if (sdir / "state.json").exists() else {"trials": {}}
        logs = [
            tmp_path / "llmctl-runs" / t["run_id"] / "output.log"
            for t in state["trials"].values()
            if t["state"] == "RUNNING"
        ]
        if len(logs) == 2 and all(p.exists() and "step" in p.read_text() for p in logs):
            break
        time.sleep(1)
    else:
        pytest.fail("trials did not start training: " + (sdir / "supervisor.log").read_text())
    status = run_cli(["status", sid], tmp_path, cli_env)
    assert "2 RUNNING" in status.stdout and "1 PENDING" in status.stdout, status.stdout

    down = run_cli(["down", sid], tmp_path, cli_env, timeout=180)
    assert down.returncode == 0, down.stderr
    assert "3 KILLED" in down.stdout
    parent, children = _sweep_runs(tmp_path)
    assert parent.info.status == "KILLED"
    assert [c.info.status for c in children] == ["KILLED"] * 3
    # the running trials: the supervisor's SIGTERM reached their workers, which saved and stopped
    codes = controller_codes(tmp_path, sid)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for child in children[:2]:
        assert_outcome(
            uri, child.info.run_id, Outcome.PREEMPTED, codes[int(child.data.tags["llmctl.trial"])], attempt=1
        )
    # the pending one never ran: closed without an attempt
    assert children[2].data.tags["llmctl.status"] == "sweep cancelled before this trial started"
    assert "llmctl.attempt" not in children[2].data.tags
    # eval/export say what these are: the parent (naming its trials) and a trial that never started
    ev = run_cli(["eval", parent.info.run_id], tmp_path, cli_env)
    assert ev.returncode == 3 and f"is the parent of sweep {sid}" in ev.stderr, ev.stderr
    assert all(c.info.run_id[:12] in ev.stderr for c in children[:2]) and children[2].info.run_id[:12] not in ev.stderr
    ex = run_cli(["export", children[2].info.run_id], tmp_path, cli_env)
    assert ex.returncode == 3 and f"is trial 2 of sweep {sid}, which never started" in ex.stderr, ex.stderr
    assert "config.yaml" not in ev.stderr + ex.stderr
    assert not (tmp_path / "llmctl-runs" / parent.info.run_id).exists()  # refused before any eval directory
    assert _processes_mentioning(sid, *(c.info.run_id for c in children)) == []


def test_a_sweep_picks_and_reports_trials_by_a_benchmark_score(cli_env: dict[str, str], tmp_path: Path) -> None:
    """``eval.tasks`` in a sweep: every trial scores its final checkpoint with lm-eval, the sweep picks
    its best by that score (``--metric eval/<task>/<metric> --mode min``: bits per byte of a rolling
    log-likelihood task, a continuous score the two trials do not tie on), and the parent reports it."""
    from helpers import ROOT

    tasks = ROOT / "examples" / "eval-tasks"
    env = {k: v for k, v in cli_env.items() if k != "OMP_NUM_THREADS"}
    scored = ["eval.tasks=[python_facts_ppl]", f"eval.include_path={tasks}", "eval.limit=6"]
    metric = "eval/python_facts_ppl/bits_per_byte"
    args = ["launch", "-m", "--max-parallel", "2", "--wait", "--metric", metric, "--mode", "min", *TINY, *scored]
    out = run_cli([*args, "train.seed=0,1"], tmp_path, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    parent, children = _sweep_runs(tmp_path)
    mc = _client(tmp_path)
    scores = {}
    for c in children:
        history = mc.get_metric_history(c.info.run_id, metric)
        assert [m.step for m in history] == [STEPS], history  # checkpoint.every=0: the final checkpoint only
        scores[c.info.run_id] = history[0].value
    assert len(set(scores.values())) == 2, scores  # distinct: the pick below can be wrong
    best = parent.data.tags["llmctl.sweep.best_run_id"]
    assert scores[best] == min(scores.values())
    assert mc.get_run(parent.info.run_id).data.metrics[metric] == min(scores.values())  # the parent's own
    final = out.stdout.rsplit(": FINISHED\n", 1)[-1]
    lines = final.splitlines()
    assert any(metric in ln.split() for ln in lines), final  # the score's own column
    for c in children:  # each trial's row shows its score
        row = next(ln for ln in lines if c.info.run_id[:12] in ln)
        assert f"{scores[c.info.run_id]:.4f}" in row.split(), (row, scores)
