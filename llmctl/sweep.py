"""Sweeps: one object (an id, a parent MLflow run) over many trials, run by a detached supervisor.

``llmctl launch -m`` expands the overrides as Hydra's basic sweeper does (``sweep_expand``),
composes and plans every trial, and refuses the whole sweep if any trial is invalid — before
anything exists. It then creates the parent run (tags ``llmctl.sweep_id``, ``llmctl.kind=sweep``),
writes the sweep's spec to ``llmctl-runs/sweeps/<sweep-id>/sweep.json`` and starts the supervisor
(``python -m llmctl.sweep_runner <dir>``) in its own session, and returns. The supervisor creates one
child run per trial and keeps up to ``max_parallel`` trial controllers running; each trial
controller launches its trial through the trial's backend exactly as ``llmctl launch`` does.

State lives in two places: MLflow (run statuses and metrics, the truth) and the sweep directory
(``sweep.json`` spec, ``state.json`` written by the supervisor, ``supervisor.pid``,
``supervisor.log``). ``status`` and ``down`` take a sweep id (``sweep-...``) and read both.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from llmctl.procs import pid_alive
from llmctl.errors import ConfigError

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
KEY_METRICS = ("train/loss", "val/loss", "perf/tokens_per_s", "cost/actual_usd")
TERMINAL = ("FINISHED", "FAILED", "KILLED")
DOWN_GRACE_S = 60.0

T = TypeVar("T")


def is_sweep_id(value: Optional[str]) -> bool:
    return bool(value) and str(value).startswith(PREFIX)


def new_sweep_id() -> str:
    return f"{PREFIX}{time.strftime('%Y%m%d')}-{uuid.uuid4().hex[:6]}"


def sweeps_root() -> Path:
    from llmctl.backends.local import RUNS_DIR

    return Path.cwd() / RUNS_DIR / "sweeps"


def sweep_dir(sweep_id: str) -> Path:
    return sweeps_root() / sweep_id


def default_max_parallel() -> int:
    """Local: one trial per GPU, else half the CPU cores (at least 1)."""
    from llmctl.backends.local import local_gpu_count

    return local_gpu_count() or max(1, (os.cpu_count() or 1) // 2)


def gpu_slots(max_parallel: int) -> list[Optional[str]]:
    """``CUDA_VISIBLE_DEVICES`` per concurrent local trial: the GPUs split evenly, else no limit."""
    from llmctl.backends.local import local_gpu_count

    gpus = local_gpu_count()
    if not gpus or max_parallel > gpus:
        return [None] * max_parallel
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(gpus)]
    per = gpus // max_parallel
    return [",".join(ids[i * per:(i + 1) * per]) for i in range(max_parallel)]


def retry(fn: Callable[..., T], *args: Any, attempts: int = 8, **kwargs: Any) -> T:
    """Call ``fn``; on sqlite's 'database is locked' back off and try again (many writers, one file)."""
    delay = 0.1
    for attempt in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # MlflowException / sqlalchemy OperationalError wrap the same text
            if "locked" not in str(exc).lower() or attempt == attempts - 1:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 3.0)
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- plan


def estimate_cost(plan: Any) -> Optional[float]:
    """Estimated USD for one trial's plan (``llmctl.cost``'s estimate, filled by ``make_plan``); None if unknown.

    ``plan -m`` shows it per trial and in total; ``--max-cost`` refuses sweeps whose total is above
    the limit, and says the cost is unknown when any trial has no estimate.
    """
    est = getattr(plan, "estimate", None)
    return None if est is None else float(est.total_usd)


def total_cost(costs: list[Optional[float]]) -> Optional[float]:
    """The sweep's total: unknown if any trial's cost is unknown."""
    if not costs or any(c is None for c in costs):
        return None
    return float(sum(c for c in costs if c is not None))


def fmt_cost(cost: Optional[float]) -> str:
    return "n/a" if cost is None else f"${cost:,.2f}"


@dataclass
class Trial:
    index: int
    overrides: list[str]
    plan: Any  # llmctl.plan.Plan
    composed: dict[str, Any]  # the composed config, before the backend's planning
    cost: Optional[float] = None


