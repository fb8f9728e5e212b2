"""The node-side guard of a command workload: starts the user's program (under torchrun when
``workload.torchrun``) and does for it what the bundled trainer does for itself.

- **The start** is recorded in llmctl's MLflow run (``llmctl.workload_start.<k>``, node rank 0), so
  the ledger bills each start and a managed job's recovery counts as a new attempt.
- **Stops**: SIGTERM, SIGHUP or SIGUSR1 to the guard (a preemption notice, ``llmctl down``,
  ``scancel``), or SIGINT (Ctrl-C, which the controller passes to the guard alone), reaches the
  program once, as SIGTERM; past ``LLMCTL_STOP_GRACE_S`` (+15 s) it is killed.
- **The budget** (``--max-cost``): the same inputs as the trainer's guard (price, billing start,
  earlier spend); the program gets SIGTERM when the spend, plus its grace period and a reserve,
  would pass the limit, and the run is tagged ``llmctl.budget_stop``: the controller closes it
  FINISHED with exit 4, as for the trainer.
- **The exit**: under torchrun, what every rank on this node really did (``rank`` records each
  one's exit code or killing signal): a rank killed by a signal, or ending with any code but 0 or
  75, fails the attempt (exit 1 for a signal), whatever the others said; 75 ("stopped with state
  saved") only when every rank ended 0 or 75 on its own. 75 tags the run ``llmctl.preempted``; the
  guard exits with the program's code (0 after a budget stop).

The program runs in a session of its own, so a signal reaches it once, from here. Under torchrun
the stop goes to the ranks themselves, not to torchrun's agent: the agent would pass it on and
SIGKILL the ranks after its own shutdown timeout (30 s on torch 2.11), shorter than the grace
promised; the ranks get the whole grace (``checkpoint.preempt_grace_s``) and then the hard kill.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import psutil

from workloads.protocol.command import (
    ENV_CHECKPOINT_DIR,
    ENV_EXIT_DIR,
    ENV_RESUME,
    ENV_STOP_GRACE,
    PYTHONS,
    program,
    python_target,
)
from workloads.protocol.run_contract import (
    ENV_ATTEMPT,
    ENV_BILLING_START,
    ENV_ELASTIC_SHUTDOWN,
    ENV_MAX_COST,
    ENV_PRICE,
    ENV_SPENT,
    EXIT_PREEMPTED,
    KILL_AFTER_GRACE_S,
    TAG_BUDGET_STOP,
    TAG_PREEMPTED,
    TAG_START_PREFIX,
    TAG_TASK_ID,
    elastic_shutdown_timeout,
    node_where,
)

RESERVE_S = 5.0  # kept beyond the grace period: the program's last save may run a little long
# SIGINT: Ctrl-C, which the controller passes to this guard alone; the program gets SIGTERM like any stop
STOPS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGINT)


def _num(key: str) -> Optional[float]:
    raw = os.environ.get(key, "").strip()
    return float(raw) if raw else None


class Guard:
    def __init__(
        self,
        cfg: dict[str, Any],
        nproc: int,
        nnodes: int,
        node_rank: int,
        rdzv: Optional[str],
        local_addr: Optional[str] = None,
    ) -> None:
        self.workload = cfg.get("workload") or {}
        self.checkpoint_dir = str((cfg.get("checkpoint") or {}).get("dir") or "")
        self.grace = float((cfg.get("checkpoint") or {}).get("preempt_grace_s") or 0)
        self.nproc, self.nnodes, self.node_rank, self.rdzv = nproc, nnodes, node_rank, rdzv
        self.local_addr = local_addr
        self.main = node_rank == 0
        self.run_id = os.environ.get("MLFLOW_RUN_ID")
        self.attempt = int(os.environ.get(ENV_ATTEMPT, "1") or 1)
        self.start: Optional[int] = None
        self.stop_signal: Optional[int] = None
        self.budget: Optional[dict[str, Any]] = None
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.exit_dir = tempfile.mkdtemp(prefix="llmctl-exit-")

    # ------------------------------------------------------------------ the command

    def argv(self) -> list[str]:
        words = program(self.workload)
        if not self.workload.get("torchrun"):
            return [sys.executable, *words[1:]] if words[0] in PYTHONS else words
        target = python_target(words)
        assert target is not None  # llmctl refused it before launch (protocol.command.check)
        nodes = ["--standalone", "--nnodes=1"] if self.nnodes == 1 else [f"--nnodes={self.nnodes}"]
        if self.nnodes > 1:
            nodes += [f"--node_rank={self.node_rank}", "--rdzv_backend=c10d", f"--rdzv_endpoint={self.rdzv}"]
            # Node 0 serves the rendezvous (the endpoint is its address), said outright: torchrun would
            # guess it from the machine's hostname, which in a container or on a host with several
            # networks resolves to another address, and then no node serves it.
            nodes.append(f"--rdzv_conf=is_host={int(self.node_rank == 0)}")
            if self.local_addr:  # where the other nodes' workers reach this node's (not its hostname's address)
                nodes.append(f"--local_addr={self.local_addr}")
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *nodes,
            f"--nproc_per_node={self.nproc}",
            "-m",
            "workloads.command.rank",
            *target,
        ]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in (self.workload.get("env") or {}).items()})
        env[ENV_CHECKPOINT_DIR] = self.checkpoint_dir
        # a resume (attempt > 1), or a managed job's supervisor rerunning it (an earlier start)
        env[ENV_RESUME] = "1" if (self.start or self.attempt) > 1 else "0"
        env[ENV_STOP_GRACE] = f"{self.grace:g}"
        env[ENV_EXIT_DIR] = self.exit_dir
        # torch >= 2.12's agent waits this long for its ranks after a stop it received itself (a
        # scheduler signalling every process); torch 2.11 ignores it, and gets the stop from here
        env[ENV_ELASTIC_SHUTDOWN] = elastic_shutdown_timeout(self.grace)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    # ------------------------------------------------------------------ the run's facts

    def _client(self) -> Any:
        from mlflow.tracking import MlflowClient

        return MlflowClient()

    def _tag(self, key: str, info: dict[str, Any]) -> None:
        if not (self.main and self.run_id):
            return
        try:
            self._client().set_tag(self.run_id, key, json.dumps({**info, "start": self.start, "attempt": self.attempt}))
        except Exception as exc:  # the controller then reads the exit code alone; the log says why
            print(f"warning: could not tag the run {key} ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)

    def record_start(self) -> None:
        if not (self.main and self.run_id):
            return
        try:
            from mlflow.entities import RunTag

            mc = self._client()
            run = mc.get_run(self.run_id)
            self.start = len([t for t in run.data.tags if t.startswith(TAG_START_PREFIX)]) + 1
            start = {
                "time": round(time.time(), 3),
                "attempt": self.attempt,
                "from_step": None,
                "world_size": self.nproc * self.nnodes,
            }
            where = node_where()
            if where:
                start["where"] = where
            tags = {f"{TAG_START_PREFIX}{self.start}": json.dumps(start)}
            if os.environ.get("SKYPILOT_TASK_ID"):
                tags[TAG_TASK_ID] = os.environ["SKYPILOT_TASK_ID"]
            mc.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        except Exception as exc:
            print(f"warning: recording the start failed ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ stops

    def _signal_program(self, sig: int) -> None:
        """``sig`` to the program: under torchrun to each rank's process group (torchrun starts every
        rank in a session of its own) and only to the agent while no rank runs yet; else to the
        program's group."""
        if self.proc is None or self.proc.poll() is not None:
            return
        groups = [self.proc.pid]
        if self.workload.get("torchrun"):
            try:
                ranks = [child.pid for child in psutil.Process(self.proc.pid).children()]
            except psutil.NoSuchProcess:
                ranks = []
            groups = ranks or groups
        for group in groups:
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                pass

    def _kill_everything(self) -> None:
        """Past the grace period: SIGKILL to the program, torchrun's agent and every process below."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            below = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            below = []
        for pgid in {self.proc.pid, *(p.pid for p in below)}:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in below:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass

    def _stop_program(self) -> None:
        """SIGTERM now, SIGKILL if it is still running past the grace period."""
        self._signal_program(signal.SIGTERM)
        timer = threading.Timer(self.grace + KILL_AFTER_GRACE_S, self._kill_everything)
        timer.daemon = True
        timer.start()

    def on_stop(self, signum: int, frame: Any) -> None:
        if self.stop_signal is None and self.budget is None:
            self.stop_signal = signum
            self._stop_program()

    def budget_deadline(self) -> Optional[float]:
        """When the program must get SIGTERM for its save to end before the spend passes the limit."""
        limit, price = _num(ENV_MAX_COST), _num(ENV_PRICE) or 0.0
        if limit is None or price <= 0:
            return None
        billing_start, spent = _num(ENV_BILLING_START) or time.time(), _num(ENV_SPENT) or 0.0
        return billing_start + (limit - spent) / price * 3600.0 - self.grace - RESERVE_S

    def on_budget(self) -> None:
        if self.stop_signal is not None or self.budget is not None or self.proc is None or self.proc.poll() is not None:
            return
        price, billing_start = _num(ENV_PRICE) or 0.0, _num(ENV_BILLING_START) or time.time()
        spent = (_num(ENV_SPENT) or 0.0) + price * max(0.0, time.time() - billing_start) / 3600.0
        self.budget = {
            "step": None,
            "spent_usd": round(spent, 6),
            "max_cost_usd": _num(ENV_MAX_COST),
            "usd_per_hour": price,
        }
        print(
            f"budget | stopping the program (SIGTERM): spent ${spent:.4f} of ${self.budget['max_cost_usd']:.4f}"
            f" at ${price:.2f}/h, {self.grace:g} s left to save",
            flush=True,
        )
        self._stop_program()

    # ------------------------------------------------------------------ the exit

    def rank_fates(self) -> dict[int, dict[str, Optional[int]]]:
        """Each rank's record on this node (``rank``): ``{"code": int|None, "signal": int|None}``."""
        fates = {}
        for path in Path(self.exit_dir).glob("rank-*"):
            try:
                fates[int(path.name.split("-", 1)[1])] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # a record cut short: that rank's fate is unknown, counted as lost below
        return fates

    def program_code(self, code: int) -> int:
        """The program's exit. Without torchrun, the process's (a signal's death as 128 + its
        number). Under torchrun, every local rank's real ending: a rank killed by a signal fails
        the attempt (1), a rank with no record (killed together with its worker) too, any other
        code but 0 or 75 is the attempt's; 75 only when every rank ended 0 or 75 and one said 75.
        torchrun's own code counts when the ranks ended well but it did not (a rendezvous failed)."""
        if code < 0:
            code = 128 - code
        if not self.workload.get("torchrun"):
            return code
        fates = self.rank_fates()
        if not fates:
            return code  # no rank started (torchrun itself failed): its code and its log say why
        problems = [
            f"rank {rank} was killed by {signal.Signals(fate['signal']).name}"
            if fate.get("signal")
            else f"rank {rank} exited {fate.get('code')}"
            for rank, fate in sorted(fates.items())
            if fate.get("signal") or fate.get("code") not in (0, EXIT_PREEMPTED)
        ]
        lost = self.nproc - len(fates)
        if lost > 0:
            problems.append(f"{lost} rank(s) ended without a record (killed together with their torchrun worker)")
        if problems:
            print(f"program | failed: {'; '.join(problems)}", file=sys.stderr, flush=True)
            codes = [f["code"] for _, f in sorted(fates.items()) if f.get("code") not in (None, 0, EXIT_PREEMPTED)]
            return int(codes[0]) if len(codes) == len(problems) else 1  # a signal or a lost rank: 1
        if any(fate.get("code") == EXIT_PREEMPTED for fate in fates.values()):
            return EXIT_PREEMPTED
        return code

    def run(self) -> int:
        self.record_start()
        previous = {sig: signal.signal(sig, self.on_stop) for sig in STOPS}
        self.proc = subprocess.Popen(self.argv(), env=self.env(), start_new_session=True)
        deadline = self.budget_deadline()
        timer = None
        if deadline is not None:
            timer = threading.Timer(max(0.0, deadline - time.time()), self.on_budget)
            timer.daemon = True
            timer.start()
        try:
            code = self.program_code(self.proc.wait())
        except KeyboardInterrupt:
            self._signal_program(signal.SIGINT)
            code = self.program_code(self.proc.wait())
        finally:
            if timer is not None:
                timer.cancel()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            shutil.rmtree(self.exit_dir, ignore_errors=True)  # the ranks' records, read by program_code
        saved = code == EXIT_PREEMPTED
        if self.budget is not None and code in (0, EXIT_PREEMPTED):
            self._tag(TAG_BUDGET_STOP, {**self.budget, "checkpoint": saved or code == 0})
            return 0
        if saved:
            name = signal.Signals(self.stop_signal).name if self.stop_signal else None
            self._tag(TAG_PREEMPTED, {"step": None, "checkpoint": None, "saved": True, "signal": name, "program": True})
        return code


def main(argv: list[str]) -> int:
    import yaml

    parser = argparse.ArgumentParser(prog="python -m workloads.command")
    parser.add_argument("--config", required=True)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--rdzv-endpoint", default=None)
    parser.add_argument("--local-addr", default=None)
    args = parser.parse_args(argv)
    cfg = yaml.safe_load(Path(args.config).read_text())
    return Guard(cfg, args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint, args.local_addr).run()
