"""Calibration through MLflow: what a finished run measured, and finding it again for the next estimate.

At the end of every launch the controller derives, from the run's own metrics and its billed wall
time (see ``calibration``):

    perf/tokens_per_s_steady  tokens / seconds over the logged intervals, the first (warm-up) left out
    time/val_pass_s           median seconds per validation pass (the workload logs ``time/val_s``)
    time/wall_s               billed seconds of the attempt
    time/overhead_s           wall - steps x step time - val passes x val time: start-up, data,
                              checkpoints, teardown (for clouds: provisioning and node setup too)

``find`` returns the newest FINISHED run with the same ``llmctl.shape`` and ``llmctl.accelerator``
tags that has them, preferring one with the same nodes and batch size. With none, a run of another
shape on the same accelerator still tells what FLOP/s this machine sustains: its tokens/s times its
FLOPs per token (tag ``llmctl.flops_per_token``) is transferred to the new shape, preferring the
closest FLOPs per token with the same dtype, kernels, tp and ac (``estimate.measured_throughput``).
"""

from __future__ import annotations

import math
import os
import statistics
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

from llmctl.cost.estimate import Measured, SizeFit, fit_sizes, hidden_size
from llmctl.tracking.mlflow_run import sqlite_path
from workloads.protocol.schema import TrainerCfg

TAG_SHAPE = "llmctl.shape"
TAG_ACCELERATOR = "llmctl.accelerator"
TAG_FLOPS = "llmctl.flops_per_token"
STEADY = "perf/tokens_per_s_steady"
OVERHEAD = "time/overhead_s"
VAL_PASS = "time/val_pass_s"
WALL = "time/wall_s"
MAX_CANDIDATES = 50


def store_exists(uri: str) -> bool:
    """A sqlite store that does not exist yet has no history (and ``plan`` must not create it)."""
    path = sqlite_path(uri)
    return path.is_file() if path else True


@contextmanager
def _quick_http() -> Iterator[None]:
    """``plan`` must not hang on an unreachable tracking server: one try, a short timeout."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ.update({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def find(
    uri: str, shape: str, accelerator: str, cfg: Mapping[str, Any], tc: Optional[TrainerCfg] = None
) -> Optional[Measured]:
    """The best measured run for this shape and accelerator, else the best of another shape on the same
    accelerator (to transfer its FLOP/s), else None (no store, no match, no server). ``tc``: the
    typed view of ``cfg`` when the caller holds one."""
    if not store_exists(uri):
        return None
    try:
        same = _usable(candidates(uri, shape, accelerator))
        if same:
            return _measured(max(same, key=_rank_same(cfg)), cfg)
        other = [r for r in _usable(candidates(uri, None, accelerator)) if _flops(r)]
    except Exception:
        return None
    if not other:
        return None
    best = max(other, key=_rank_other(cfg, shape, tc))
    found = _measured(best, cfg)
    found.flops_per_token, found.shape = _flops(best), best.tags.get(TAG_SHAPE)
    found.size_fit = _size_fit(other, shape, found.nodes)
    return found


def _size_fit(runs: list[Candidate], shape: str, nodes: int) -> Optional[SizeFit]:
    """How FLOP/s moves with the hidden size, fitted over the runs of this shape's regime (dtype,
    kernels, tp, ac: the key after ``-T<seq>-``) on as many nodes as the run transferred from: each
    run's model FLOP/s is its steady tokens/s times its FLOPs per token."""
    points = []
    for r in runs:
        theirs = str(r.tags.get(TAG_SHAPE, ""))
        dim, flops = hidden_size(theirs), _flops(r)
        if dim and flops and _regime(theirs) == _regime(shape) and int(r.params.get("infra.nodes", 1)) == nodes:
            points.append((dim, r.figures[STEADY] * flops))
    return fit_sizes(points)


def _regime(shape: str) -> str:
    """A shape key's part after ``-T<seq>-`` (dtype, kernels, tp, ac): runs in one regime compare."""
    return shape.split("-", 8)[-1]


def command_wall(uri: str, key: str, accelerator: str) -> Optional[tuple[str, float]]:
    """(run id, billed wall seconds over all its attempts) of the newest FINISHED run of the same
    command (``estimate.command_key``) on this accelerator; None without one (or a store)."""
    if not store_exists(uri):
        return None
    try:
        for r in candidates(uri, key, accelerator):
            figures = r.figures
            if "cost/billed_hours" in figures:
                return r.run_id, figures["cost/billed_hours"] * 3600.0
            if WALL in figures:
                return r.run_id, figures[WALL]
    except Exception:
        return None
    return None