@dataclass
class SweepPlan:
    overrides: list[str]
    trials: list[Trial]
    max_parallel: int
    config_dir: Optional[str] = None
    notes: list[str] = field(default_factory=list)

    @property
    def total_cost(self) -> Optional[float]:
        return total_cost([t.cost for t in self.trials])

    def varying(self) -> list[str]:
        """Override keys whose value differs between trials (the table's columns)."""
        keys: dict[str, set[str]] = {}
        for t in self.trials:
            for o in t.overrides:
                k, _, v = o.partition("=")
                keys.setdefault(k, set()).add(v)
        return [k for k, vals in keys.items() if len(vals) > 1]

    def fixed(self) -> list[str]:
        varying = set(self.varying())
        return [o for o in self.trials[0].overrides if o.partition("=")[0] not in varying] if self.trials else []

    def describe(self) -> str:
        first = self.trials[0].plan
        lines = [f"# sweep: {len(self.trials)} trial(s), up to {self.max_parallel} at once",
                 f"fixed:       {' '.join(self.fixed()) or '(none)'}",
                 f"where:       {first.where}",
                 f"tracking:    {_redact(first.tracking_uri)} (experiment '{first.cfg['tracking']['experiment']}')",
                 ""]
        keys = self.varying()
        rows = [trial_row(t, keys) for t in self.trials]
        header = ["#", *keys, "procs", "device", "tokens", "est. cost"]
        lines.append(render_table(header, [[str(t.index), *r] for t, r in zip(self.trials, rows)]))
        tokens = sum(_tokens(t.plan.cfg) for t in self.trials)
        lines += ["", f"total:       {len(self.trials)} trials, {tokens:,} tokens,"
                      f" estimated cost {fmt_cost(self.total_cost)}"
                      + ("" if self.total_cost is not None else " (no cost estimator yet)")]
        lines += [f"note:        {n}" for n in self.notes]
        return "\n".join(lines)


def _tokens(cfg: dict[str, Any]) -> int:
    t = cfg["train"]
    return int(t["steps"] * t["batch_size"] * t["seq_len"])


def _redact(value: str) -> str:
    from llmctl.tracking import redact

    return redact(value)


def _values(overrides: list[str], keys: list[str]) -> list[str]:
    given = dict(o.partition("=")[::2] for o in overrides)
    return [given.get(k, "") for k in keys]


def trial_row(t: Trial, keys: Optional[list[str]] = None) -> list[str]:
    keys = keys if keys is not None else []
    p = t.plan
    return [*_values(t.overrides, keys), str(p.world_size), p.device, f"{_tokens(p.cfg):,}", fmt_cost(t.cost)]


def render_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), *(fmt(r) for r in rows)])


def make_sweep_plan(overrides: list[str], config_dir: Optional[str] = None,
                    max_parallel: Optional[int] = None) -> SweepPlan:
    """Expand, compose, validate and plan every trial; any invalid trial refuses the whole sweep."""
    from llmctl.config import Composed
    from llmctl.plan import make_plan
    from llmctl.sweep_expand import SweepConfigError, TrialError, compose_trials, expand

    if max_parallel is not None and max_parallel < 1:
        raise ConfigError(f"--max-parallel {max_parallel}: must be at least 1")
    parallel = max_parallel or default_max_parallel()
    trial_overrides = expand(overrides, config_dir)
    composed = compose_trials(trial_overrides, config_dir)
    slot = gpu_slots(parallel)[0]
    trials: list[Trial] = []
    errors: list[TrialError] = []
    with _visible_gpus(slot), _history_cache():
        for i, c in enumerate(composed):
            try:
                plan = make_plan(Composed(cfg=c.cfg, choices=c.choices, overrides=c.overrides))
            except ConfigError as exc:
                errors.append(TrialError(i, c.overrides, str(exc)))
                continue
            trials.append(Trial(index=i, overrides=c.overrides, plan=plan, composed=c.cfg, cost=estimate_cost(plan)))
    if errors:
        raise SweepConfigError(errors, len(composed))
    stores = {(t.plan.tracking_uri, t.plan.cfg["tracking"]["experiment"]) for t in trials}
    if len(stores) > 1:
        raise ConfigError("tracking.uri and tracking.experiment must be the same for every trial of a sweep"
                          " (the trials are children of one MLflow run)")
    sp = SweepPlan(overrides=list(overrides), trials=trials, max_parallel=parallel, config_dir=config_dir)
    if slot is not None:
        sp.notes.append(f"each trial gets {len(slot.split(','))} GPU(s) (CUDA_VISIBLE_DEVICES per trial)")
    if any(t.plan.backend != "local" for t in trials):
        sp.notes.append("non-local trials each launch through their backend; --max-parallel caps how many at once")
    return sp


