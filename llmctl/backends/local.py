"""The embedded default: torchrun on this machine (all local GPUs, or CPU processes with gloo; a
single process runs without torchrun's agent).

Output is streamed to the terminal (under a live progress bar when it is one: ``progress.py``) and
kept in ``llmctl-runs/<run-id>/output.log``; the exit code of torchrun is the exit code of the run.
Ctrl-C is forwarded so workers stop cleanly; SIGTERM to the controller is a preemption notice the
workers act on (checkpoint, exit 75). What it reads of ``infra`` is ``LocalSettings``, built once by
``plan``, which refuses the keys only the SkyPilot backend reads instead of ignoring them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional, TextIO

from llmctl.backends.base import ENDED, JobStatus
from llmctl.config.compose import Composed, to_yaml
from llmctl.config.launcher_checks import resolve_layout
from llmctl.config.root_schema import InfraCfg
from llmctl.config.workload import is_command
from llmctl.controller import progress
from llmctl.controller.procs import (
    Interrupted,
    note_stop_request,
    same_process,
    signal_ranks,
    signal_tree,
    start_time,
)
from llmctl.controller.workdir import JOB_END_FILE, read_json, run_dir, update_json
from llmctl.errors import ConfigError, LaunchError
from llmctl.plan.devices import local_gpu_count, this_machine
from llmctl.plan.job_plan import Plan
from llmctl.tracking.mlflow_run import RunHandle
from workloads.planner.hardware import cpu_threads
from workloads.protocol.config import with_values
from workloads.protocol.run_contract import ENV_ELASTIC_SHUTDOWN, elastic_shutdown_timeout

CONFIG_PLACEHOLDER = "<run-dir>/config.yaml"
STOP_GRACE_S = 15.0
PIDS_FILE = "pids.json"  # controller pid and workers' process group (and their start times), for status/down


# infra keys llmctl reads whatever the backend: the label, the backend's name, the configured price
# (llmctl.cost.estimate). Every other key is a backend's own (root_schema.InfraCfg says whose).
LAUNCHER_INFRA_KEYS = ("name", "kind", "price_per_gpu_hour", "device_memory_gib")


@dataclass(frozen=True)
class LocalSettings:
    """What the local backend reads of ``infra`` (``infra.kind=local``: torchrun on this machine),
    built once by ``LocalBackend.plan``. One node, this one: every key only the SkyPilot backend
    reads (``llmctl.backends.sky.settings.SkySettings``: accelerators, region, bucket, ``nodes`` ...)
    must keep its default here, else ``from_infra`` refuses it rather than ignore it."""

    nproc_per_node: int = 0
    """``infra.nproc_per_node``: processes on this machine; 0: one per local GPU, or without GPUs the
    mesh size (``dp_replicate x dp_shard x tp``) as CPU processes with gloo."""

    @classmethod
    def from_infra(cls, infra: Mapping[str, Any]) -> "LocalSettings":
        """The settings from a resolved ``infra`` section; ``ConfigError`` naming the first key that
        only another backend reads, set to other than its default."""
        own = {f.name for f in fields(cls)} | set(LAUNCHER_INFRA_KEYS)
        defaults = InfraCfg()
        for f in fields(InfraCfg):
            default = getattr(defaults, f.name)
            if f.name not in own and f.name in infra and infra[f.name] != default:
                raise ConfigError(_foreign_key_message(f.name, infra[f.name], default))
        return cls(nproc_per_node=int(infra.get("nproc_per_node") or 0))


def _hydra(value: Any) -> str:
    """A value as an override writes it: ``null``, ``true``, ``{}``, ``''``, ``'s3://b'``, ``2``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{v}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return f"'{value}'"
    return str(value)


def _foreign_key_message(key: str, value: Any, default: Any) -> str:
    if key == "nodes":
        return (
            f"Bad value for 'infra.nodes': infra.kind=local runs on this machine, one node, got {value}."
            " Fix: infra.nodes=1, or a multi-node SkyPilot infra (infra=aws, lambda, slurm)"
        )
    return (
        f"Bad value for 'infra.{key}': infra.kind=local does not read it (only SkyPilot infras do),"
        f" got {_hydra(value)}. Fix: infra.{key}={_hydra(default)}, or a SkyPilot infra"
        " (infra=aws, lambda, runpod, slurm)"
    )