def _usable(runs: list[Candidate]) -> list[Candidate]:
    return [r for r in runs if STEADY in r.figures and OVERHEAD in r.figures]


def _flops(r: Candidate) -> Optional[float]:
    try:
        return float(r.tags[TAG_FLOPS])
    except (KeyError, ValueError):
        return None


def _rank_same(cfg: Mapping[str, Any]) -> Any:
    want = (str(cfg["infra"]["nodes"]), str(cfg["train"]["batch_size"]))

    def rank(r: Candidate) -> tuple[int, int]:
        same = (r.params.get("infra.nodes") == want[0]) + (r.params.get("train.batch_size") == want[1])
        return same, r.start_time or 0

    return rank


def _rank_other(cfg: Mapping[str, Any], shape: str, tc: Optional[TrainerCfg] = None) -> Any:
    """Same dtype, kernels, tp and ac first (the shape key after ``-T<seq>-``), then the closest FLOPs
    per token (matmul efficiency grows with size), then the same nodes, then the newest."""
    from llmctl.cost.work import work_per_token
    from workloads.protocol.config import typed

    tc = typed(cfg) if tc is None else tc
    fpt = work_per_token(tc).counted  # as the tag counts it (DPO: the reference's forward too)
    regime = _regime(shape)
    nodes = str(cfg["infra"]["nodes"])

    def rank(r: Candidate) -> tuple[bool, float, bool, int]:
        return (
            _regime(str(r.tags.get(TAG_SHAPE, ""))) == regime,
            -abs(math.log(_flops(r) / fpt)),
            r.params.get("infra.nodes") == nodes,
            r.start_time or 0,
        )

    return rank


def _measured(best: Candidate, cfg: Mapping[str, Any]) -> Measured:
    p, m = best.params, best.figures
    return Measured(
        run_id=best.run_id,
        tokens_per_s=m[STEADY],
        overhead_s=max(0.0, m[OVERHEAD]),
        val_pass_s=m.get(VAL_PASS, 0.0),
        nodes=int(p.get("infra.nodes", 1)),
        batch_size=int(p.get("train.batch_size", cfg["train"]["batch_size"])),
        val_batches=int(p.get("train.val_batches", cfg["train"]["val_batches"])),
        steps=int(m.get("train/steps_done", p.get("train.steps", 0))),
    )


# ----------------------------------------------------------------------------- reading the history
# ``plan`` reads this on every call, and importing mlflow takes longer than the rest of ``plan``: a sqlite store is read
# with sqlite3 (read-only), a tracking server through its REST API, anything else through
# MlflowClient. All three answer what ``MlflowClient.search_runs`` answers (tests/llmctl/test_history_reader.py).


@dataclass
class Candidate:
    """One FINISHED run of the shape, as search_runs returns it (params, latest metrics)."""

    run_id: str
    start_time: Optional[int]
    status: str
    params: dict[str, str]
    metrics: dict[str, float]
    tags: dict[str, str] = field(default_factory=dict)  # only ``_TAGS_READ``

    @property
    def figures(self) -> dict[str, float]:
        """What the run measured: tags (``hooks.close`` writes them), else metrics (runs logged before)."""
        out = dict(self.metrics)
        for key in _CALIBRATION:
            try:
                out[key] = float(self.tags[key])
            except (KeyError, ValueError):
                continue
        return out


def candidates(uri: str, shape: Optional[str], accelerator: str) -> list[Candidate]:
    """Newest first, at most ``MAX_CANDIDATES``: FINISHED, active runs of active experiments tagged
    with this shape (any shape: None) and accelerator, in search_runs' order (start time descending,
    then run id)."""
    shape, accelerator = (_quote(shape) if shape is not None else None), _quote(accelerator)
    if uri.startswith("sqlite:///") and "?" not in uri:
        return _sqlite_candidates(str(sqlite_path(uri)), shape, accelerator)
    if uri.startswith(("http://", "https://")) and not any(os.environ.get(k) for k in _REST_UNSUPPORTED):
        return _rest_candidates(uri, shape, accelerator)
    return _client_candidates(uri, shape, accelerator)