class _history_cache:
    """Trials of one shape share one cost-history lookup (an MLflow query each would cost ~40 ms x trials).

    ``make_plan`` asks ``llmctl.cost.history.find`` for earlier runs of the trial's shape; within one
    planning pass the answer for the same arguments is the same, so it is memoized here and the
    original restored afterwards.
    """

    def __enter__(self) -> None:
        try:
            from llmctl.cost import history
        except ImportError:
            self.history = None
            return
        self.history, self.original, cache = history, history.find, {}

        def find(uri: str, shape: str, accelerator: str, cfg: Any) -> Any:
            key = (uri, shape, accelerator, cfg["infra"]["nodes"], cfg["train"]["batch_size"])
            if key not in cache:
                cache[key] = self.original(uri, shape, accelerator, cfg)
            return cache[key]

        history.find = find

    def __exit__(self, *exc: Any) -> None:
        if self.history is not None:
            self.history.find = self.original


class _visible_gpus:
    """Plan under the GPU slot a trial will get, so the plan's process count is the real one."""

    def __init__(self, value: Optional[str]):
        self.value, self.saved = value, None

    def __enter__(self) -> None:
        if self.value is not None:
            self.saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = self.value

    def __exit__(self, *exc: Any) -> None:
        if self.value is not None:
            if self.saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = self.saved


def check_budget(sp: SweepPlan, max_cost: Optional[float]) -> str:
    """Refuse a sweep whose estimated total exceeds ``max_cost``; say so when the total is unknown."""
    total = sp.total_cost
    if max_cost is None:
        return ""
    if total is None:
        return f"estimated cost unknown (no cost estimator); --max-cost ${max_cost:,.2f} cannot be checked"
    if total > max_cost:
        raise ConfigError(f"the sweep's estimated cost {fmt_cost(total)} exceeds --max-cost ${max_cost:,.2f};"
                          " fewer trials, fewer steps or a cheaper infra would fit")
    return f"estimated cost {fmt_cost(total)} within --max-cost ${max_cost:,.2f}"


# ----------------------------------------------------------------------------- launch


