"""The sweep supervisor and its trial controllers (started by ``llmctl launch -m``, never by hand).

``python -m llmctl.sweep.supervisor <sweep-dir>`` — the supervisor, detached in its own session:
creates one child run per trial (SCHEDULED), keeps up to ``max_parallel`` trial controllers
running, and on SIGTERM (``llmctl down``) stops them, marks pending trials KILLED and ends the
parent run. A failed trial does not stop the others.

``python -m llmctl.sweep.supervisor --trial <sweep-dir> <index> <run-id>`` — one trial's controller:
plan it, then ``lifecycle.trial`` (the same attempt lifecycle as ``llmctl launch``), so a trial is an
ordinary run that ``llmctl status/logs/down/resume RUN`` understand, and a SkyPilot trial goes
through the SkyPilot backend like any other run. Its in-run budget is its share of ``--max-cost``.
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

from llmctl.errors import ConfigError, LaunchError
from llmctl.procs import Interrupted, raise_interrupted
from llmctl.sweep import state

POLL_S = 0.5
STOP_GRACE_S = 45.0  # the local backend's own stop escalation takes up to ~25 s


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


# ----------------------------------------------------------------------------- one trial


def run_trial(d: Path, index: int, run_id: str) -> int:
    """Run trial ``index`` into its (already created) child run; the lifecycle's exit code."""
    from llmctl import lifecycle
    from llmctl.config import Composed
    from llmctl.planner import make_plan
    from llmctl.tracking import RunHandle

    signal.signal(signal.SIGTERM, raise_interrupted)  # the supervisor may cancel before the workers start
    signal.signal(signal.SIGINT, raise_interrupted)
    spec = state.read_json(d / state.SPEC_FILE)
    trial = next(t for t in spec["trials"] if t["index"] == index)

    def say(text: str, err: bool = False) -> None:
        print(f"trial {index}: {text}", file=sys.stderr if err else sys.stdout, flush=True)

    try:
        plan = make_plan(Composed(cfg=trial["cfg"], choices=trial["choices"], overrides=trial["overrides"]))
        if plan.backend == "local" and "OMP_NUM_THREADS" not in os.environ and "GPU" not in plan.device:
            share = (os.cpu_count() or 1) // (int(spec["max_parallel"]) * plan.nproc_per_node)
            os.environ["OMP_NUM_THREADS"] = str(max(1, share))  # concurrent trials split the cores
        handle = RunHandle(spec["uri"], run_id, spec["experiment_id"])
        return lifecycle.trial(plan, handle, max_cost=trial.get("max_cost"), say=say, workload_out=_Null())
    except Interrupted as exc:  # before the lifecycle took over: nothing ran
        outcome = lifecycle.Outcome.KILLED if exc.signum == signal.SIGTERM else lifecycle.Outcome.INTERRUPTED
        lifecycle.close_run(spec["uri"], run_id, outcome, "sweep cancelled before this trial started")
        return lifecycle.RULES[outcome].exit_code
    except (ConfigError, LaunchError, OSError) as exc:
        lifecycle.close_run(spec["uri"], run_id, lifecycle.Outcome.FAILED, f"could not start: {exc}")
        say(f"could not start: {exc}", err=True)
        return lifecycle.RULES[lifecycle.Outcome.FAILED].exit_code


# ----------------------------------------------------------------------------- supervisor


