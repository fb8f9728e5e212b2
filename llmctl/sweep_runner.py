"""The sweep supervisor and its trial controllers (started by ``llmctl launch -m``, never by hand).

``python -m llmctl.sweep_runner <sweep-dir>`` — the supervisor, detached in its own session:
creates one child run per trial (SCHEDULED), keeps up to ``max_parallel`` trial controllers
running, and on SIGTERM (``llmctl down``) stops them, marks pending trials KILLED and ends the
parent run. A failed trial does not stop the others.

``python -m llmctl.sweep_runner --trial <sweep-dir> <index> <run-id>`` — one trial's controller:
the same steps as ``llmctl launch`` for a single run (plan → finalize → describe → backend.launch
→ end run), so a trial is an ordinary run that ``llmctl status/logs/down RUN`` understand, and a
SkyPilot trial goes through the SkyPilot backend's launch like any other run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

from llmctl import sweep
from llmctl.errors import ConfigError, LaunchError
from llmctl.procs import signal_tree

POLL_S = 0.5
STOP_GRACE_S = 45.0  # the local backend's own stop escalation takes up to ~25 s


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


# ----------------------------------------------------------------------------- one trial


def run_trial(d: Path, index: int, run_id: str) -> int:
    """Run trial ``index`` into its (already created) child run; exit 0 / 1 / 130."""
    from llmctl import tracking
    from llmctl.backends import backend_for
    from llmctl.config import Composed, to_yaml
    from llmctl.cost import hooks as cost
    from llmctl.plan import make_plan
    from llmctl.tracking import RunHandle

    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    spec = sweep.read_json(d / sweep.SPEC_FILE)
    trial = next(t for t in spec["trials"] if t["index"] == index)
    handle = RunHandle(spec["uri"], run_id, spec["experiment_id"])
    mc = tracking.client(handle.uri)

    def end(status: str, reason: str = "") -> None:
        sweep.retry(tracking.end_run, handle, status, reason)

    try:
        plan = make_plan(Composed(cfg=trial["cfg"], choices=trial["choices"], overrides=trial["overrides"]))
        if plan.backend == "local" and "OMP_NUM_THREADS" not in os.environ and "GPU" not in plan.device:
            share = (os.cpu_count() or 1) // (int(spec["max_parallel"]) * plan.nproc_per_node)
            os.environ["OMP_NUM_THREADS"] = str(max(1, share))  # concurrent trials split the cores
        backend = backend_for(plan.cfg["infra"]["kind"])
        sweep.retry(mc.update_run, run_id, status="RUNNING")
        sweep.retry(mc.set_tag, run_id, "llmctl.status", "running")
        cfg = backend.finalize(plan, handle)
        sweep.retry(tracking.describe_run, handle, cfg, to_yaml(cfg))
        attempt, cost_env = cost.on_launch(handle, plan, None)  # as `llmctl launch`: estimate, billing attempt
        os.environ.update(cost_env)
        print(f"trial {index}: run {run_id} on {plan.where}, {plan.world_size} process(es) on {plan.device}",
              flush=True)
        try:
            code = backend.launch(plan, handle, echo=_Null())
        finally:
            cost.on_end(handle, plan, attempt)
    except KeyboardInterrupt:
        end("KILLED", "sweep cancelled")
        return 130
    except (ConfigError, LaunchError, OSError) as exc:
        end("FAILED", f"could not start: {exc}")
        print(f"trial {index}: could not start: {exc}", file=sys.stderr, flush=True)
        return 1
    if code != 0:
        from llmctl.resume import preempted_reason

        preempted = preempted_reason(handle)  # SIGTERM from the supervisor: workers checkpointed and stopped
        if preempted:
            end("KILLED", f"sweep cancelled: {preempted}")
            return 130
        end("FAILED", f"workload exited with code {code}")
        print(f"trial {index}: FAILED, workload exited with code {code}", flush=True)
        return 1
    end("FINISHED")
    print(f"trial {index}: FINISHED", flush=True)
    return 0


# ----------------------------------------------------------------------------- supervisor


class Supervisor:
    def __init__(self, d: Path):
        from llmctl import tracking

        self.dir = d
        self.spec = sweep.read_json(d / sweep.SPEC_FILE)
        self.id = self.spec["sweep_id"]
        self.mc = tracking.client(self.spec["uri"])
        self.run_ids: dict[int, str] = {}
        self.pending: deque[int] = deque()
        self.running: dict[int, tuple[subprocess.Popen[bytes], int]] = {}  # index -> (proc, slot)
        self.outcome: dict[int, str] = {}
        self.slots = list(range(int(self.spec["max_parallel"])))
        self.cancelled = False
        self.stop_deadline: Optional[float] = None

    def _cancel(self, signum: int, frame: Any) -> None:
        self.cancelled = True

    def create_children(self) -> None:
        from llmctl import tracking

        parent, sid = self.spec["parent_run_id"], self.id
        for t in self.spec["trials"]:
            cfg = t["cfg"]
            name = cfg["tracking"]["run_name"]
            cfg = {**cfg, "tracking": {**cfg["tracking"], "run_name": f"{name or sid}-t{t['index']}"}}
            handle = sweep.retry(tracking.create_run, cfg, t["choices"], extra_tags={
                sweep.TAG_PARENT: parent, sweep.TAG_SWEEP_ID: sid, sweep.TAG_KIND: "trial",
                sweep.TAG_TRIAL: str(t["index"]), "llmctl.status": "pending",
                sweep.TAG_TRIAL_OVERRIDES: tracking.redact(" ".join(t["overrides"]))[:5000]})
            sweep.retry(self.mc.update_run, handle.run_id, status="SCHEDULED")
            self.run_ids[t["index"]] = handle.run_id
            self.pending.append(t["index"])
        self.save()

    def save(self, done: bool = False) -> None:
        trials = {i: {"run_id": rid, "state": self.outcome.get(i) or ("RUNNING" if i in self.running else "PENDING"),
                      "pid": self.running[i][0].pid if i in self.running else None}
                  for i, rid in self.run_ids.items()}
        sweep._write_json(self.dir / sweep.STATE_FILE, {"supervisor": os.getpid(), "updated": time.time(),
                                                         "cancelled": self.cancelled, "done": done, "trials": trials})

    def start_trial(self, index: int) -> None:
        slot = self.slots.pop(0)
        env = dict(os.environ)
        gpus = self.spec["gpu_slots"][slot]
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        log = open(self.dir / f"trial-{index}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "llmctl.sweep_runner", "--trial", str(self.dir), str(index),
                                 self.run_ids[index]], env=env, cwd=self.spec["cwd"], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.running[index] = (proc, slot)
        _say(f"trial {index} started (pid {proc.pid}, run {self.run_ids[index]})")

    def reap(self) -> None:
        from llmctl import tracking
        from llmctl.tracking import RunHandle

        for index, (proc, slot) in list(self.running.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.running[index]
            self.slots.append(slot)
            run = sweep.retry(self.mc.get_run, self.run_ids[index])
            status = run.info.status
            if status not in sweep.TERMINAL:  # the controller died before closing its run
                status = "KILLED" if self.cancelled else "FAILED"
                sweep.retry(tracking.end_run, RunHandle(self.spec["uri"], run.info.run_id, self.spec["experiment_id"]),
                            status, f"trial controller exited with code {code}")
            self.outcome[index] = status
            _say(f"trial {index} {status} (controller exit {code})")

    def stop_running(self) -> None:
        """SIGTERM each trial controller (it stops its workers and marks its run KILLED); then force."""
        now = time.monotonic()
        if self.stop_deadline is None:
            self.stop_deadline = now + STOP_GRACE_S
            for proc, _ in self.running.values():
                proc.send_signal(signal.SIGTERM)
        elif now > self.stop_deadline:
            for index, (proc, _) in self.running.items():
                self._force_stop(index, proc)

    def _force_stop(self, index: int, proc: subprocess.Popen[bytes]) -> None:
        from llmctl.backends import local

        pids = local._pids(self.run_ids[index])
        for pid in filter(None, [pids.get("workers")]):
            signal_tree(pid, signal.SIGKILL)
        proc.kill()

    def kill_pending(self) -> None:
        from llmctl import tracking
        from llmctl.tracking import RunHandle

        while self.pending:
            index = self.pending.popleft()
            sweep.retry(tracking.end_run, RunHandle(self.spec["uri"], self.run_ids[index], self.spec["experiment_id"]),
                        "KILLED", "sweep cancelled before this trial started")
            self.outcome[index] = "KILLED"

    def loop(self) -> None:
        while self.pending or self.running:
            if self.cancelled:
                self.kill_pending()
                self.stop_running()
            else:
                while self.pending and self.slots:
                    self.start_trial(self.pending.popleft())
            self.reap()
            self.save()
            time.sleep(POLL_S)

    def finish(self, error: Optional[str] = None) -> None:
        from llmctl import tracking
        from llmctl.tracking import RunHandle

        st = sweep.get_status(self.id)
        counts = ", ".join(f"{n} {s}" for s, n in sorted(st.counts().items()))
        best = st.best()
        if best is not None:
            sweep.retry(self.mc.set_tag, self.spec["parent_run_id"], "llmctl.sweep.best_run_id", best.run_id)
            sweep.retry(self.mc.set_tag, self.spec["parent_run_id"], "llmctl.sweep.best_trial", str(best.index))
        if error is not None:
            status, reason = "FAILED", f"supervisor error: {error}; trials: {counts}"
        elif self.cancelled:
            status, reason = "KILLED", f"cancelled; trials: {counts}"
        else:
            status = "FINISHED" if all(t.status == "FINISHED" for t in st.trials) else "FAILED"
            reason = f"trials: {counts}; best: {st.best_line()}"
        sweep.retry(tracking.end_run, RunHandle(self.spec["uri"], self.spec["parent_run_id"], self.spec["experiment_id"]),
                    status, reason)
        self.save(done=True)
        _say(f"sweep {self.id} {status}: {reason}")


def supervise(d: Path) -> int:
    sup = Supervisor(d)
    (d / sweep.PID_FILE).write_text(str(os.getpid()))
    signal.signal(signal.SIGTERM, sup._cancel)
    signal.signal(signal.SIGINT, sup._cancel)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _say(f"sweep {sup.id}: {len(sup.spec['trials'])} trials, up to {sup.spec['max_parallel']} at once")
    try:
        sup.create_children()
        sup.loop()
    except BaseException as exc:  # noqa: BLE001 - never leave trials running or runs open
        import traceback

        traceback.print_exc()
        sup.cancelled = True
        while sup.running:
            sup.kill_pending()
            sup.stop_running()
            sup.reap()
            time.sleep(POLL_S)
        sup.kill_pending()
        sup.finish(error=f"{type(exc).__name__}: {exc}")
        return 1
    sup.finish()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--trial":
        return run_trial(Path(args[1]), int(args[2]), args[3])
    return supervise(Path(args[0]))


if __name__ == "__main__":
    sys.exit(main())
