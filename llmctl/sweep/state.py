"""A sweep's state: its id and directory, the spec and state files, and its status from MLflow.

State lives in two places: MLflow (run statuses and metrics, the truth) and the sweep directory
``llmctl-runs/sweeps/<sweep-id>/`` (``sweep.json`` spec, ``state.json`` written by the supervisor,
``supervisor.pid``, ``supervisor.log``). Without the directory (another machine), the spec is
rebuilt from the MLflow runs.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from llmctl.controller.procs import same_process, start_time
from llmctl.controller.workdir import sweeps_root
from llmctl.cost import ledger
from llmctl.errors import ConfigError
from llmctl.sweep import table
from llmctl.tracking.mlflow_run import redact

PREFIX = "sweep-"
SPEC_FILE = "sweep.json"
STATE_FILE = "state.json"
PID_FILE = "supervisor.pid"
LOG_FILE = "supervisor.log"
TAG_SWEEP_ID = "llmctl.sweep_id"
TAG_KIND = "llmctl.kind"
TAG_TRIAL = "llmctl.trial"
TAG_TRIAL_OVERRIDES = "llmctl.trial.overrides"
TAG_PARENT = "mlflow.parentRunId"
TAG_PRUNED = "llmctl.pruned"  # the val step a search's pruner stopped the trial at (its run ends KILLED)
# "STEP VALUE": the pruner's decision, recorded before the trial is stopped, so a supervisor that
# dies before the trial has stopped leaves it for the next one to finish as pruned
TAG_PRUNE_DECIDED = "llmctl.prune_decided"
KEY_METRICS = ("train/loss", "val/loss", "perf/tokens_per_s")
TERMINAL = ("FINISHED", "FAILED", "KILLED", "PRUNED")  # PRUNED: KILLED with TAG_PRUNED
GOOD = ("FINISHED", "PRUNED")  # a sweep whose trials all ended so has done its job
DOWN_GRACE_S = 60.0


def is_sweep_id(value: Optional[str]) -> bool:
    return bool(value) and str(value).startswith(PREFIX)


def new_sweep_id() -> str:
    return f"{PREFIX}{time.strftime('%Y%m%d')}-{uuid.uuid4().hex[:6]}"


def sweep_dir(sweep_id: str) -> Path:
    return sweeps_root() / sweep_id


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass
class TrialStatus:
    index: int
    overrides: list[str]
    run_id: Optional[str]
    status: str
    metrics: dict[str, float]
    reason: str = ""
    cost: Optional[float] = None
    unpriced: bool = False


@dataclass
class SweepStatus:
    spec: dict[str, Any]
    parent_status: str
    supervisor_alive: bool
    trials: list[TrialStatus]

    @property
    def done(self) -> bool:
        return not self.supervisor_alive and all(t.status in TERMINAL for t in self.trials)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.trials:
            out[t.status] = out.get(t.status, 0) + 1
        return out

    def best(self) -> Optional[TrialStatus]:
        metric, mode = self.spec["metric"], self.spec["mode"]
        scored = [t for t in self.trials if t.status == "FINISHED" and metric in t.metrics]
        if not scored:
            return None
        return (min if mode == "min" else max)(scored, key=lambda t: t.metrics[metric])

    def rows(self) -> tuple[list[str], list[list[str]]]:
        keys = table.varying([t.overrides for t in self.trials])
        # the sweep's own --metric (a benchmark score, say) gets a column when it is not one of these
        extra = [m for m in [self.spec.get("metric")] if m and m not in KEY_METRICS]
        header = ["#", "run", "status", *keys, "train/loss", "val/loss", *extra, "tok/s", "cost"]
        rows = []
        for t in self.trials:
            m = t.metrics
            rows.append(
                [
                    str(t.index),
                    (t.run_id or "-")[:12],
                    t.status,
                    *(table.shown(v) for v in table.values(t.overrides, keys)),
                    table.num(m.get("train/loss")),
                    table.num(m.get("val/loss")),
                    *(table.num(m.get(k)) for k in extra),
                    table.num(m.get("perf/tokens_per_s"), "{:,.0f}"),
                    table.fmt_cost(t.cost, t.unpriced),
                ]
            )
        return header, rows

    def describe(self) -> str:
        spec = self.spec
        counts = ", ".join(f"{n} {s}" for s, n in sorted(self.counts().items()))
        header, rows = self.rows()
        total = table.fmt_cost(table.total_cost([t.cost for t in self.trials]), any(t.unpriced for t in self.trials))
        lines = [
            f"sweep:       {spec['sweep_id']} (parent run {spec['parent_run_id']})",
            f"state:       {self.parent_status}; supervisor {'running' if self.supervisor_alive else 'exited'};"
            f" {len(self.trials)} trials: {counts}",
            f"overrides:   {' '.join(spec['overrides'])}",
            *([self.search_line()] if spec.get("search") else []),
            "",
            table.render(header, rows),
            "",
            f"total cost:  {total}",
            f"best:        {self.best_line()}",
        ]
        return "\n".join(lines)

    def search_line(self) -> str:
        s = self.spec["search"]
        ended = sum(1 for t in self.trials if t.status in TERMINAL)
        pruned = sum(1 for t in self.trials if t.status == "PRUNED")
        return (
            f"search:      {s['sampler']} (seed {s['seed']}, prune {s['prune']}): {ended} of {s['n_trials']}"
            f" trials ended, {len(self.trials)} started, {pruned} pruned"
        )

    def best_line(self) -> str:
        metric, mode = self.spec["metric"], self.spec["mode"]
        b = self.best()
        if b is None:
            return f"none yet (no FINISHED trial with {metric})"
        keys = table.varying([t.overrides for t in self.trials])
        shown = " ".join(f"{k}={table.shown(v)}" for k, v in zip(keys, table.values(b.overrides, keys)))
        return (
            f"trial {b.index}{f' ({shown})' if shown else ''} {metric}={b.metrics[metric]:.4f} ({mode}), run {b.run_id}"
        )


def load_spec(sweep_id: str, uri: Optional[str] = None) -> dict[str, Any]:
    """The sweep's spec from ``llmctl-runs/sweeps/<id>``; else rebuilt from its MLflow runs."""
    spec = read_json(sweep_dir(sweep_id) / SPEC_FILE)
    if spec is not None:
        return spec
    from llmctl.tracking import mlflow_run as tracking

    store = tracking.resolve_uri(uri)
    missing = tracking.missing_store(store, f"no sweep '{sweep_id}' in ./llmctl-runs/sweeps, and no runs yet")
    if missing:  # opening the store would create it
        raise ConfigError(f"{missing}. Fix: run llmctl from where you launched, or pass --tracking-uri")
    mc = tracking.client(store)
    exps = [e.experiment_id for e in mc.search_experiments()]
    parents = (
        mc.search_runs(exps, f"tags.`{TAG_SWEEP_ID}` = '{sweep_id}' and tags.`{TAG_KIND}` = 'sweep'") if exps else []
    )
    if not parents:
        raise ConfigError(
            f"no sweep '{sweep_id}' in ./llmctl-runs/sweeps or in {redact(store)}."
            " Fix: run llmctl from where you launched, or pass --tracking-uri"
        )
    p = parents[0]
    children = _children(mc, p.info.experiment_id, sweep_id)
    return {
        "sweep_id": sweep_id,
        "parent_run_id": p.info.run_id,
        "uri": store,
        "experiment_id": p.info.experiment_id,
        "overrides": p.data.params.get("sweep.overrides", "").split(),
        "metric": p.data.params.get("sweep.metric", "val/loss"),
        "mode": p.data.params.get("sweep.mode", "min"),
        "trials": [
            {
                "index": int(c.data.tags.get(TAG_TRIAL, -1)),
                "overrides": c.data.tags.get(TAG_TRIAL_OVERRIDES, "").split(),
            }
            for c in children
        ],
        "remote": True,
    }