class Supervisor:
    def __init__(self, d: Path):
        from llmctl import tracking

        self.dir = d
        self.spec = state.read_json(d / state.SPEC_FILE)
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

        from llmctl.sweep.naming import names

        parent, sid = self.spec["parent_run_id"], self.id
        run_names = names(self.spec["trials"], self.spec["trials"][0]["cfg"]["tracking"]["run_name"] or sid)
        for t in self.spec["trials"]:
            cfg = {**t["cfg"], "tracking": {**t["cfg"]["tracking"], "run_name": run_names[t["index"]]}}
            handle = tracking.create_run(cfg, t["choices"], extra_tags={
                state.TAG_PARENT: parent, state.TAG_SWEEP_ID: sid, state.TAG_KIND: "trial",
                state.TAG_TRIAL: str(t["index"]), "llmctl.status": "pending",
                state.TAG_TRIAL_OVERRIDES: tracking.redact(" ".join(t["overrides"]))[:5000]})
            self.mc.update_run(handle.run_id, status="SCHEDULED")
            self.run_ids[t["index"]] = handle.run_id
            self.pending.append(t["index"])
        self.save()

    def save(self, done: bool = False) -> None:
        trials = {i: {"run_id": rid, "state": self.outcome.get(i) or ("RUNNING" if i in self.running else "PENDING"),
                      "pid": self.running[i][0].pid if i in self.running else None}
                  for i, rid in self.run_ids.items()}
        state.write_json(self.dir / state.STATE_FILE, {"supervisor": os.getpid(), "updated": time.time(),
                                                         "cancelled": self.cancelled, "done": done, "trials": trials})

    def start_trial(self, index: int) -> None:
        slot = self.slots.pop(0)
        env = dict(os.environ)
        gpus = self.spec["gpu_slots"][slot]
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        log = open(self.dir / f"trial-{index}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "llmctl.sweep.supervisor", "--trial", str(self.dir), str(index),
                                 self.run_ids[index]], env=env, cwd=self.spec["cwd"], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.running[index] = (proc, slot)
        _say(f"trial {index} started (pid {proc.pid}, run {self.run_ids[index]})")

    def reap(self) -> None:
        from llmctl import lifecycle

        for index, (proc, slot) in list(self.running.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.running[index]
            self.slots.append(slot)
            # a controller that died before closing its run leaves it open: close it here
            outcome = lifecycle.Outcome.KILLED if self.cancelled else lifecycle.Outcome.FAILED
            lifecycle.close_run(self.spec["uri"], self.run_ids[index], outcome,
                                f"trial controller exited with code {code}")
            status = self.mc.get_run(self.run_ids[index]).info.status
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
        from llmctl.backends import backend_of

        run = self.mc.get_run(self.run_ids[index])
        try:
            backend_of(run).down(run, self.spec["uri"], force=True)
        finally:
            proc.kill()

    def kill_pending(self) -> None:
        from llmctl import lifecycle

        while self.pending:
            index = self.pending.popleft()
            lifecycle.close_run(self.spec["uri"], self.run_ids[index], lifecycle.Outcome.KILLED,
                                "sweep cancelled before this trial started")
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
        from llmctl import lifecycle

        st = state.get_status(self.id)
        counts = ", ".join(f"{n} {s}" for s, n in sorted(st.counts().items()))
        best = st.best()
        if best is not None:
            self.mc.set_tag(self.spec["parent_run_id"], "llmctl.sweep.best_run_id", best.run_id)
            self.mc.set_tag(self.spec["parent_run_id"], "llmctl.sweep.best_trial", str(best.index))
        Outcome = lifecycle.Outcome
        if error is not None:
            outcome, reason = Outcome.FAILED, f"supervisor error: {error}; trials: {counts}"
        elif self.cancelled:
            outcome, reason = Outcome.KILLED, f"cancelled; trials: {counts}"
        else:
            outcome = Outcome.FINISHED if all(t.status == "FINISHED" for t in st.trials) else Outcome.FAILED
            reason = f"trials: {counts}; best: {st.best_line()}"
        lifecycle.close_run(self.spec["uri"], self.spec["parent_run_id"], outcome, reason)
        self.save(done=True)
        _say(f"sweep {self.id} {lifecycle.RULES[outcome].mlflow_status}: {reason}")


def supervise(d: Path) -> int:
    sup = Supervisor(d)
    state.write_pid(d, os.getpid())
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
