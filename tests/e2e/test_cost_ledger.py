"""The ledger (attempts summed, preemptions included), the budget refusal through the real CLI, the
``runs``/``cost`` reports against a real sqlite MLflow store, and the workload guard's arithmetic."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli

from llmctl.cost import hooks, ledger

H = 3600.0


def _store(tmp_path: Path) -> tuple[str, Any, str]:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mc = MlflowClient(uri)
    return uri, mc, mc.create_experiment("pretrain")


def _run(
    mc: Any,
    exp: str,
    *,
    infra: str,
    accelerator: str,
    attempts: list[tuple[float, float, float, int, int]],
    steps: int,
    estimate: float,
    start_ms: int | None = None,
) -> str:
    """A run as launch leaves it: params, tags, one train/loss point at its last step, ledger attempts."""
    from mlflow.entities import Metric, Param

    rid = mc.create_run(
        exp, start_time=start_ms, tags={"llmctl.infra": infra, "llmctl.accelerator": accelerator}
    ).info.run_id
    mc.log_batch(
        rid,
        params=[
            Param("train.batch_size", "64"),
            Param("train.seq_len", "1000"),
            Param("train.steps", str(steps)),
            Param("infra.nodes", "1"),
        ],
        metrics=[Metric("train/loss", 2.0, 0, steps), Metric("cost/estimate_usd", estimate, 0, 0)],
    )
    for start, end, price, nodes, devices in attempts:
        n = ledger.open_attempt(mc, rid, usd_per_hour=price, nodes=nodes, devices=devices, start=start)
        ledger.close_attempt(mc, rid, n, end)
    mc.set_terminated(rid, "FINISHED")
    return rid


def test_ledger_sums_two_attempts(tmp_path: Path) -> None:
    _, mc, exp = _store(tmp_path)
    t0 = 1_790_000_000.0
    # attempt 1: 1 node of 8 GPUs at $32/h for 2 h, preempted; attempt 2 (recovery): 2 nodes at $64/h for 30 min
    rid = _run(
        mc,
        exp,
        infra="aws",
        accelerator="H100:8",
        steps=1000,
        estimate=100.0,
        attempts=[(t0, t0 + 2 * H, 32.0, 1, 8), (t0 + 2 * H + 600, t0 + 2.5 * H + 600, 64.0, 2, 16)],
    )
    led = ledger.update(mc, rid)
    assert [a.n for a in led.attempts] == [1, 2]
    assert led.actual_usd == pytest.approx(2 * 32 + 0.5 * 64)  # the 10 min between attempts is not billed
    assert led.device_hours == pytest.approx(2 * 8 + 0.5 * 16)
    assert led.tokens == 1000 * 64 * 1000
    run = mc.get_run(rid)
    m = {k: float(v) for k, v in run.data.tags.items() if k.startswith("cost/")}  # every figure a tag
    assert m["cost/actual_usd"] == pytest.approx(96.0)
    assert m["cost/device_hours"] == pytest.approx(24.0)
    assert m["cost/usd_per_1m_tokens"] == pytest.approx(96.0 / 64.0)
    # the ones a runs table sorts by also as metrics (issue #34, item 9), at the attempt count's step
    charted = {k: v for k, v in run.data.metrics.items() if k.startswith("cost/") and k != "cost/estimate_usd"}
    sorted_by = ("cost/actual_usd", "cost/device_hours", "cost/usd_per_1m_tokens")
    assert charted == pytest.approx({k: m[k] for k in sorted_by})
    assert [h.step for h in mc.get_metric_history(rid, "cost/actual_usd")] == [2]
    # a third attempt (a resume) appends; while open it counts up to now
    n = ledger.open_attempt(mc, rid, usd_per_hour=36.0, nodes=1, devices=8, start=time.time() - 0.5 * H)
    assert n == 3
    live = ledger.compute(mc.get_run(rid).data.tags)
    assert live.open and live.actual_usd == pytest.approx(96.0 + 18.0, abs=0.1)


def test_reports_from_mlflow(cli_env: dict[str, str], tmp_path: Path) -> None:
    uri, mc, exp = _store(tmp_path)
    now = time.time()
    old_ms = int((now - 30 * 86400) * 1000)
    _run(
        mc,
        exp,
        infra="aws",
        accelerator="H100:8",
        steps=100,
        estimate=30.0,
        attempts=[(now - 2 * H, now - H, 32.0, 1, 8)],
    )
    _run(
        mc,
        exp,
        infra="lambda",
        accelerator="H100:8",
        steps=100,
        estimate=10.0,
        attempts=[(now - 3 * H, now - 2.5 * H, 24.0, 1, 8), (now - 2 * H, now - 1.5 * H, 24.0, 1, 8)],
    )
    _run(
        mc,
        exp,
        infra="aws",
        accelerator="A100:8",
        steps=100,
        estimate=5.0,
        start_ms=old_ms,
        attempts=[(now - 30 * 86400, now - 30 * 86400 + H, 20.0, 1, 8)],
    )
    _run(
        mc,
        exp,
        infra="slurm",
        accelerator="H100:8",
        steps=100,
        estimate=0.0,  # unpriced: not a $0 run
        attempts=[(now - H, now - 0.5 * H, None, 1, 8)],
    )
    env = {**cli_env, "MLFLOW_TRACKING_URI": uri}

    out = run_cli(["cost", "--by", "infra", "--since", "7d", "--json"], tmp_path, env)
    assert out.returncode == 0, out.stderr
    rows = {r["infra"]: r for r in json.loads(out.stdout)}
    assert rows["aws"]["actual_usd"] == pytest.approx(32.0) and rows["aws"]["runs"] == 1  # the old run is out
    assert rows["slurm"]["unpriced_runs"] == 1 == rows["TOTAL"]["unpriced_runs"] and rows["aws"]["unpriced_runs"] == 0
    assert "1 (1 unpriced)" in run_cli(["cost", "--by", "infra"], tmp_path, env).stdout
    assert rows["lambda"]["actual_usd"] == pytest.approx(24.0) and rows["lambda"]["estimate_usd"] == 10.0
    assert rows["TOTAL"]["actual_usd"] == pytest.approx(56.0)
    out = run_cli(["cost", "--by", "accelerator"], tmp_path, env)
    assert out.returncode == 0 and "A100:8" in out.stdout, out.stdout
    assert "$56.00" in out.stdout and "$76.00" in out.stdout  # all time: H100 32 + 24, total + A100 20
    out = run_cli(["runs", "--json"], tmp_path, env)
    runs = json.loads(out.stdout)
    assert len(runs) == 4 and {r["attempts"] for r in runs} == {1, 2}
    table = run_cli(["runs", "--since", "1d"], tmp_path, env).stdout
    assert "3 run(s)" in table and "lambda" in table and "$24.00" in table and "$10.00" in table
    bad = run_cli(["cost", "--since", "yesterday"], tmp_path, env)
    assert bad.returncode == 3 and "--since" in bad.stderr


def test_max_cost_refusal_creates_nothing(cli_env: dict[str, str], tmp_path: Path) -> None:
    args = ["experiment=smoke", "train.steps=100000", "infra.price_per_gpu_hour=50"]
    shown = run_cli(["plan", *args, "--max-cost", "0.5"], tmp_path, cli_env)
    assert shown.returncode == 0 and "OVER: launch will refuse" in shown.stdout, shown.stderr
    out = run_cli(["launch", *args, "--max-cost", "0.5"], tmp_path, cli_env)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "exceeds --max-cost $0.50" in out.stderr and "nothing was launched" in out.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()
    assert not (tmp_path / "llmctl-runs").exists()


def test_guard_projection() -> None:
    from workloads.pretrain.components.budget import BudgetGuard

    g = BudgetGuard(max_cost=1.0, usd_per_hour=36.0, billing_start=1000.0, spent_before=0.2)  # $0.01/s
    assert g.spent(1050.0) == pytest.approx(0.7)
    assert not g.over(1050.0, step_s=10.0)  # 0.7 + (10 + 10) s x $0.01 = 0.9
    assert g.over(1050.0, step_s=20.0)  # 0.7 + (20 + 20) s x $0.01 = 1.1
    assert g.over(1076.0, step_s=0.1)  # 0.96 + (0.1 + 5 s reserve) x $0.01 = 1.011
    assert not g.over(1070.0, step_s=0.1)  # 0.9 + 0.051 = 0.951
    assert not BudgetGuard.from_env({}).active
    assert not BudgetGuard.from_env({"LLMCTL_MAX_COST_USD": "5", "LLMCTL_PRICE_PER_HOUR": "0"}).active


def test_each_attempt_of_a_run_over_candidates_is_billed_at_what_served_it(tmp_path: Path) -> None:
    """``infra.candidates``: an attempt opens at the dearest candidate's price; the node's start says
    where SkyPilot put it (``SKYPILOT_CLUSTER_INFO``), and the ledger bills the candidate that is, in
    that region. A managed job's recovery onto another candidate is a second attempt at its own price."""
    import json

    from mlflow.entities import RunTag

    _, mc, exp = _store(tmp_path)
    t0 = 1_790_000_000.0
    rid = _run(mc, exp, infra="lambda", accelerator="H100:8", steps=10, estimate=1.0, attempts=[])
    table = [
        {"label": "lambda H100:8", "provider": "lambda", "region": None, "zone": None, "spot": False,
         "regions": {"us-east-1": 31.92}, "usd_per_hour": 31.92},
        {"label": "aws H100:8 spot", "provider": "aws", "region": None, "zone": None, "spot": True,
         "regions": {"us-east-1": 19.25, "us-west-2": 12.69}, "usd_per_hour": 12.69},
        {"label": "slurm p2", "provider": "slurm", "region": "c1", "zone": "p2", "spot": False,
         "regions": {}, "usd_per_hour": 2.0},
    ]  # fmt: skip
    mc.set_tag(rid, ledger.TAG_CANDIDATES, json.dumps(table))
    n = ledger.open_attempt(mc, rid, usd_per_hour=31.92, nodes=1, devices=8, start=t0)

    def start(k: int, at: float, where: dict[str, Any]) -> None:
        value = {"time": at, "attempt": n, "from_step": 0, "world_size": 8, "where": where}
        mc.log_batch(rid, tags=[RunTag(f"llmctl.workload_start.{k}", json.dumps(value))])

    start(1, t0 + 60, {"cloud": "aws", "region": "us-west-2", "zone": "us-west-2a"})
    start(2, t0 + H, {"cloud": "slurm", "region": "c1", "zone": "p2"})  # recovered onto another candidate
    ledger.reconcile(mc, rid)
    ledger.close_open(mc, rid, t0 + 3 * H)
    tags = mc.get_run(rid).data.tags
    assert tags["llmctl.attempt.1.served"] == "aws H100:8 spot (aws/us-west-2/us-west-2a)"
    assert tags["llmctl.attempt.2.served"] == "slurm p2 (slurm/c1/p2)"
    led = ledger.compute(tags)
    assert [a.usd_per_hour for a in led.attempts] == [12.69, 2.0]
    assert led.actual_usd == pytest.approx(1 * 12.69 + 2 * 2.0)
    assert hooks.served_lines(led, tags) == [  # what `llmctl status RUN` adds
        "attempt 1:   aws H100:8 spot (aws/us-west-2/us-west-2a), $12.69/h",
        "attempt 2:   slurm p2 (slurm/c1/p2), $2.00/h",
    ]
    ledger.reconcile(mc, rid)  # idempotent: nothing billed twice
    assert ledger.compute(mc.get_run(rid).data.tags).actual_usd == pytest.approx(led.actual_usd)
    # a start nobody listed keeps the dearest price, and says so
    assert ledger.served_by(table, {"cloud": "runpod", "region": "US", "zone": None}) is None