def _process_count(cfg: dict[str, Any], settings: LocalSettings, gpus: int) -> int:
    par = cfg["parallel"]
    if is_command(cfg):  # a user's program: one process, or torchrun's per GPU (or as infra says)
        return (settings.nproc_per_node or gpus or 1) if cfg["workload"].get("torchrun") else 1
    if settings.nproc_per_node:
        return int(settings.nproc_per_node)
    if gpus:
        return gpus
    shard = par["dp_shard"] if par["dp_shard"] > 0 else 1
    return par["dp_replicate"] * shard * par["tp"]


def job_command(nproc: int, config_path: str, command: bool = False) -> list[str]:
    """torchrun for several processes; one process runs the workload itself (torchrun's agent
    would only add a second interpreter and a torch import to every single-process run). A
    ``workload=command`` runs under its guard, which starts the user's program (and torchrun when
    ``workload.torchrun``) itself: ``workloads/command/guard.py``."""
    if command:
        return [sys.executable, "-u", "-m", "workloads.command", "--config", config_path, f"--nproc-per-node={nproc}"]
    workload = ["-m", "workloads.pretrain", "--config", config_path]
    if nproc == 1:
        return [sys.executable, "-u", *workload]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        *workload,
    ]


def _attempt_header(handle: RunHandle) -> str:
    """The line ``output.log`` gets before each attempt's output: ``== attempt 2 (UTC start time) ==``."""
    from datetime import datetime, timezone

    from workloads.protocol.run_contract import ENV_ATTEMPT

    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return f"== attempt {handle.attempt_env.get(ENV_ATTEMPT, '1')} ({started}) ==\n"