def _children(mc: Any, experiment_id: str, sweep_id: str) -> list[Any]:
    runs = mc.search_runs(
        [experiment_id], f"tags.`{TAG_SWEEP_ID}` = '{sweep_id}' and tags.`{TAG_KIND}` = 'trial'", max_results=50000
    )
    return sorted(runs, key=lambda r: int(r.data.tags.get(TAG_TRIAL, 0)))


def untrained(mc: Any, run: Any) -> Optional[str]:
    """Why a sweep's run has no checkpoint to eval or export (its parent, or a trial that never
    started), naming what to use instead; None for a run that trained (or is no sweep's)."""
    tags, rid = run.data.tags, run.info.run_id
    sid = tags.get(TAG_SWEEP_ID)
    if not sid:
        return None
    if tags.get(TAG_KIND) == "sweep":
        trials = [
            f"trial {r.data.tags.get(TAG_TRIAL, '?')} {r.info.run_id[:12]} ({r.info.run_name or ''}, {r.info.status})"
            for r in _children(mc, run.info.experiment_id, sid)
            if ledger.attempts(r.data.tags)
        ]
        listed = "; ".join(trials[:8]) + (f"; and {len(trials) - 8} more" if len(trials) > 8 else "")
        return f"run {rid} is the parent of sweep {sid}: it trains nothing itself, its trials do." + (
            f" Fix: give one of its trials' run ids: {listed}" if trials else " None of its trials has started yet"
        )
    if tags.get(TAG_KIND) == "trial" and not ledger.attempts(tags):
        return (
            f"run {rid} is trial {tags.get(TAG_TRIAL, '?')} of sweep {sid}, which never started"
            f" ({tags.get('llmctl.status') or run.info.status}): it has no checkpoint. Fix: `llmctl status {sid}`"
            " lists the trials that ran"
        )
    return None


