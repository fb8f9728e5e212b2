"""Calibration through MLflow: what a finished run measured, and finding it again for the next estimate.

At the end of every launch the controller derives, from the run's own metrics and its billed wall
time (see ``calibration``):

    perf/tokens_per_s_steady  tokens / seconds over the logged intervals, the first (warm-up) left out
    time/val_pass_s           median seconds per validation pass (the workload logs ``time/val_s``)
    time/wall_s               billed seconds of the attempt
    time/overhead_s           wall - steps x step time - val passes x val time: start-up, data,
                              checkpoints, teardown (for clouds: provisioning and node setup too)

``find`` returns the newest FINISHED run with the same ``llmctl.shape`` and ``llmctl.accelerator``
tags that has them, preferring one with the same nodes and batch size.
"""

from __future__ import annotations

import os
import statistics
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from llmctl.cost.estimate import Measured

TAG_SHAPE = "llmctl.shape"
TAG_ACCELERATOR = "llmctl.accelerator"
STEADY = "perf/tokens_per_s_steady"
OVERHEAD = "time/overhead_s"
VAL_PASS = "time/val_pass_s"
WALL = "time/wall_s"
MAX_CANDIDATES = 50


def store_exists(uri: str) -> bool:
    """A sqlite store that does not exist yet has no history (and ``plan`` must not create it)."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).is_file()
    return True


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


def find(uri: str, shape: str, accelerator: str, cfg: Mapping[str, Any]) -> Optional[Measured]:
    """The best measured run for this shape and accelerator, or None (no store, no match, no server)."""
    if not store_exists(uri):
        return None
    try:
        with _quick_http():
            runs = _candidates(uri, shape, accelerator)
    except Exception:  # noqa: BLE001 - history is evidence, not a requirement: fall back to the prior
        return None
    runs = [r for r in runs if STEADY in r.data.metrics and OVERHEAD in r.data.metrics]
    if not runs:
        return None
    want = (str(cfg["infra"]["nodes"]), str(cfg["train"]["batch_size"]))

    def rank(r: Any) -> tuple[int, int]:
        p = r.data.params
        same = (p.get("infra.nodes") == want[0]) + (p.get("train.batch_size") == want[1])
        return same, r.info.start_time or 0

    best = max(runs, key=rank)
    p, m = best.data.params, best.data.metrics
    return Measured(run_id=best.info.run_id, tokens_per_s=m[STEADY], overhead_s=max(0.0, m[OVERHEAD]),
                    val_pass_s=m.get(VAL_PASS, 0.0), nodes=int(p.get("infra.nodes", 1)),
                    batch_size=int(p.get("train.batch_size", cfg["train"]["batch_size"])),
                    val_batches=int(p.get("train.val_batches", cfg["train"]["val_batches"])),
                    steps=int(m.get("train/steps_done", p.get("train.steps", 0))))


def _candidates(uri: str, shape: str, accelerator: str) -> list[Any]:
    from llmctl.tracking import client

    mc = client(uri)
    exps = mc.search_experiments()
    if not exps:
        return []
    query = (f"tags.`{TAG_SHAPE}` = '{_quote(shape)}' and tags.`{TAG_ACCELERATOR}` = '{_quote(accelerator)}'"
             " and attributes.status = 'FINISHED'")
    return mc.search_runs([e.experiment_id for e in exps], query, max_results=MAX_CANDIDATES,
                          order_by=["attributes.start_time DESC"])


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