def _filter(shape: Optional[str], accelerator: str) -> str:
    by_shape = f"tags.`{TAG_SHAPE}` = '{shape}' and " if shape is not None else ""
    return f"{by_shape}tags.`{TAG_ACCELERATOR}` = '{accelerator}' and attributes.status = 'FINISHED'"


def _client_candidates(uri: str, shape: Optional[str], accelerator: str) -> list[Candidate]:
    from llmctl.tracking.mlflow_run import client

    with _quick_http():
        mc = client(uri)
        exps = mc.search_experiments()
        if not exps:
            return []
        runs = mc.search_runs(
            [e.experiment_id for e in exps],
            _filter(shape, accelerator),
            max_results=MAX_CANDIDATES,
            order_by=["attributes.start_time DESC"],
        )
    return [
        Candidate(
            r.info.run_id,
            r.info.start_time,
            r.info.status,
            dict(r.data.params),
            dict(r.data.metrics),
            {k: v for k, v in r.data.tags.items() if k in _TAGS_READ},
        )
        for r in runs
    ]


_CALIBRATION = (STEADY, OVERHEAD, VAL_PASS, WALL, "train/steps_done")
_TAGS_READ = (TAG_SHAPE, TAG_FLOPS, *_CALIBRATION)


# MLflow's own store queries (mlflow/store/tracking/sqlalchemy_store.py): search_experiments
# (ACTIVE_ONLY, 1000, creation_time DESC, experiment_id), then search_runs' tag and status filters.
_SQL_RUNS = """
SELECT r.run_uuid, r.start_time, r.status FROM runs r
WHERE r.lifecycle_stage = 'active' AND r.status = 'FINISHED'
  AND r.experiment_id IN (SELECT experiment_id FROM experiments WHERE lifecycle_stage = 'active'
                          ORDER BY creation_time DESC, experiment_id ASC LIMIT 1000)
  AND EXISTS (SELECT 1 FROM tags t WHERE t.run_uuid = r.run_uuid AND t.key = ? AND t.value = ?)
  AND EXISTS (SELECT 1 FROM tags t WHERE t.run_uuid = r.run_uuid AND t.key = ? AND (t.value = ? OR ? IS NULL))
ORDER BY r.start_time DESC, r.run_uuid ASC LIMIT ?
"""


def _sqlite_candidates(path: str, shape: Optional[str], accelerator: str) -> list[Candidate]:
    import sqlite3
    from urllib.parse import quote

    con = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, timeout=5)
    try:
        rows = con.execute(
            _SQL_RUNS, (TAG_ACCELERATOR, accelerator, TAG_SHAPE, shape, shape, MAX_CANDIDATES)
        ).fetchall()
        runs = {rid: Candidate(rid, start, status, {}, {}) for rid, start, status in rows}
        if runs:
            marks = ",".join("?" * len(runs))
            for rid, key, value in con.execute(
                f"SELECT run_uuid, key, value FROM params WHERE run_uuid IN ({marks})", list(runs)
            ):
                runs[rid].params[key] = value
            for rid, key, value, is_nan in con.execute(
                f"SELECT run_uuid, key, value, is_nan FROM latest_metrics WHERE run_uuid IN ({marks})", list(runs)
            ):
                runs[rid].metrics[key] = float("nan") if is_nan else float(value)
            for rid, key, value in con.execute(
                f"SELECT run_uuid, key, value FROM tags WHERE run_uuid IN ({marks})"
                f" AND key IN ({','.join('?' * len(_TAGS_READ))})",
                [*runs, *_TAGS_READ],
            ):
                runs[rid].tags[key] = value
    finally:
        con.close()
    return [runs[rid] for rid, _, _ in rows]


# what only MlflowClient knows how to do (plugins, signing, client certificates, workspaces)
_REST_UNSUPPORTED = (
    "MLFLOW_TRACKING_AUTH",
    "MLFLOW_TRACKING_AWS_SIGV4",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
    "MLFLOW_WORKSPACE",
)


