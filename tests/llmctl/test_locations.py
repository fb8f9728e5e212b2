"""Every key that takes a URL or a path is checked once, before anything is created (llmctl/config/locations.py).

Through the real composition (the same path ``launch``, ``plan``, ``resume`` and sweeps take), and
once through the real CLI: a malformed location used to start a run that failed in a worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_cli

from llmctl.config.compose import compose
from llmctl.errors import ConfigError


@pytest.mark.parametrize(
    "override, key, fix",
    [
        ("checkpoint.dir=s3:/bucket/ckpt", "checkpoint.dir", "s3://bucket/ckpt"),
        ("checkpoint.dir=s3//bucket/ckpt", "checkpoint.dir", "s3://bucket/ckpt"),
        ("checkpoint.dir=s4://bucket/ckpt", "checkpoint.dir", "s3://"),
        ("checkpoint.dir=s3://", "checkpoint.dir", "no bucket"),
        ("data.source=gs:/bucket/*.jsonl", "data.source", "gs://bucket/*.jsonl"),
        ("data.source=''", "data.source", "empty"),
        ("model.init_from=hf:/meta-llama/Llama-3.2-1B", "model.init_from", "hf://meta-llama/Llama-3.2-1B"),
        ("data.tokenizer=builtin:pydoc", "data.tokenizer", "only data.source"),
        ("tracking.uri=htp://127.0.0.1:5000", "tracking.uri", "http://HOST:PORT"),
        ("tracking.uri=127.0.0.1:5000", "tracking.uri", "http://127.0.0.1:5000"),
        ("tracking.uri=http://127.0.0.1:50x0", "tracking.uri", "port"),
        ("tracking.uri=http://:5000", "tracking.uri", "names no host"),
        ("tracking.uri=sqlite://mlflow.db", "tracking.uri", "sqlite:///"),
    ],
)
def test_a_malformed_location_is_refused_naming_the_key_and_the_fix(override: str, key: str, fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose(["experiment=smoke", override])
    assert f"'{key}'" in str(err.value) and fix in str(err.value), str(err.value)


def test_a_missing_local_input_is_refused_on_local_infra(tmp_path: Path) -> None:
    for override in (
        f"model.init_from={tmp_path / 'nowhere'}",
        f"data.tokenizer={tmp_path / 'tok.json'}",
        f"data.source={tmp_path}/none/*.txt",
    ):
        with pytest.raises(ConfigError, match="does not exist on this machine"):
            compose(["experiment=smoke", override])


@pytest.mark.parametrize(
    "override",
    [
        "checkpoint.dir=s3://bucket/runs/a",
        "checkpoint.dir=gs://b/x",
        "checkpoint.dir=simplecache::s3://b/x",
        "checkpoint.dir=memory:///ckpt",
        "checkpoint.dir=./relative/ckpt",
        "data.source=builtin:pydoc",
        "data.source=s3://bucket/corpus/*.jsonl",
        "data.source=hf://datasets/org/name/*.jsonl",
        "tracking.uri=http://127.0.0.1:5000",
        "tracking.uri=https://mlflow.example.com",
        "tracking.uri=sqlite:///mlflow.db",
        "tracking.uri=sqlite:////tmp/x/mlflow.db",
        "tracking.uri=postgresql+psycopg2://u:p@db:5432/mlflow",
        "tracking.uri=./mlruns",
        "tracking.uri=databricks",
    ],
)
def test_well_formed_locations_pass(override: str) -> None:
    compose(["experiment=smoke", override])


def test_launch_refuses_before_anything_is_created(cli_env: dict[str, str], tmp_path: Path) -> None:
    cwd = tmp_path / "work"
    cwd.mkdir()
    out = run_cli(["launch", "experiment=smoke", "checkpoint.dir=s3:/bucket/ckpt"], cwd, cli_env)
    assert out.returncode == 3 and "s3://bucket/ckpt" in out.stderr and "Traceback" not in out.stderr, out.stderr
    bad_store = run_cli(["launch", "experiment=smoke", "tracking.uri=sqlite://mlflow.db"], cwd, cli_env)
    assert bad_store.returncode == 3 and "Traceback" not in bad_store.stderr, bad_store.stderr
    assert sorted(p.name for p in cwd.iterdir()) == [], "no store, no run directory, nothing"
