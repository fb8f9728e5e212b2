"""What ``llmctl launch -m``, ``status``, ``down`` and ``--wait`` do to a sweep.

``launch_cli`` validates every trial (``planning``), refuses a sweep over ``--max-cost``, creates the
parent run and the sweep directory, starts the supervisor (``python -m llmctl.sweep.supervisor``)
in its own session and returns (or waits with a live table). ``down`` cancels through the
supervisor, or does its job when it is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from llmctl.config.notify import masked_overrides
from llmctl.controller.procs import pid_alive
from llmctl.errors import ConfigError
from llmctl.plan import data_check, task_check
from llmctl.sweep.state import (
    DOWN_GRACE_S,
    LOG_FILE,
    SPEC_FILE,
    TAG_KIND,
    TAG_SWEEP_ID,
    TERMINAL,
    SweepStatus,
    exit_code,
    get_status,
    load_spec,
    new_sweep_id,
    read_json,
    supervisor_pid,
    sweep_dir,
    write_json,
    write_pid,
)
from llmctl.sweep.trial_plans import SweepPlan, check_budget, gpu_slots, make_sweep_plan
from llmctl.tracking.mlflow_run import redact


def _data_shape(cfg: dict[str, Any]) -> str:
    return json.dumps([cfg["data"], cfg["train"]["seq_len"], cfg["train"]["batch_size"]], sort_keys=True, default=str)


def start(
    sp: SweepPlan, metric: str = "val/loss", mode: str = "min", max_cost: Optional[float] = None
) -> dict[str, Any]:
    """Create the parent run and the sweep directory, start the supervisor; return the spec."""
    from mlflow.entities import Param

    from llmctl.backends import backend_for
    from llmctl.tracking import mlflow_run as tracking

    if mode not in ("min", "max"):
        raise ConfigError(f"--mode {mode}: use min or max")
    for infra in {t.plan.cfg["infra"]["name"]: t for t in sp.trials}.values():  # once per infra
        backend_for(infra.plan.backend).preflight(infra.plan)
    shapes = {_data_shape(t.plan.cfg): t.plan for t in sp.trials}
    for plan in shapes.values():  # the data preflight, once per data and batch shape
        data_check.check_plan(plan)
        task_check.check_plan(plan)
    sweep_id = new_sweep_id()
    first = sp.trials[0].plan
    cfg = {
        **first.cfg,
        "tracking": {**first.cfg["tracking"], "run_name": first.cfg["tracking"]["run_name"] or sweep_id},
    }
    handle = tracking.create_run(
        cfg,
        {},
        extra_tags={
            TAG_SWEEP_ID: sweep_id,
            TAG_KIND: "sweep",
            "llmctl.status": "running",
            "llmctl.sweep.overrides": redact(" ".join(masked_overrides(sp.overrides)))[:5000],
            "llmctl.sweep.trials": str(sp.n_trials),
        },
    )
    search = sp.search or {}
    tracking.client(handle.uri).log_batch(
        handle.run_id,
        params=[
            Param("sweep.overrides", redact(" ".join(masked_overrides(sp.overrides)))[:6000]),
            Param("sweep.trials", str(sp.n_trials)),
            Param("sweep.max_parallel", str(sp.max_parallel)),
            Param("sweep.metric", metric),
            Param("sweep.mode", mode),
            Param("sweep.search", search.get("sampler", "grid")),
            Param("sweep.prune", search.get("prune", "none")),
            *([Param("sweep.seed", str(search["seed"]))] if search else []),
        ],
    )
    d = sweep_dir(sweep_id)
    d.mkdir(parents=True, exist_ok=False)
    budgets = sp.trial_budgets(max_cost)
    spec = {
        "sweep_id": sweep_id,
        "parent_run_id": handle.run_id,
        "uri": handle.uri,
        "experiment_id": handle.experiment_id,
        "overrides": sp.overrides,
        "config_dir": sp.config_dir,
        "max_parallel": sp.max_parallel,
        "metric": metric,
        "mode": mode,
        "cwd": str(Path.cwd()),
        "gpu_slots": gpu_slots(sp.max_parallel),
        "max_cost": max_cost,
        "notify": first.cfg.get("notify"),  # the supervisor tells of the sweep's end; trials tell nothing
        "trials": [
            {
                "index": t.index,
                "overrides": t.overrides,
                "cfg": t.composed,
                "choices": t.plan.choices,
                "max_cost": budget,
            }
            for t, budget in zip(sp.trials, budgets)
        ],
    }
    if sp.search:  # its trials are asked from the study while it runs; every one gets an equal share
        spec["search"] = {k: sp.search[k] for k in ("sampler", "seed", "n_trials", "prune", "space", "grace_steps")}
        spec["trials"], spec["trial_budget"] = [], budgets[0]
        from llmctl.sweep import search as searching

        searching.study(spec, d, create=True)
    write_json(d / SPEC_FILE, spec)
    _spawn_supervisor(d, [])
    return spec


def _spawn_supervisor(d: Path, extra: list[str]) -> None:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    with open(d / LOG_FILE, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmctl.sweep.supervisor", *extra, str(d)],
            cwd=str(Path.cwd()),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    write_pid(d, proc.pid)


def resume(sweep_id: str) -> str:
    """``llmctl resume SWEEP_ID``: start a new supervisor for a sweep whose supervisor died.

    It follows trials whose controllers still run, resumes from their checkpoints those whose
    controllers died, starts the ones never started, and (a search) asks the study for the rest.
    """
    from llmctl.tracking import mlflow_run as tracking

    d = sweep_dir(sweep_id)
    spec = read_json(d / SPEC_FILE)
    if spec is None:
        raise ConfigError(f"no sweep directory {d}: resume a sweep from the directory it was launched in")
    if supervisor_pid(sweep_id) is not None:
        raise ConfigError(
            f"sweep {sweep_id} is running (its supervisor is alive): nothing to resume."
            f" Watch it: llmctl status {sweep_id}"
        )
    parent = tracking.client(spec["uri"]).get_run(spec["parent_run_id"])
    if parent.info.status != "RUNNING":
        raise ConfigError(
            f"sweep {sweep_id} has ended ({parent.info.status}: "
            f"{parent.data.tags.get('llmctl.status', '')}); nothing to resume"
        )
    _spawn_supervisor(d, ["--resume"])
    return f"sweep {sweep_id}: supervisor restarted; status: llmctl status {sweep_id} | supervisor log: {d / LOG_FILE}"


def down(sweep_id: str, uri: Optional[str] = None) -> str:
    """Cancel: the supervisor stops running trials and marks them and pending ones KILLED.

    If the supervisor is gone (killed, machine rebooted), do its job here: stop each running
    trial through its backend and close every open run as KILLED.
    """
    spec = load_spec(sweep_id, uri)
    pid = supervisor_pid(sweep_id)  # None when its pid now names another process
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + DOWN_GRACE_S
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.3)
    stopped = _close_leftovers(spec, get_status(sweep_id, uri))
    st = get_status(sweep_id, uri)
    counts = ", ".join(f"{n} {s}" for s, n in sorted(st.counts().items()))
    extra = f"; closed {stopped} trial(s) the supervisor left open" if stopped else ""
    return f"sweep {sweep_id} cancelled ({counts}){extra}"


def _close_leftovers(spec: dict[str, Any], st: SweepStatus) -> int:
    """Stop and close trials still open after the supervisor exited (or if it died)."""
    from llmctl.backends import backend_of
    from llmctl.run import closing, outcomes
    from llmctl.tracking import mlflow_run as tracking

    mc = tracking.client(spec["uri"])
    closed = 0
    for t in st.trials:
        if t.run_id is None or t.status in TERMINAL:
            continue
        run = mc.get_run(t.run_id)
        if run.info.status == "RUNNING":
            try:
                backend_of(run).down(run, spec["uri"])  # its controller, if alive, closes the run
            except Exception as exc:
                print(f"warning: stopping trial {t.index}: {exc}")
        closing.close_run(spec["uri"], t.run_id, outcomes.Outcome.KILLED, "llmctl down (sweep)")
        closed += 1
    closing.close_run(spec["uri"], spec["parent_run_id"], outcomes.Outcome.KILLED, "llmctl down")
    return closed


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
    if not console.is_terminal:  # a pipe or CI log: no live redraws, and no cut to rich's 80 columns
        from llmctl.sweep import table as plain

        while not st.done:
            time.sleep(poll_s)
            st = get_status(sweep_id)
        header, rows = st.rows()
        print(f"{sweep_id}: {st.parent_status}\n{plain.render(header, rows)}\nbest: {st.best_line()}", flush=True)
        return st
    with Live(render(st), console=console, refresh_per_second=1) as live:
        while not st.done:
            time.sleep(poll_s)
            st = get_status(sweep_id)
            live.update(render(st))
    return st


def launch_cli(
    overrides: list[str],
    config_dir: Optional[str],
    max_parallel: Optional[int],
    wait_: bool,
    max_cost: Optional[float],
    metric: str,
    mode: str,
    echo: Callable[[str], None],
    **search: Any,
) -> int:
    """``llmctl launch -m``: validate all, start the supervisor, return at once (or ``--wait``).

    Raises ConfigError (exit 3) before anything is created when any trial is invalid.
    ``search``: ``search``, ``n_trials``, ``prune``, ``seed`` (see ``planning.make_sweep_plan``).
    """
    if mode not in ("min", "max"):
        raise ConfigError(f"--mode {mode}: use min or max")
    sp = make_sweep_plan(overrides, config_dir, max_parallel, **search)
    budget = check_budget(sp, max_cost)
    spec = start(sp, metric, mode, max_cost)
    sid = spec["sweep_id"]
    how = f"{sp.search['sampler']} search (seed {sp.search['seed']}, prune {sp.search['prune']}), " if sp.search else ""
    echo(
        f"llmctl: sweep {sid}: {how}{sp.n_trials} trial(s), up to {sp.max_parallel} at once on"
        f" {sp.trials[0].plan.where}; parent run {spec['parent_run_id']}"
    )
    if budget:
        echo(f"llmctl: {budget}")
    echo(
        f"llmctl: status: llmctl status {sid} | cancel: llmctl down {sid}"
        f" | restart a dead supervisor: llmctl resume {sid}"
        f" | supervisor log: {sweep_dir(sid) / LOG_FILE}"
    )
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
