"""Which MLflow calls llmctl repeats after a "locked" error (issue #47): on a sqlite store any (SQLite's
busy error means the statement did not run), elsewhere only calls that leave the store the same when
made twice, so a retried ``create_run`` can never leave a second run nobody closes. Held against a
real MLflow client and store: the calls are MlflowClient's own methods."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient

from llmctl.tracking.mlflow_run import client, may_repeat

ONCE_ONLY = ["create_run", "create_experiment", "log_metric", "log_inputs", "create_registered_model"]
REPEATABLE = ["get_run", "search_runs", "set_tag", "delete_tag", "log_param", "set_terminated", "log_text"]


@pytest.mark.parametrize("name", ONCE_ONLY + REPEATABLE)
def test_the_policy_names_real_client_methods(name: str) -> None:
    assert inspect.isfunction(getattr(MlflowClient, name, None)), f"MlflowClient has no {name}"


@pytest.mark.parametrize("name", ONCE_ONLY)
def test_calls_that_add_something_are_made_once(name: str) -> None:
    assert not may_repeat(name, ("run-id",), {})


@pytest.mark.parametrize("name", REPEATABLE)
def test_calls_that_set_a_value_may_be_repeated(name: str) -> None:
    assert may_repeat(name, ("run-id",), {})


def test_a_batch_with_metrics_is_made_once_and_one_of_tags_may_be_repeated() -> None:
    point = Metric("loss", 1.0, 0, 0)
    assert not may_repeat("log_batch", ("run-id", [point]), {})
    assert not may_repeat("log_batch", ("run-id",), {"metrics": [point]})
    assert may_repeat("log_batch", ("run-id",), {"tags": [RunTag("a", "b")]})
    assert may_repeat("log_batch", ("run-id", []), {"tags": [RunTag("a", "b")]})


def test_an_unknown_call_is_not_repeated() -> None:
    assert not may_repeat("create_logged_model", (), {})


def test_a_sqlite_store_repeats_any_call_and_a_server_only_the_repeatable(tmp_path: Path) -> None:
    local = client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    remote = client("http://127.0.0.1:9")  # never called here: the policy is read, not exercised
    assert local._sqlite is True and remote._sqlite is False
    exp = local.create_experiment("x")
    run = local.create_run(exp)
    local.set_tag(run.info.run_id, "k", "v")
    assert local.get_run(run.info.run_id).data.tags["k"] == "v"
