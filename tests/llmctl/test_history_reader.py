"""The calibration history without importing mlflow: the sqlite reader and the REST reader return what
``MlflowClient.search_runs`` returns (the oracle) from a real sqlite store and a real ``mlflow server``
(basic auth on), and ``llmctl plan`` finds a measured run without importing mlflow at all."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from helpers import mlflow_server

from llmctl.cost import history

SHAPE, ACC = "d64-L2-H4-KV4-V512-F256-tie0-T64-fp32-fused-tp1-acnone", "cpu"
ADMIN, PASSWORD = "admin", "llmctl-test-pw-1"
QUERIES = [(SHAPE, ACC), (SHAPE, "H100:8"), ("d128-other", ACC), ("no-such-shape", ACC), (None, ACC), (None, "TPU")]


def _populate(mc: Any) -> None:
    """Runs llmctl would find and runs it must not: wrong status, deleted, other shape or accelerator,
    a deleted experiment; equal start times (search_runs breaks ties by run id), metrics logged out of
    step order (the latest is the highest step), a NaN."""
    from mlflow.entities import Metric, Param

    def run(
        exp: str,
        start: int,
        shape: str = SHAPE,
        acc: str = ACC,
        status: str = "FINISHED",
        steady: float = 1000.0,
        nodes: int = 1,
    ) -> str:
        tags = {
            history.TAG_SHAPE: shape,
            history.TAG_ACCELERATOR: acc,
            history.TAG_FLOPS: str(start * 7),
            "other.tag": "x",
        }
        if (start // 1000) % 2:  # some runs: the figures as tags (over the metrics older runs logged)
            tags.update({history.STEADY: repr(steady * 2), history.WALL: "12.5"})
        r = mc.create_run(exp, start_time=start, tags=tags)
        rid = r.info.run_id
        mc.log_batch(
            rid,
            metrics=[
                Metric(history.STEADY, steady, 5, 2),
                Metric(history.STEADY, -1.0, 9, 1),
                Metric(history.OVERHEAD, steady / 100, 5, 0),
                Metric("train/steps_done", float(start % 97), 5, 0),
            ],
            params=[Param("infra.nodes", str(nodes)), Param("train.batch_size", str(8 + start % 3))],
        )
        if status != "RUNNING":
            mc.set_terminated(rid, status=status)
        return rid

    a, b, gone = (mc.create_experiment(n) for n in ("a", "b", "gone"))
    for i, start in enumerate([1000, 2000, 3000, 3000, 3000, 4000]):
        run(a, start, steady=1000.0 + i, nodes=1 + i % 2)
    nan = run(a, 5000)
    mc.log_metric(nan, history.VAL_PASS, float("nan"), timestamp=6, step=0)
    for status in ("RUNNING", "FAILED", "KILLED"):
        run(a, 9000, status=status)
    mc.delete_run(run(a, 9500))
    run(a, 9100, shape="d128-other")
    run(a, 9200, acc="H100:8")
    run(b, 3000, steady=7.0)
    run(b, 6000, steady=8.0)
    run(gone, 9900)
    mc.delete_experiment(gone)


def _oracle(mc: Any, shape: str, acc: str, limit: int) -> list[tuple[Any, ...]]:
    exps = mc.search_experiments()
    runs = mc.search_runs(
        [e.experiment_id for e in exps],
        history._filter(shape, acc),
        max_results=limit,
        order_by=["attributes.start_time DESC"],
    )
    return [
        _row(
            r.info.run_id,
            r.info.start_time,
            r.info.status,
            r.data.params,
            r.data.metrics,
            {k: v for k, v in r.data.tags.items() if k in history._TAGS_READ},
        )
        for r in runs
    ]


def _row(
    run_id: str, start: Any, status: str, params: dict[str, str], metrics: dict[str, float], tags: dict[str, str]
) -> tuple[Any, ...]:
    nan_safe = {k: ("nan" if math.isnan(v) else v) for k, v in metrics.items()}
    return run_id, start, status, dict(params), nan_safe, dict(tags)


def _read(uri: str, shape: str, acc: str) -> list[tuple[Any, ...]]:
    return [
        _row(c.run_id, c.start_time, c.status, c.params, c.metrics, c.tags) for c in history.candidates(uri, shape, acc)
    ]


def _same_as_oracle(mc: Any, uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for limit in (history.MAX_CANDIDATES, 4):  # 4: the limit cuts through the tied start times
        monkeypatch.setattr(history, "MAX_CANDIDATES", limit)
        for shape, acc in QUERIES:
            expected = _oracle(mc, shape, acc, limit)
            assert _read(uri, shape, acc) == expected, (shape, acc, limit)
    assert len(_oracle(mc, SHAPE, ACC, 50)) == 9  # 7 in a, 2 in b: the test data says what it means to
    assert len(_oracle(mc, None, ACC, 50)) == 10  # ... and the other shape's run when any shape will do


def test_sqlite_reader_equals_search_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mc = MlflowClient(tracking_uri=uri)
    _populate(mc)
    import sqlite3

    calls: list[str] = []
    real = history._client_candidates
    monkeypatch.setattr(history, "_client_candidates", lambda *a: calls.append("client") or real(*a))
    _same_as_oracle(mc, uri, monkeypatch)
    assert calls == []  # answered by sqlite3, not by MlflowClient
    before = (tmp_path / "mlflow.db").stat().st_mtime_ns
    with pytest.raises(sqlite3.OperationalError):  # read-only: a missing file is not created
        history._sqlite_candidates(str(tmp_path / "absent.db"), SHAPE, ACC)
    assert not (tmp_path / "absent.db").exists() and (tmp_path / "mlflow.db").stat().st_mtime_ns == before


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``mlflow server --app-name basic-auth`` on 127.0.0.1 (its users in a temp sqlite file)."""
    pytest.importorskip("flask_wtf", reason="mlflow[auth] (the dev extra) runs the basic-auth server")
    root = tmp_path_factory.mktemp("mlflow-auth")
    ini = root / "auth.ini"
    ini.write_text(
        f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{root / 'users.db'}\n"
        f"admin_username = {ADMIN}\nadmin_password = {PASSWORD}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        "auth_cache_ttl_seconds = 600\n"
    )  # one password hash per client, not per request
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update({"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": "llmctl-test-only"})
    with mlflow_server(root, "--app-name", "basic-auth", env=env, startup_s=180) as uri:
        yield uri