def _rest_candidates(uri: str, shape: Optional[str], accelerator: str) -> list[Candidate]:
    exps = _post(uri, "/api/2.0/mlflow/experiments/search", {"max_results": 1000, "view_type": "ACTIVE_ONLY"})
    ids = [e["experiment_id"] for e in exps.get("experiments", [])]
    if not ids:
        return []
    found = _post(
        uri,
        "/api/2.0/mlflow/runs/search",
        {
            "experiment_ids": ids,
            "filter": _filter(shape, accelerator),
            "run_view_type": "ACTIVE_ONLY",
            "max_results": MAX_CANDIDATES,
            "order_by": ["attributes.start_time DESC"],
        },
    )
    out = []
    for r in found.get("runs", []):
        info, data = r["info"], r.get("data", {})
        start = info.get("start_time")
        out.append(
            Candidate(
                info["run_id"],
                int(start) if start is not None else None,
                info.get("status", ""),
                {p["key"]: p.get("value", "") for p in data.get("params", [])},
                {m["key"]: float(m["value"]) for m in data.get("metrics", [])},
                {t["key"]: t.get("value", "") for t in data.get("tags", []) if t["key"] in _TAGS_READ},
            )
        )
    return out


def _credentials() -> tuple[Optional[str], Optional[str]]:
    """MLflow's order (mlflow/utils/credentials.py): each of the environment, else the credentials file."""
    import configparser

    saved = configparser.ConfigParser()
    saved.read(os.path.expanduser("~/.mlflow/credentials"))
    section = saved["mlflow"] if saved.has_section("mlflow") else {}
    return (
        os.environ.get("MLFLOW_TRACKING_USERNAME") or section.get("mlflow_tracking_username"),
        os.environ.get("MLFLOW_TRACKING_PASSWORD") or section.get("mlflow_tracking_password"),
    )


def _post(uri: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """One try, a short timeout (``plan`` must not hang on an unreachable server); MLflow's auth:
    credentials in the URL, else MLFLOW_TRACKING_USERNAME/PASSWORD (or ~/.mlflow/credentials), else
    MLFLOW_TRACKING_TOKEN."""
    import base64
    import json
    import ssl
    import urllib.request
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    user, password = parts.username, parts.password
    host = parts.netloc.rsplit("@", 1)[-1]
    url = urlunsplit((parts.scheme, host, parts.path.rstrip("/") + endpoint, "", ""))
    headers = {"Content-Type": "application/json"}
    if not (user or password):
        user, password = _credentials()
    if user and password:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    elif os.environ.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"
    context = None
    if parts.scheme == "https":
        context = ssl.create_default_context(cafile=os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or None)
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("true", "1"):
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=5, context=context) as resp:
        return json.loads(resp.read().decode() or "{}")


def _quote(value: str) -> str:
    return value.replace("'", "")


def _history(mc: Any, run_id: str, key: str) -> list[Any]:
    return sorted(mc.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))


def steps_done(mc: Any, run_id: str) -> int:
    """The last step the run trained (its last logged train step; a budget stop logs its step too)."""
    points = _history(mc, run_id, "train/loss")
    return max((m.step for m in points), default=0)


def steady_tokens_per_s(points: list[Any], start_step: int = 0) -> Optional[float]:
    """Tokens over time of the logged intervals after the first (warm-up): each point is the speed
    of the steps since the previous one, so the mean is weighted by time, as wall time is."""
    spans, prev = [], start_step
    for m in points:
        if m.step > prev and m.value > 0:
            spans.append((m.step - prev, m.value))
            prev = m.step
    if len(spans) >= 3:
        spans = spans[1:]
    if not spans:
        return None
    return sum(n for n, _ in spans) / sum(n / v for n, v in spans)  # steps/s x tokens/step cancels


def calibration(mc: Any, run_id: str, cfg: Mapping[str, Any], wall_s: float, start_step: int = 0) -> dict[str, float]:
    """Metrics that let the next estimate of this shape reproduce this run's wall time."""
    if (cfg.get("workload") or {}).get("kind") == "command":  # a user's program: its wall time alone
        return {WALL: wall_s}
    t = cfg["train"]
    done = steps_done(mc, run_id)
    out: dict[str, float] = {WALL: wall_s, "train/steps_done": float(done)}
    steady = steady_tokens_per_s(_history(mc, run_id, "perf/tokens_per_s"), start_step)
    if steady is None:
        return out
    vals = [m.value for m in _history(mc, run_id, "time/val_s")]
    val_pass = statistics.median(vals) if vals else 0.0
    train_s = (done - start_step) * int(t["batch_size"]) * int(t["seq_len"]) / steady
    out.update({STEADY: steady, VAL_PASS: val_pass, OVERHEAD: wall_s - train_s - len(vals) * val_pass})
    return out