def start(sp: SweepPlan, metric: str = "val/loss", mode: str = "min") -> dict[str, Any]:
    """Create the parent run and the sweep directory, start the supervisor; return the spec."""
    import subprocess
    import sys

    from llmctl import tracking
    from llmctl.backends import backend_for

    if mode not in ("min", "max"):
        raise ConfigError(f"--mode {mode}: use min or max")
    for infra in {t.plan.cfg["infra"]["name"]: t for t in sp.trials}.values():  # once per infra
        backend = backend_for(infra.plan.cfg["infra"]["kind"])
        getattr(backend, "preflight", lambda plan: None)(infra.plan)
    sweep_id = new_sweep_id()
    first = sp.trials[0].plan
    cfg = {**first.cfg, "tracking": {**first.cfg["tracking"], "run_name": first.cfg["tracking"]["run_name"] or sweep_id}}
    handle = retry(tracking.create_run, cfg, {}, extra_tags={
        TAG_SWEEP_ID: sweep_id, TAG_KIND: "sweep", "llmctl.status": "running",
        "llmctl.sweep.overrides": _redact(" ".join(sp.overrides))[:5000],
        "llmctl.sweep.trials": str(len(sp.trials))})
    mc = tracking.client(handle.uri)
    from mlflow.entities import Param

    retry(mc.log_batch, handle.run_id, params=[
        Param("sweep.overrides", _redact(" ".join(sp.overrides))[:6000]), Param("sweep.trials", str(len(sp.trials))),
        Param("sweep.max_parallel", str(sp.max_parallel)), Param("sweep.metric", metric), Param("sweep.mode", mode)])
    d = sweep_dir(sweep_id)
    d.mkdir(parents=True, exist_ok=False)
    spec = {
        "sweep_id": sweep_id, "parent_run_id": handle.run_id, "uri": handle.uri,
        "experiment_id": handle.experiment_id, "overrides": sp.overrides, "config_dir": sp.config_dir,
        "max_parallel": sp.max_parallel, "metric": metric, "mode": mode, "cwd": str(Path.cwd()),
        "gpu_slots": gpu_slots(sp.max_parallel),
        "trials": [{"index": t.index, "overrides": t.overrides, "cfg": t.composed, "choices": t.plan.choices}
                   for t in sp.trials],
    }
    _write_json(d / SPEC_FILE, spec)
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    with open(d / LOG_FILE, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "llmctl.sweep_runner", str(d)], cwd=str(Path.cwd()),
                                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    (d / PID_FILE).write_text(str(proc.pid))
    return spec


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- status


@dataclass
class TrialStatus:
    index: int
    overrides: list[str]
    run_id: Optional[str]
    status: str
    metrics: dict[str, float]
    reason: str = ""
    cost: Optional[float] = None


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
        keys = _varying([t.overrides for t in self.trials])
        header = ["#", "run", "status", *keys, "train/loss", "val/loss", "tok/s", "cost"]
        rows = []
        for t in self.trials:
            m = t.metrics
            rows.append([str(t.index), (t.run_id or "-")[:12], t.status, *_values(t.overrides, keys),
                         _num(m.get("train/loss")), _num(m.get("val/loss")),
                         _num(m.get("perf/tokens_per_s"), "{:,.0f}"), fmt_cost(t.cost)])
        return header, rows

    def describe(self) -> str:
        spec = self.spec
        counts = ", ".join(f"{n} {s}" for s, n in sorted(self.counts().items()))
        header, rows = self.rows()
        lines = [f"sweep:       {spec['sweep_id']} (parent run {spec['parent_run_id']})",
                 f"state:       {self.parent_status}; supervisor {'running' if self.supervisor_alive else 'exited'};"
                 f" {len(self.trials)} trials: {counts}",
                 f"overrides:   {' '.join(spec['overrides'])}",
                 "", render_table(header, rows), "",
                 f"total cost:  {fmt_cost(total_cost([t.cost for t in self.trials]))}",
                 f"best:        {self.best_line()}"]
        return "\n".join(lines)

    def best_line(self) -> str:
        metric, mode = self.spec["metric"], self.spec["mode"]
        b = self.best()
        if b is None:
            return f"none yet (no FINISHED trial with {metric})"
        keys = _varying([t.overrides for t in self.trials])
        shown = " ".join(f"{k}={v}" for k, v in zip(keys, _values(b.overrides, keys)))
        return (f"trial {b.index}{f' ({shown})' if shown else ''} {metric}={b.metrics[metric]:.4f} ({mode}),"
                f" run {b.run_id}")


def _num(v: Optional[float], fmt: str = "{:.4f}") -> str:
    return "-" if v is None else fmt.format(v)


def _varying(overrides: list[list[str]]) -> list[str]:
    keys: dict[str, set[str]] = {}
    for ovs in overrides:
        for o in ovs:
            k, _, v = o.partition("=")
            keys.setdefault(k, set()).add(v)
    return [k for k, vals in keys.items() if len(vals) > 1]


