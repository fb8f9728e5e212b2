"""The tables of ``runs``, ``cost``, ``status`` and a sweep's status tell the same story and keep
their values whole (issue #34, item 8), read from a real sqlite MLflow store holding runs as launch,
a sweep and the ledger leave them."""

from __future__ import annotations

import time
from typing import Any

import pytest

from llmctl.cost import ledger, report

H = 3600.0
LONG_NAME = "lr=0.0031622776601683794,warmup_steps=5,seed=1"  # a search trial's name before #34


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, str]:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('tables') / 'mlflow.db'}"
    mc = MlflowClient(uri)
    return uri, mc, mc.create_experiment("tables")


def _ran(mc: Any, exp: str, name: str, tags: dict[str, str] | None = None) -> str:
    """A run that trained: one attempt of one H100 at $3/h for an hour."""
    rid = mc.create_run(
        exp, run_name=name, tags={"llmctl.infra": "lambda", "llmctl.accelerator": "H100:1", **(tags or {})}
    ).info.run_id
    t0 = time.time() - 2 * H
    n = ledger.open_attempt(mc, rid, usd_per_hour=3.0, nodes=1, devices=1, start=t0)
    ledger.close_attempt(mc, rid, n, t0 + H)
    return rid


def test_runs_keeps_a_trial_name_whole(store: tuple[str, Any, str]) -> None:
    uri, mc, exp = store
    rid = _ran(mc, exp, LONG_NAME)
    text = report.runs_table([report.run_row(mc.get_run(rid), "tables")])
    assert LONG_NAME in text, text  # cut to 24 characters, the second key's value was lost


def test_a_sweep_parent_and_a_trial_never_started_are_not_runs_of_cost(store: tuple[str, Any, str]) -> None:
    uri, mc, exp = store
    trained = _ran(mc, exp, "trained")
    parent = mc.create_run(exp, run_name="sweep-x", tags={"llmctl.kind": "sweep", "llmctl.infra": "lambda"}).info.run_id
    never = mc.create_run(exp, run_name="pending", tags={"llmctl.kind": "trial", "llmctl.infra": "lambda"}).info.run_id
    rows = {r["run_id"]: r for r in report.runs_rows(uri, experiment="tables")}
    assert rows[trained]["accelerator"] == "H100:1"
    assert rows[parent]["accelerator"] == rows[never]["accelerator"] == "-", "never ran: no unknown accelerator"
    by_acc = {g["accelerator"]: g for g in report.cost_rows(uri, by="accelerator")}
    assert "?" not in by_acc and "-" not in by_acc, by_acc
    assert by_acc["TOTAL"]["runs"] == by_acc["H100:1"]["runs"], "only runs that ran are counted"


def test_a_pruned_trial_reads_pruned_in_every_listing(store: tuple[str, Any, str]) -> None:
    from llmctl.tracking import runs

    uri, mc, exp = store
    rid = _ran(mc, exp, "pruned-trial", {"llmctl.kind": "trial", "llmctl.pruned": "4"})
    mc.set_terminated(rid, "KILLED")
    run = mc.get_run(rid)
    assert "PRUNED" in report.runs_table([report.run_row(run, "tables")])
    listing = runs.table([run])
    assert "PRUNED" in listing and "KILLED" not in listing, listing


def test_a_sweep_table_shows_searched_floats_short_and_the_steady_tokens_per_s(store: tuple[str, Any, str]) -> None:
    from mlflow.entities import Metric

    from llmctl.sweep import state

    uri, mc, exp = store
    rid = _ran(mc, exp, "searched")
    # the newest logged point is a slow step; the close recorded the steady figure `runs` shows
    mc.log_batch(rid, metrics=[Metric("perf/tokens_per_s", 1223.0, 0, 10), Metric("val/loss", 2.5, 0, 10)])
    mc.log_batch(rid, tags=ledger.figure_tags({"perf/tokens_per_s_steady": 1819.0}))
    run = mc.get_run(rid)
    trials = [
        state.TrialStatus(0, ["train.lr=0.0031622776601683794"], rid, "FINISHED", state._key_metrics(run, "val/loss")),
        state.TrialStatus(1, ["train.lr=0.01"], None, "PENDING", {}),
    ]
    st = state.SweepStatus(
        spec={"sweep_id": "s", "parent_run_id": "p", "overrides": [], "metric": "val/loss", "mode": "min"},
        parent_status="FINISHED",
        supervisor_alive=False,
        trials=trials,
    )
    header, rows = st.rows()
    assert rows[0][header.index("train.lr")] == "0.003162" and rows[1][header.index("train.lr")] == "0.01"
    assert rows[0][header.index("tok/s")] == "1,819", rows[0]
    assert report.runs_table([report.run_row(run, "tables")]).count("1,819") == 1
    assert "(train.lr=0.003162)" in st.best_line()


def test_status_prints_the_estimate_source_whole(store: tuple[str, Any, str]) -> None:
    from llmctl.cost import hooks

    uri, mc, exp = store
    source = (
        "prior: 40% MFU of the H100's 989 TFLOP/s bf16 peak (fixed; no earlier run of this shape), "
        "full activation recompute counted as one more forward (4/3 of the FLOPs)"
    )
    rid = _ran(mc, exp, "estimated", {"llmctl.estimate.source": source})
    mc.log_batch(rid, tags=ledger.figure_tags({"cost/estimate_usd": 3.0, "time/estimate_h": 1.0}))
    lines = hooks.status_lines(uri, mc.get_run(rid))
    assert any(source in ln for ln in lines), lines


def test_the_closing_line_says_when_a_run_was_slower_than_estimated(store: tuple[str, Any, str]) -> None:
    """Issue #34, item 10: the plan estimated 89 s, the run took 210 s, and nothing said so."""
    from llmctl.tracking.mlflow_run import RunHandle, summary

    uri, mc, exp = store
    rid = _ran(mc, exp, "estimated-89s")
    mc.log_batch(rid, tags=ledger.figure_tags({"time/estimate_h": 89 / H}))
    handle = RunHandle(uri=uri, run_id=rid, experiment_id=exp)
    assert summary(handle, 210.0) == f"llmctl: run {rid} FINISHED in 210 s (estimated 89 s: 2.4x slower)"
    assert summary(handle, 100.0) == f"llmctl: run {rid} FINISHED in 100 s (estimated 89 s)"
    unplanned = RunHandle(uri=uri, run_id=_ran(mc, exp, "no-estimate"), experiment_id=exp)
    assert summary(unplanned, 100.0).endswith("FINISHED in 100 s")