def write_pid(directory: Path, pid: int) -> None:
    """The supervisor's pid and its start time: a pid alone may name another process later."""
    (directory / PID_FILE).write_text(f"{pid} {start_time(pid) or ''}".strip())


def supervisor_pid(sweep_id: str) -> Optional[int]:
    """The live supervisor's pid, or None (gone, or its pid now belongs to another process)."""
    try:
        pid, *started = (sweep_dir(sweep_id) / PID_FILE).read_text().split()
        return int(pid) if same_process(int(pid), int(started[0]) if started else None) else None
    except (OSError, ValueError):
        return None


def _key_metrics(run: Any, metric: str) -> dict[str, float]:
    """The table's metrics of a trial and the sweep's ``metric`` (``--metric``: any the trial logs, a
    user program's own included); tokens/s is the steady figure its close recorded, when there is
    one (what ``llmctl runs`` shows), else the newest logged value."""
    out = {k: v for k, v in run.data.metrics.items() if k in KEY_METRICS or k == metric}
    steady = ledger.figures(run).get("perf/tokens_per_s_steady")
    if steady is not None:
        out["perf/tokens_per_s"] = steady
    return out


def get_status(sweep_id: str, uri: Optional[str] = None) -> SweepStatus:
    from llmctl.tracking import mlflow_run as tracking

    spec = load_spec(sweep_id, uri)
    mc = tracking.client(spec["uri"])
    parent = mc.get_run(spec["parent_run_id"])
    by_index = {int(r.data.tags.get(TAG_TRIAL, -1)): r for r in _children(mc, spec["experiment_id"], sweep_id)}
    trials = []
    for t in spec["trials"]:
        run = by_index.get(t["index"])
        if run is None:
            trials.append(TrialStatus(t["index"], t["overrides"], None, "PENDING", {}))
            continue
        status = "PENDING" if run.info.status == "SCHEDULED" else run.info.status
        if status == "KILLED" and run.data.tags.get(TAG_PRUNED):
            status = "PRUNED"
        trials.append(
            TrialStatus(
                t["index"],
                t["overrides"],
                run.info.run_id,
                status,
                _key_metrics(run, spec["metric"]),
                run.data.tags.get("llmctl.status", ""),
                ledger.figures(run).get("cost/actual_usd"),
                run.data.tags.get("llmctl.price.usd_per_hour") == "unpriced",
            )
        )
    return SweepStatus(
        spec=spec,
        parent_status=parent.info.status,
        supervisor_alive=supervisor_pid(sweep_id) is not None,
        trials=trials,
    )


def status_text(sweep_id: str, uri: Optional[str] = None) -> str:
    return get_status(sweep_id, uri).describe()


def exit_code(st: SweepStatus) -> int:
    """0 all FINISHED (or pruned), 130 cancelled, 1 any trial FAILED."""
    if st.parent_status == "KILLED" or any(t.status == "KILLED" for t in st.trials):
        return 130
    return 0 if all(t.status in GOOD for t in st.trials) else 1