def load_spec(sweep_id: str, uri: Optional[str] = None) -> dict[str, Any]:
    """The sweep's spec from ``llmctl-runs/sweeps/<id>``; else rebuilt from its MLflow runs."""
    spec = read_json(sweep_dir(sweep_id) / SPEC_FILE)
    if spec is not None:
        return spec
    from llmctl import tracking

    store = tracking.resolve_uri(uri)
    mc = tracking.client(store)
    exps = [e.experiment_id for e in mc.search_experiments()]
    parents = mc.search_runs(exps, f"tags.`{TAG_SWEEP_ID}` = '{sweep_id}' and tags.`{TAG_KIND}` = 'sweep'") if exps else []
    if not parents:
        raise ConfigError(f"no sweep '{sweep_id}' in ./llmctl-runs/sweeps or in {_redact(store)}."
                          " Fix: run llmctl from where you launched, or pass --tracking-uri")
    p = parents[0]
    children = _children(mc, p.info.experiment_id, sweep_id)
    return {"sweep_id": sweep_id, "parent_run_id": p.info.run_id, "uri": store,
            "experiment_id": p.info.experiment_id, "overrides": p.data.params.get("sweep.overrides", "").split(),
            "metric": p.data.params.get("sweep.metric", "val/loss"), "mode": p.data.params.get("sweep.mode", "min"),
            "trials": [{"index": int(c.data.tags.get(TAG_TRIAL, -1)),
                        "overrides": c.data.tags.get(TAG_TRIAL_OVERRIDES, "").split()} for c in children],
            "remote": True}


def _children(mc: Any, experiment_id: str, sweep_id: str) -> list[Any]:
    runs = retry(mc.search_runs, [experiment_id], f"tags.`{TAG_SWEEP_ID}` = '{sweep_id}' and tags.`{TAG_KIND}` = 'trial'",
                 max_results=50000)
    return sorted(runs, key=lambda r: int(r.data.tags.get(TAG_TRIAL, 0)))


