"""The sweep supervisor and its trial controllers (started by ``llmctl launch -m``, never by hand).

``python -m llmctl.sweep.supervisor <sweep-dir>`` — the supervisor, detached in its own session:
creates one child run per trial (SCHEDULED), keeps up to ``max_parallel`` trial controllers
running, and on SIGTERM (``llmctl down``) stops them, marks pending trials KILLED and ends the
parent run. A failed trial does not stop the others. A search (``--search random|tpe``) asks its
Optuna study for a trial whenever a slot frees, reports each running trial's metric to it (pruning:
SIGTERM, as a preemption) and tells it how each trial ended.

``python -m llmctl.sweep.supervisor --resume <sweep-dir>`` (``llmctl resume SWEEP_ID``) — a new
supervisor for a sweep whose supervisor died: it follows trials whose jobs still run, resumes from
their checkpoints those whose jobs died, and goes on.

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

from llmctl.config.notify import masked_overrides
from llmctl.controller.procs import Interrupted, raise_interrupted, same_process
from llmctl.errors import ConfigError, LaunchError
from llmctl.sweep import state
from workloads.planner.hardware import cpu_threads

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


def trial_entry(spec: dict[str, Any], index: int) -> Optional[dict[str, Any]]:
    """Trial ``index`` of the spec (a search sweep's trials are appended as they are asked)."""
    return next((t for t in spec["trials"] if t["index"] == index), None)


def run_trial(d: Path, index: int, run_id: str) -> int:
    """Run trial ``index`` into its (already created) child run; the lifecycle's exit code."""
    from llmctl.config.compose import Composed
    from llmctl.plan.make import make_plan
    from llmctl.run import closing, lifecycle, outcomes
    from llmctl.tracking.mlflow_run import RunHandle

    signal.signal(signal.SIGTERM, raise_interrupted)  # the supervisor may cancel before the workers start
    signal.signal(signal.SIGINT, raise_interrupted)
    spec = state.read_json(d / state.SPEC_FILE)
    trial = trial_entry(spec, index)

    def say(text: str, err: bool = False) -> None:
        print(f"trial {index}: {text}", file=sys.stderr if err else sys.stdout, flush=True)

    try:
        plan = make_plan(Composed(cfg=trial["cfg"], choices=trial["choices"], overrides=trial["overrides"]))
        if plan.backend == "local" and "GPU" not in plan.device:  # concurrent trials split the cores
            share = cpu_threads(int(spec["max_parallel"]) * plan.nproc_per_node)
            os.environ.setdefault("OMP_NUM_THREADS", str(share))
        handle = RunHandle(spec["uri"], run_id, spec["experiment_id"])
        return lifecycle.trial(plan, handle, max_cost=trial.get("max_cost"), say=say, workload_out=_Null())
    except Interrupted as exc:  # before the lifecycle took over: nothing ran
        outcome = outcomes.Outcome.KILLED if exc.signum == signal.SIGTERM else outcomes.Outcome.INTERRUPTED
        closing.close_run(spec["uri"], run_id, outcome, "sweep cancelled before this trial started")
        return outcomes.RULES[outcome].exit_code
    except (ConfigError, LaunchError, OSError) as exc:
        closing.close_run(spec["uri"], run_id, outcomes.Outcome.FAILED, f"could not start: {exc}")
        say(f"could not start: {exc}", err=True)
        return outcomes.RULES[outcomes.Outcome.FAILED].exit_code


# ----------------------------------------------------------------------------- supervisor


class _Followed:
    """A trial an earlier supervisor started whose job outlived it: followed through its backend
    (local: the controller's or workers' pids; SkyPilot: the managed job), not restarted."""

    CHECK_S = 3.0  # a backend's status may be an API call

    def __init__(self, run: Any, uri: str, pid: Optional[int], started: Optional[int]):
        from llmctl.backends import backend_of

        self.run, self.uri, self.pid, self.started = run, uri, pid, started
        self.backend = backend_of(run)
        self.checked = 0.0

    def poll(self) -> Optional[int]:
        """None while the job runs; -1 once its run is closed or its job ended (a managed job that
        ended is closed here, as ``llmctl status RUN`` would): a placeholder, not an exit code."""
        from llmctl.run import closing, outcomes
        from llmctl.tracking.mlflow_run import client

        if time.monotonic() - self.checked < self.CHECK_S:
            return None
        self.checked = time.monotonic()
        self.run = client(self.uri).get_run(self.run.info.run_id)
        if self.run.info.status in state.TERMINAL:
            return -1
        job = self.backend.status(self.run, self.uri)
        if job.ended:
            outcome = outcomes.Outcome.FINISHED if job.ok else outcomes.Outcome.FAILED
            if closing.close_ended(self.uri, self.run, outcome, f"job {job.ended}", job.ended_at) is None:
                return None  # its controller is alive and closes it
            return -1
        return None if self.backend.alive(self.run, self.uri) else -1  # its exit code went to init

    def send_signal(self, sig: int) -> None:
        """As to a controller this supervisor started: SIGTERM → the workers save, then stop."""
        if self.pid is not None and same_process(self.pid, self.started):
            os.kill(self.pid, sig)
        else:
            self.backend.down(self.run, self.uri)

    def kill(self) -> None:
        self.backend.down(self.run, self.uri, force=True)


class Supervisor:
    def __init__(self, d: Path):
        from llmctl.tracking import mlflow_run as tracking

        self.dir = d
        self.spec = state.read_json(d / state.SPEC_FILE)
        self.id = self.spec["sweep_id"]
        self.mc = tracking.client(self.spec["uri"])
        self.run_ids: dict[int, str] = {}
        self.pending: deque[int] = deque()
        self.running: dict[int, tuple[Any, int]] = {}  # index -> (Popen or _Followed, slot)
        self.outcome: dict[int, str] = {}
        self.slots = list(range(int(self.spec["max_parallel"])))
        self.cancelled = False
        self.stop_deadline: Optional[float] = None
        self.search: Optional[dict[str, Any]] = self.spec.get("search")
        self.study: Any = None
        self.pruned: dict[int, tuple[int, float]] = {}  # index -> (step, value) it was pruned at
        self.reported: dict[int, int] = {}  # index -> last step reported to its Optuna trial
        self.resuming: set[int] = set()  # RUNNING trials whose controller died: `llmctl resume RUN`
        if self.search:
            from llmctl.sweep import search

            self.space = search.space_from_json(self.search["space"])
            self.study = search.study(self.spec, d)

    def _cancel(self, signum: int, frame: Any) -> None:
        self.cancelled = True

    def create_run(self, t: dict[str, Any]) -> None:
        """The trial's child run (SCHEDULED), unless one exists (a restarted supervisor)."""
        from llmctl.tracking import mlflow_run as tracking

        if t["index"] in self.run_ids:
            return
        parent, sid = self.spec["parent_run_id"], self.id
        cfg = {**t["cfg"], "tracking": {**t["cfg"]["tracking"], "run_name": self.trial_name(t)}}
        handle = tracking.create_run(
            cfg,
            t["choices"],
            extra_tags={
                state.TAG_PARENT: parent,
                state.TAG_SWEEP_ID: sid,
                state.TAG_KIND: "trial",
                state.TAG_TRIAL: str(t["index"]),
                "llmctl.status": "pending",
                state.TAG_TRIAL_OVERRIDES: tracking.redact(" ".join(masked_overrides(t["overrides"])))[:5000],
            },
        )
        self.mc.update_run(handle.run_id, status="SCHEDULED")
        self.run_ids[t["index"]] = handle.run_id
        self.pending.append(t["index"])

    def trial_name(self, t: dict[str, Any]) -> str:
        """What varies: across the grid's trials, or the searched keys' values of this one."""
        from llmctl.sweep import naming

        if self.search:
            return naming.searched_name(t["overrides"][len(self.space.fixed) :])
        prefix = self.spec["trials"][0]["cfg"]["tracking"]["run_name"] or self.id
        return naming.names(self.spec["trials"], prefix)[t["index"]]

    def create_children(self) -> None:
        for t in self.spec["trials"]:
            self.create_run(t)
        self.save()

    # ------------------------------------------------------------------ search: ask and tell

    def more_to_ask(self) -> bool:
        return (
            bool(self.search)
            and not self.cancelled
            and len(self.study.get_trials(deepcopy=False)) < int(self.search["n_trials"])
        )

    def ask(self) -> None:
        """A new trial from the study: composed, written to the spec, its run created (pending)."""
        trial = self.study.ask(fixed_distributions=dict(self.space.dists))
        self.add_search_trial(trial.number, trial.params)

    def add_search_trial(self, number: int, params: dict[str, Any]) -> None:
        from llmctl.sweep import search
        from llmctl.sweep.expand import compose_trials

        entry = trial_entry(self.spec, number)
        if entry is None:
            overrides = self.space.fixed + [search.as_override(k, params[k]) for k in self.space.dists]
            [composed] = compose_trials([overrides], self.spec.get("config_dir"))  # its ends were checked at launch
            entry = {
                "index": number,
                "overrides": overrides,
                "cfg": composed.cfg,
                "choices": composed.choices,
                "max_cost": self.spec.get("trial_budget"),
            }
            self.spec["trials"].append(entry)
            state.write_json(self.dir / state.SPEC_FILE, self.spec)  # before its run: a restart finds it
        self.create_run(entry)
        _say(f"trial {number} asked: {' '.join(entry['overrides'][len(self.space.fixed) :])}")

    def trial_id(self, index: int) -> int:
        return self.study._storage.get_trial_id_from_study_id_trial_number(self.study._study_id, index)

    def check_pruning(self) -> None:
        """Report each running trial's new metric points to its Optuna trial; stop those it prunes."""
        import optuna

        from llmctl.run import outcomes

        if not self.search or self.search["prune"] == "none":
            return
        for index, (proc, _) in list(self.running.items()):
            if index in self.pruned:
                continue
            history = self.mc.get_metric_history(self.run_ids[index], self.spec["metric"])
            new = sorted((m.step, m.value) for m in history if m.step > self.reported.get(index, -1))
            if not new:
                continue
            trial = optuna.trial.Trial(self.study, self.trial_id(index))
            for step, value in new:
                trial.report(value, step)
                self.reported[index] = step
            if new[-1][0] < self.last_step(index) and trial.should_prune():  # a last-step report: nothing left to save
                self.pruned[index] = new[-1]
                self.mc.set_tag(self.run_ids[index], state.TAG_PRUNE_DECIDED, f"{new[-1][0]} {new[-1][1]!r}")
                outcomes.request_stop(  # its controller then says pruned, not preempted
                    self.mc, self.run_ids[index], f"the sweep's {self.search['prune']} pruner", "pruned", resume=False
                )
                proc.send_signal(signal.SIGTERM)  # as a preemption: the workers save, then stop
                _say(f"trial {index} pruned at step {new[-1][0]} ({self.spec['metric']} {new[-1][1]:.4f})")

    def last_step(self, index: int) -> float:
        """The trial's final step: a report there comes from a trial that has done all its work, so
        pruning it would only turn a complete trial into a KILLED one (a race with its own exit)."""
        entry = trial_entry(self.spec, index)
        try:
            return int(entry["cfg"]["train"]["steps"])
        except (TypeError, KeyError, ValueError):
            return float("inf")

    def tell(self, index: int) -> None:
        """Tell the study how trial ``index`` ended (once): its metric, pruned, or failed."""
        from optuna.trial import TrialState

        if not self.search:
            return
        frozen = self.study._storage.get_trial(self.trial_id(index))
        if frozen.state != TrialState.RUNNING:
            return
        run = self.mc.get_run(self.run_ids[index])
        value = run.data.metrics.get(self.spec["metric"])
        if run.data.tags.get(state.TAG_PRUNED):
            self.study.tell(index, state=TrialState.PRUNED)
        elif run.info.status == "FINISHED" and value is not None:
            self.study.tell(index, value)
        else:
            self.study.tell(index, state=TrialState.FAIL)

    def mark_pruned(self, index: int) -> None:
        from llmctl.run import closing, outcomes

        run = self.mc.get_run(self.run_ids[index])
        if run.info.status == "FINISHED":  # it ended before the stop reached it: a complete trial
            return
        step, value = self.pruned[index]
        closing.close_run(self.spec["uri"], self.run_ids[index], outcomes.Outcome.PREEMPTED, "pruned")
        self.mc.set_tag(self.run_ids[index], state.TAG_PRUNED, str(step))
        self.mc.set_tag(
            self.run_ids[index],
            "llmctl.status",
            f"pruned at step {step} ({self.spec['metric']} {value:.4f}) by the"
            f" {self.search['prune'] if self.search else ''} pruner",
        )

    # ------------------------------------------------------------------ a restarted supervisor

    def adopt(self) -> None:
        """After a supervisor died: every trial's run found once; running ones followed (controller
        alive) or resumed from their checkpoints (controller gone); pending ones queued."""
        previous = (state.read_json(self.dir / state.STATE_FILE) or {}).get("trials", {})
        runs = {
            int(r.data.tags[state.TAG_TRIAL]): r for r in state._children(self.mc, self.spec["experiment_id"], self.id)
        }
        self.run_ids = {i: r.info.run_id for i, r in runs.items()}
        if self.search:  # asked before the last supervisor died, its run perhaps never created
            from optuna.trial import TrialState

            for ft in self.study.get_trials(deepcopy=False):
                self.reported[ft.number] = max(ft.intermediate_values, default=-1)
                if ft.state == TrialState.RUNNING and ft.number not in runs:
                    self.add_search_trial(ft.number, ft.params)
        else:
            for t in self.spec["trials"]:
                self.create_run(t)  # skips those that exist
        for index, run in sorted(runs.items()):
            status, was = run.info.status, previous.get(str(index), {})
            decided = run.data.tags.get(state.TAG_PRUNE_DECIDED)
            if decided:  # the pruner stopped it; the last supervisor may have died before it stopped
                step, value = decided.split()
                self.pruned[index] = (int(step), float(value))
            if status == "SCHEDULED":
                self.pending.append(index)
            elif status == "RUNNING":
                followed = _Followed(run, self.spec["uri"], was.get("pid"), was.get("started"))
                if followed.backend.alive(run, self.spec["uri"]):
                    self.running[index] = (followed, self.slots.pop(0))
                    _say(f"trial {index} followed (its job outlived the last supervisor)")
                elif index in self.pruned:  # stopped by the pruner: never resumed
                    self.end_pruned(index)
                else:  # nothing of it runs: continue it from its last checkpoint, in the same run
                    self.pending.appendleft(index)
                    self.resuming.add(index)
            elif index in self.pruned:
                self.end_pruned(index)
            else:
                self.outcome[index] = status
                self.tell(index)
        self.save()

    def end_pruned(self, index: int) -> None:
        """A pruned trial whose controller has exited: marked pruned (unless it had finished) and told."""
        self.mark_pruned(index)
        self.outcome[index] = self.mc.get_run(self.run_ids[index]).info.status
        self.tell(index)

    def save(self, done: bool = False) -> None:
        from llmctl.controller.procs import start_time

        trials = {}
        for i, rid in self.run_ids.items():
            proc = self.running[i][0] if i in self.running else None
            trials[i] = {
                "run_id": rid,
                "state": self.outcome.get(i) or ("RUNNING" if proc else "PENDING"),
                "pid": proc.pid if proc else None,
                "started": (getattr(proc, "started", None) or start_time(proc.pid)) if proc else None,
            }
        state.write_json(
            self.dir / state.STATE_FILE,
            {
                "supervisor": os.getpid(),
                "updated": time.time(),
                "cancelled": self.cancelled,
                "done": done,
                "trials": trials,
            },
        )

    def start_trial(self, index: int) -> None:
        slot = self.slots.pop(0)
        env = dict(os.environ)
        gpus = self.spec["gpu_slots"][slot]
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        if index in self.resuming:  # its controller died with the last supervisor: from its checkpoint
            self.resuming.discard(index)
            env.setdefault("OMP_NUM_THREADS", str(cpu_threads(int(self.spec["max_parallel"]))))
            cmd = [sys.executable, "-m", "llmctl", "resume", self.run_ids[index], "--tracking-uri", self.spec["uri"]]
        else:
            cmd = [
                sys.executable,
                "-m",
                "llmctl.sweep.supervisor",
                "--trial",
                str(self.dir),
                str(index),
                self.run_ids[index],
            ]
        log = open(self.dir / f"trial-{index}.log", "ab")  # noqa: SIM115 - the trial's stdout, for its lifetime
        proc = subprocess.Popen(
            cmd, env=env, cwd=self.spec["cwd"], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        self.running[index] = (proc, slot)
        _say(
            f"trial {index} {'resumed' if cmd[3] == 'resume' else 'started'} (pid {proc.pid},"
            f" run {self.run_ids[index]})"
        )

    def reap(self) -> None:
        from llmctl.run import closing, outcomes

        for index, (proc, slot) in list(self.running.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.running[index]
            self.slots.append(slot)
            if index in self.pruned:
                self.mark_pruned(index)
            # a controller that died before closing its run leaves it open: close it here
            outcome = outcomes.Outcome.KILLED if self.cancelled else outcomes.Outcome.FAILED
            if isinstance(proc, _Followed):  # an earlier supervisor's child: its exit code went to that one
                ended, why = "followed after a supervisor restart: exit code not seen", "trial controller ended"
            else:
                ended, why = f"controller exit {code}", f"trial controller exited with code {code}"
            closing.close_run(self.spec["uri"], self.run_ids[index], outcome, why)
            status = self.mc.get_run(self.run_ids[index]).info.status
            self.outcome[index] = status
            self.tell(index)
            _say(f"trial {index} {'PRUNED' if index in self.pruned and status != 'FINISHED' else status} ({ended})")

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

    def _force_stop(self, index: int, proc: Any) -> None:
        from llmctl.backends import backend_of

        run = self.mc.get_run(self.run_ids[index])
        try:
            backend_of(run).down(run, self.spec["uri"], force=True)
        finally:
            proc.kill()

    def kill_pending(self) -> None:
        from llmctl.run import closing, outcomes

        while self.pending:
            index = self.pending.popleft()
            closing.close_run(
                self.spec["uri"],
                self.run_ids[index],
                outcomes.Outcome.KILLED,
                "sweep cancelled before this trial started",
            )
            self.outcome[index] = "KILLED"
            self.tell(index)

    def loop(self) -> None:
        while self.pending or self.running or self.more_to_ask():
            if self.cancelled:
                self.kill_pending()
                self.stop_running()
            else:
                while self.slots and (self.pending or self.more_to_ask()):
                    if not self.pending:
                        self.ask()
                    self.start_trial(self.pending.popleft())
                self.check_pruning()
            self.reap()
            self.save()
            time.sleep(POLL_S)

    def finish(self, error: Optional[str] = None) -> None:
        from llmctl.run import closing, outcomes

        st = state.get_status(self.id)
        counts = ", ".join(f"{n} {s}" for s, n in sorted(st.counts().items()))
        best = st.best()
        if best is not None:
            self.mc.set_tag(self.spec["parent_run_id"], "llmctl.sweep.best_run_id", best.run_id)
            self.mc.set_tag(self.spec["parent_run_id"], "llmctl.sweep.best_trial", str(best.index))
            self.log_best_metrics(best.run_id)
        if self.search:
            self.summarize_search()
        Outcome = outcomes.Outcome
        if error is not None:
            outcome, reason = Outcome.FAILED, f"supervisor error: {error}; trials: {counts}"
        elif self.cancelled:
            outcome, reason = Outcome.KILLED, f"cancelled; trials: {counts}"
        else:
            outcome = Outcome.FINISHED if all(t.status in state.GOOD for t in st.trials) else Outcome.FAILED
            reason = f"trials: {counts}; best: {st.best_line()}"
        closing.close_run(self.spec["uri"], self.spec["parent_run_id"], outcome, reason)
        self.save(done=True)
        ended = f"sweep {self.id} {outcomes.RULES[outcome].mlflow_status}: {reason}"
        _say(ended)
        self.announce_end(ended, outcome.value, best.run_id if best is not None else None)

    def announce_end(self, ended: str, outcome: str, best_run_id: Optional[str]) -> None:
        """``sweep_end`` to ``notify.url``: how the sweep ended, its best trial, the parent run's page
        and the trials' spend (their ``cost/actual_usd``; the parent is no second bill)."""
        from llmctl.controller.notify import from_config
        from llmctl.tracking import mlflow_run as tracking

        notifier = from_config({"notify": self.spec.get("notify") or {}}, lambda text, err=False: _say(text))
        if not notifier.wants("sweep_end"):
            return
        handle = tracking.RunHandle(self.spec["uri"], self.spec["parent_run_id"], self.spec["experiment_id"])
        try:
            runs = state.get_status(self.id).trials
            spent = sum(
                float(self.mc.get_run(t.run_id).data.tags.get("cost/actual_usd") or 0.0) for t in runs if t.run_id
            )
            page = tracking.run_url(handle)
        except Exception:  # the store went away: the message goes without them
            spent, page = None, None
        notifier.send(
            "sweep_end",
            f"llmctl: {ended}" + (f"\nllmctl: open it: {page}" if page else ""),
            sweep_id=self.id,
            run_id=self.spec["parent_run_id"],
            outcome=outcome,
            best_run_id=best_run_id,
            page=page,
            spend_usd=spent,
        )

    def log_best_metrics(self, run_id: str) -> None:
        """The best trial's metrics as the parent's own (latest values, step 0): MLflow's runs table
        then sorts and charts sweeps by their result. Not its ``cost/*``: the parent is no second bill
        (``llmctl cost`` reads those figures from every run)."""
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        best = self.mc.get_run(run_id).data.metrics
        metrics = [Metric(k, v, ms, 0) for k, v in sorted(best.items()) if not k.startswith("cost/")]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.mc.log_batch(self.spec["parent_run_id"], metrics=metrics[i : i + 1000])

    def summarize_search(self) -> None:
        """The parent run gets the study's best parameters and Optuna's importances (params + JSON) and
        Optuna's optimization-history plot."""
        from mlflow.entities import Param

        from llmctl.sweep import search

        try:
            best = self.study.best_trial
        except ValueError:  # no completed trial
            return
        importance = search.importance(self.study)
        params = [Param(f"best.{k}", str(v)) for k, v in best.params.items()]
        params += [Param(f"importance.{k}", f"{v:.4f}") for k, v in importance.items()]
        self.mc.log_batch(self.spec["parent_run_id"], params=params)
        self.mc.log_dict(
            self.spec["parent_run_id"],
            {
                "best_trial": best.number,
                "best_value": best.value,
                "best_params": best.params,
                "importance": importance,
                "n_trials": len(self.study.trials),
                "states": {
                    s: sum(1 for t in self.study.trials if t.state.name == s)
                    for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")
                },
            },
            "search.json",
        )
        self.mc.log_figure(self.spec["parent_run_id"], search.history_figure(self.study), "history.png")


def supervise(d: Path, resumed: bool = False) -> int:
    sup = Supervisor(d)
    state.write_pid(d, os.getpid())
    signal.signal(signal.SIGTERM, sup._cancel)
    signal.signal(signal.SIGINT, sup._cancel)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    total = sup.search["n_trials"] if sup.search else len(sup.spec["trials"])
    _say(f"sweep {sup.id}: {'restarted; ' if resumed else ''}{total} trials, up to {sup.spec['max_parallel']} at once")
    try:
        if resumed:
            sup.adopt()
        else:
            sup.create_children()
        sup.loop()
    except BaseException as exc:
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
    if args and args[0] == "--resume":
        return supervise(Path(args[1]), resumed=True)
    return supervise(Path(args[0]))


if __name__ == "__main__":
    from workloads.protocol.process_exit import exit_process

    exit_process(main())