def _worker_env(plan: Plan, handle: RunHandle, rdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(handle.env())
    env["PYTHONUNBUFFERED"] = "1"
    env["LLMCTL_RUN_DIR"] = str(rdir)
    if plan.nproc_per_node > 1 and not local_gpu_count():  # torchrun would set 1 thread each
        env.setdefault("OMP_NUM_THREADS", str(cpu_threads(plan.nproc_per_node)))
    grace_s = float((plan.cfg.get("checkpoint") or {}).get("preempt_grace_s") or 0)
    env[ENV_ELASTIC_SHUTDOWN] = elastic_shutdown_timeout(grace_s)  # a stop torchrun gets itself (torch >= 2.12)
    # the workload imports `workloads` from the same tree as this llmctl, installed or not
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _stop(proc: subprocess.Popen[Any], guard_grace_s: Optional[float] = None) -> None:
    """Ctrl-C: let torchrun pass SIGINT to the workers, then escalate if they hang. A command workload
    (``guard_grace_s``: its grace period) gets it through its guard alone, which asks the program to
    stop the contract's way (SIGTERM: save, exit 75) and waits the grace; a user's program never sees
    a KeyboardInterrupt it was not written for."""
    first = (signal.SIGINT, STOP_GRACE_S, True)
    if guard_grace_s is not None:
        first = (signal.SIGINT, guard_grace_s + STOP_GRACE_S, False)
    for sig, wait_s, tree in (first, (signal.SIGTERM, 5.0, True), (signal.SIGKILL, 5.0, True)):
        if proc.poll() is not None:
            return
        if tree:
            signal_tree(proc.pid, sig)
        else:
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


def _forward_sigterm(proc: subprocess.Popen[Any], grace_s: float, torchrun: bool) -> Any:
    """SIGTERM to the controller (``llmctl down``) = preemption: pass it to the workers, which
    checkpoint and exit 75 (docs/resume.md); keep teeing their output. Under torchrun it goes to the
    ranks themselves, not to the agent, which would cut their save at its own shutdown timeout.
    SIGHUP (the SSH session or terminal llmctl ran in is gone) is taken the same way: the workers, in
    sessions of their own, never see it, and get the SIGTERM. Past the grace period (or on a second
    stop signal) stop them the hard way: the run then ends killed, not preempted."""
    import threading

    state: dict[str, Any] = {}

    def handler(signum: int, frame: Any) -> None:
        note_stop_request(signum)
        if state:
            raise Interrupted(signum)
        # before anything else: a second SIGTERM can run this handler again inside this call, and
        # must then find the first one recorded (else it only repeats the forward)
        state["forwarded"] = True
        if proc.poll() is not None:
            return
        if torchrun:
            signal_ranks(proc.pid, signal.SIGTERM)
        else:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
        state["timer"] = threading.Timer(grace_s + STOP_GRACE_S, lambda: _stop(proc))
        state["timer"].daemon = True
        state["timer"].start()

    return handler


def _pids(run_id: str) -> dict[str, int]:
    path = run_dir(run_id) / PIDS_FILE
    try:
        return {k: int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return {}


def _ours(pids: dict[str, int], key: str) -> bool:
    """The recorded ``controller`` or ``workers`` pid is alive and still this run's process (same
    start time as at launch), not another process that was given the pid since."""
    return same_process(pids.get(key), pids.get(f"{key}_start"))


def _alive(pids: dict[str, int]) -> bool:
    return _ours(pids, "controller") or _ours(pids, "workers")


class LocalBackend:
    """torchrun on this machine; ``llmctl-runs/<run-id>/pids.json`` lets status/logs/down find it."""

    name = "local"

    def plan(self, composed: Composed) -> Plan:
        cfg = composed.cfg
        settings = LocalSettings.from_infra(cfg["infra"])
        hardware = this_machine()
        gpus = hardware.gpus_per_node
        nproc = _process_count(cfg, settings, gpus)
        # the trainer's mesh; a user's program lays out its own processes
        if is_command(cfg):
            layout = {"dp_replicate": 1, "dp_shard": nproc, "tp": 1}
        else:
            layout = resolve_layout(composed.typed, nproc)
        resolved = {**cfg, "parallel": {**cfg["parallel"], **layout}}
        device = f"{gpus} local GPU(s), nccl" if gpus else "CPU, gloo"
        notes = []
        if gpus and nproc > gpus:
            notes.append(f"{nproc} processes share {gpus} GPU(s)")
        return Plan(
            cfg=resolved,
            choices=composed.choices,
            backend=self.name,
            where="local (this machine)",
            nodes=1,
            nproc_per_node=nproc,
            layout=layout,
            device=device,
            command=job_command(nproc, CONFIG_PLACEHOLDER, is_command(cfg)),
            tracking_uri="",
            hardware=hardware,
            notes=notes,
            typed=with_values(composed.typed, "parallel", **layout),
        )

    def preflight(self, plan: Plan) -> None:
        """Nothing to check: this machine is here."""

    def finalize(self, plan: Plan, handle: RunHandle) -> dict[str, Any]:
        """Fill in what needs the run id: the default checkpoint location beside the run."""
        if not plan.cfg["checkpoint"]["dir"]:
            plan.set_values("checkpoint", dir=str(run_dir(handle.run_id) / "checkpoints"))
        return plan.cfg

    def launch(self, plan: Plan, handle: RunHandle, echo: Optional[TextIO] = None) -> int:
        """Run the job, tee its output, return its exit code (``Interrupted`` after stopping it)."""
        if plan.job != "train":  # a local run's checkpoints are scored by `llmctl eval` itself, here
            raise LaunchError(f"the local backend runs training jobs, not a {plan.job} job")
        rdir = run_dir(handle.run_id)
        rdir.mkdir(parents=True, exist_ok=True)
        config_path = rdir / "config.yaml"
        config_path.write_text(to_yaml(plan.cfg))
        cmd = job_command(plan.nproc_per_node, str(config_path), is_command(plan.cfg))
        out = echo or sys.stdout
        bar = progress.StepProgress(out) if progress.wanted(out) else None
        with open(rdir / "output.log", "a") as log, bar or contextlib.nullcontext():  # a resume appends
            log.write(_attempt_header(handle))  # `llmctl logs` of a resumed run shows where each attempt starts
            log.flush()
            # own process group: Ctrl-C reaches the controller, which stops the group in order
            proc = subprocess.Popen(
                cmd,
                env=_worker_env(plan, handle, rdir),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                start_new_session=True,
            )
            pids = {"controller": os.getpid(), "workers": proc.pid}
            pids.update({f"{k}_start": t for k, t in ((k, start_time(p)) for k, p in pids.items()) if t is not None})
            (rdir / PIDS_FILE).write_text(json.dumps(pids))
            grace = float(plan.cfg["checkpoint"].get("preempt_grace_s") or 0)
            forward = _forward_sigterm(proc, grace, torchrun="torch.distributed.run" in cmd)
            stops = [signal.SIGTERM]
            if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # nohup: told to outlive the terminal
                stops.append(signal.SIGHUP)
            previous = {sig: signal.signal(sig, forward) for sig in stops}
            echo_on = True
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    if echo_on:
                        try:
                            if bar is not None:
                                bar.feed(line)
                            else:
                                out.write(line)
                                out.flush()
                        except OSError:  # the terminal is gone (SIGHUP follows): keep the log, drop the echo
                            echo_on = False
                code = proc.wait()
                update_json(handle.run_id, JOB_END_FILE, time=time.time(), code=code)  # the workers' exit
                return code
            except KeyboardInterrupt:
                _stop(proc, grace if is_command(plan.cfg) else None)
                raise
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                if proc.poll() is None:
                    _stop(proc)
                if proc.returncode is not None and "code" not in read_json(handle.run_id, JOB_END_FILE):
                    update_json(handle.run_id, JOB_END_FILE, time=time.time(), code=proc.returncode)

    def status(self, run: Any, uri: str) -> JobStatus:
        """Whether the run's processes are alive (runs are looked up in ``./llmctl-runs``)."""
        pids = _pids(run.info.run_id)
        if not pids:
            return JobStatus(
                [
                    f"process:     unknown (no {run_dir(run.info.run_id) / PIDS_FILE};"
                    " run llmctl from where you launched)"
                ]
            )
        alive = _alive(pids)
        lines = [
            f"process:     {'alive' if alive else 'exited'} (controller pid"
            f" {pids.get('controller')}, workers pgid {pids.get('workers')})"
        ]
        if alive or run.info.status != "RUNNING":
            return JobStatus(lines)
        # nothing of it runs, and its controller did not close it (killed, or the store was down then)
        rec = read_json(run.info.run_id, JOB_END_FILE)
        code = rec.get("code")
        try:  # when the workers exited, if someone saw it; else when the job last wrote output
            ended_at = (
                float(rec["time"]) if "time" in rec else (run_dir(run.info.run_id) / "output.log").stat().st_mtime
            )
        except (OSError, TypeError, ValueError):
            ended_at = None
        ended = f"exited with code {code}" if isinstance(code, int) else "exited (its controller is gone)"
        return JobStatus(lines, ended, code == 0, ended_at)

    def alive(self, run: Any, uri: str) -> bool:
        return _alive(_pids(run.info.run_id))

    def logs(self, run: Any, uri: str, follow: bool) -> int:
        """Print ``output.log``; with ``follow``, keep printing until the run's processes exit."""
        path = run_dir(run.info.run_id) / "output.log"
        if not path.is_file():
            raise LaunchError(f"no log for run {run.info.run_id} at {path}; run llmctl from where you launched")
        pids = _pids(run.info.run_id)
        with open(path) as f:
            while True:
                chunk = f.read()
                if chunk:
                    sys.stdout.write(chunk)
                    sys.stdout.flush()
                if not follow or not _alive(pids):
                    sys.stdout.write(f.read())
                    return 0
                time.sleep(0.5)

    def down(self, run: Any, uri: str, force: bool = False) -> str:
        """SIGTERM to the controller (it passes it on: workers checkpoint, exit 75, and it closes the
        run), then stop whatever is left of the workers. ``force``: SIGKILL both at once. Only
        processes that are still this run's are signalled: none for an ended run, and a pid now held
        by another process (same pid, other start time) is left alone."""
        rid = run.info.run_id
        if run.info.status in ENDED:
            return "nothing to stop"
        pids = _pids(rid)
        controller = pids.get("controller") if _ours(pids, "controller") else None
        workers = pids.get("workers") if _ours(pids, "workers") else None
        if force:
            if workers:
                signal_tree(workers, signal.SIGKILL)
            if controller:
                os.kill(controller, signal.SIGKILL)
        elif controller:
            os.kill(controller, signal.SIGTERM)
            grace = float(run.data.params.get("checkpoint.preempt_grace_s") or 0)
            deadline = time.monotonic() + STOP_GRACE_S + 15 + grace
            while _ours(pids, "controller") and time.monotonic() < deadline:
                time.sleep(0.2)
        if workers and _ours(pids, "workers"):  # controller gone (or stuck): stop the workers' group ourselves
            for sig in (signal.SIGTERM, signal.SIGKILL):
                signal_tree(workers, sig)
                time.sleep(2)
        if controller or workers:
            return f"run {rid} stopped"
        return f"run {rid}: nothing to stop (none of its processes is alive)"