def supervisor_pid(sweep_id: str) -> Optional[int]:
    try:
        return int((sweep_dir(sweep_id) / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def get_status(sweep_id: str, uri: Optional[str] = None) -> SweepStatus:
    from llmctl import tracking

    spec = load_spec(sweep_id, uri)
    mc = tracking.client(spec["uri"])
    parent = retry(mc.get_run, spec["parent_run_id"])
    by_index = {int(r.data.tags.get(TAG_TRIAL, -1)): r for r in _children(mc, spec["experiment_id"], sweep_id)}
    trials = []
    for t in spec["trials"]:
        run = by_index.get(t["index"])
        if run is None:
            trials.append(TrialStatus(t["index"], t["overrides"], None, "PENDING", {}))
            continue
        status = "PENDING" if run.info.status == "SCHEDULED" else run.info.status
        trials.append(TrialStatus(t["index"], t["overrides"], run.info.run_id, status,
                                  {k: v for k, v in run.data.metrics.items() if k in KEY_METRICS},
                                  run.data.tags.get("llmctl.status", ""), run.data.metrics.get("cost/actual_usd")))
    return SweepStatus(spec=spec, parent_status=parent.info.status,
                       supervisor_alive=pid_alive(supervisor_pid(sweep_id)), trials=trials)


def status_text(sweep_id: str, uri: Optional[str] = None) -> str:
    return get_status(sweep_id, uri).describe()


# ----------------------------------------------------------------------------- down


def down(sweep_id: str, uri: Optional[str] = None) -> str:
    """Cancel: the supervisor stops running trials and marks them and pending ones KILLED.

    If the supervisor is gone (killed, machine rebooted), do its job here: stop each running
    trial through its backend and close every open run as KILLED.
    """
    spec = load_spec(sweep_id, uri)
    pid = supervisor_pid(sweep_id)
    if pid_alive(pid):
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + DOWN_GRACE_S
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.3)
    st = get_status(sweep_id, uri)
    stopped = _close_leftovers(spec, st)
    st = get_status(sweep_id, uri)
    counts = ", ".join(f"{n} {s}" for s, n in sorted(st.counts().items()))
    extra = f"; closed {stopped} trial(s) the supervisor left open" if stopped else ""
    return f"sweep {sweep_id} cancelled ({counts}){extra}"


def _close_leftovers(spec: dict[str, Any], st: SweepStatus) -> int:
    """Stop and close trials still open after the supervisor exited (or if it died)."""
    from llmctl import runs, tracking
    from llmctl.tracking import RunHandle

    mc = tracking.client(spec["uri"])
    closed = 0
    for t in st.trials:
        if t.run_id is None or t.status in TERMINAL:
            continue
        run = retry(mc.get_run, t.run_id)
        if run.info.status == "RUNNING":
            try:
                runs.backend_of(run).down(run, spec["uri"])  # stops its processes, marks KILLED
            except Exception as exc:  # noqa: BLE001 - still close the run below
                print(f"warning: stopping trial {t.index}: {exc}")
        run = retry(mc.get_run, t.run_id)
        if run.info.status not in TERMINAL:
            retry(tracking.end_run, RunHandle(spec["uri"], t.run_id, spec["experiment_id"]), "KILLED", "llmctl down (sweep)")
        closed += 1
    parent = retry(mc.get_run, spec["parent_run_id"])
    if parent.info.status not in TERMINAL:
        retry(tracking.end_run, RunHandle(spec["uri"], spec["parent_run_id"], spec["experiment_id"]), "KILLED",
              "llmctl down")
    return closed


# ----------------------------------------------------------------------------- wait


def wait(sweep_id: str, poll_s: float = 2.0) -> SweepStatus:
    """Block until the sweep ends, showing a live table (rich, imported here)."""
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    def render(st: SweepStatus) -> Any:
        header, rows = st.rows()
        table = Table(title=f"{sweep_id}: {st.parent_status}", caption=f"best: {st.best_line()}")
        for h in header:
            table.add_column(h)
        for r in rows:
            table.add_row(*r)
        return table

    console = Console()
    st = get_status(sweep_id)
    with Live(render(st), console=console, refresh_per_second=1, auto_refresh=console.is_terminal) as live:
        while not st.done:
            time.sleep(poll_s)
            st = get_status(sweep_id)
            live.update(render(st))
    return st


def exit_code(st: SweepStatus) -> int:
    """0 all FINISHED, 130 cancelled, 1 any trial FAILED."""
    if st.parent_status == "KILLED" or any(t.status == "KILLED" for t in st.trials):
        return 130
    return 0 if all(t.status == "FINISHED" for t in st.trials) else 1


# ----------------------------------------------------------------------------- CLI glue


def plan_text(overrides: list[str], config_dir: Optional[str], max_parallel: Optional[int]) -> str:
    return make_sweep_plan(overrides, config_dir, max_parallel).describe()


def launch_cli(overrides: list[str], config_dir: Optional[str], max_parallel: Optional[int], wait_: bool,
               max_cost: Optional[float], metric: str, mode: str, echo: Callable[[str], None]) -> int:
    """``llmctl launch -m``: validate all, start the supervisor, return at once (or ``--wait``).

    Raises ConfigError (exit 3) before anything is created when any trial is invalid.
    """
    sp = make_sweep_plan(overrides, config_dir, max_parallel)
    budget = check_budget(sp, max_cost)
    spec = start(sp, metric, mode)
    sid = spec["sweep_id"]
    echo(f"llmctl: sweep {sid}: {len(sp.trials)} trial(s), up to {sp.max_parallel} at once on"
         f" {sp.trials[0].plan.where}; parent run {spec['parent_run_id']}")
    if budget:
        echo(f"llmctl: {budget}")
    echo(f"llmctl: status: llmctl status {sid} | cancel: llmctl down {sid}"
         f" | supervisor log: {sweep_dir(sid) / LOG_FILE}")
    if not wait_:
        return 0
    try:
        st = wait(sid)
    except KeyboardInterrupt:
        echo(f"llmctl: interrupted; cancelling sweep {sid}")
        echo(f"llmctl: {down(sid)}")
        return 130
    echo(f"llmctl: sweep {sid} {st.parent_status}: best {st.best_line()}")
    return exit_code(st)