def test_rest_reader_equals_search_runs(auth_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    for k in [k for k in os.environ if k.startswith("MLFLOW_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.mlflow/credentials but the one written below
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    mc = MlflowClient(tracking_uri=auth_server)
    _populate(mc)
    monkeypatch.setattr(history, "_client_candidates", lambda *a: pytest.fail("MlflowClient was asked"))
    _same_as_oracle(mc, auth_server, monkeypatch)

    monkeypatch.setattr(history, "MAX_CANDIDATES", 50)
    expected = _oracle(mc, SHAPE, ACC, 50)
    with_userinfo = auth_server.replace("http://", f"http://{ADMIN}:{PASSWORD}@")
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME")
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    assert _read(with_userinfo, SHAPE, ACC) == expected  # credentials in the URL, as requests reads them
    with pytest.raises(urllib.error.HTTPError) as err:  # the server does check: no credentials, no runs
        history.candidates(auth_server, SHAPE, ACC)
    assert err.value.code == 401
    home = tmp_path / "home"
    (home / ".mlflow").mkdir(parents=True)
    (home / ".mlflow" / "credentials").write_text(
        f"[mlflow]\nmlflow_tracking_username = {ADMIN}\nmlflow_tracking_password = {PASSWORD}\n"
    )
    monkeypatch.setenv("HOME", str(home))
    assert _read(auth_server, SHAPE, ACC) == expected  # MLflow's credentials file
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = {"infra": {"nodes": 1}, "train": {"batch_size": 8, "val_batches": 1}}
    assert history.find(auth_server, SHAPE, ACC, cfg) is None  # ... and find falls back to the prior
    assert history.find(with_userinfo, SHAPE, ACC, cfg).run_id == expected[0][0]


def test_plan_reads_history_without_importing_mlflow(cli_env: dict[str, str], tmp_path: Path) -> None:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from llmctl.config.compose import compose
    from llmctl.cost.estimate import shape_key
    from llmctl.plan.make import make_plan

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["experiment=smoke", f"tracking.uri={uri}"]
    plan = make_plan(compose(args))
    mc = MlflowClient(tracking_uri=uri)
    run = mc.create_run(
        mc.create_experiment("history"),
        tags={history.TAG_SHAPE: shape_key(plan.cfg), history.TAG_ACCELERATOR: plan.hardware.accelerator},
    )
    mc.log_batch(
        run.info.run_id,
        metrics=[Metric(history.STEADY, 12345.0, 0, 0), Metric(history.OVERHEAD, 3.0, 0, 0)],
        params=[Param("infra.nodes", "1"), Param("train.batch_size", "8")],
    )
    mc.set_terminated(run.info.run_id, "FINISHED")

    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "llmctl", "plan", *args],
        cwd=tmp_path,
        env=cli_env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"measured: run {run.info.run_id[:12]}" in out.stdout and "12,345 tok/s" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "llmctl.cost.history" in imported  # importtime did report this run's imports
    assert not {m for m in imported if m.split(".")[0] in ("mlflow", "sqlalchemy", "torch")}
