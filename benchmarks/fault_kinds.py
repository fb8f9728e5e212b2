"""Faults, N trials of each kind: is every run left in a true terminal state, closed, billed to its job's end?

Issue #32's fault benchmark, the sibling of ``chaos_resume.py`` (which checks what a resume makes of a
SIGTERM or SIGKILL at a random step; this one checks how each kind of fault leaves the run). Each trial
is a real ``llmctl launch`` of the smoke experiment on this machine (tiny model, CPU/gloo, a checkpoint
every 2 steps) in a fresh directory and tracking store, with one fault:

- ``sighup``: SIGHUP to the controller while it trains (its SSH session dropped): PREEMPTED, exit 75.
- ``sigterm``: SIGTERM to the controller while it trains (a spot reclaim, ``llmctl down``): PREEMPTED.
- ``sigterm_after_last``: SIGTERM once every step ran and the final checkpoint is committed (2
  processes, the workers held at exit): FINISHED, exit 0.
- ``controller_error``: the controller raises as the workload prints step 4
  (``LLMCTL_TEST_RAISE_ON``, injected by tests/inject/sitecustomize.py): FAILED, exit 1, the error named.
- ``tracking_lost_on_close``: a real ``mlflow server`` is SIGKILLed just before the controller closes
  a finished attempt (``LLMCTL_TEST_BEFORE_CLOSE``), restarted, then ``llmctl status`` closes the run:
  FINISHED.
- ``sigkill_then_status``: SIGKILL to the controller while it trains; its workers die when their
  output pipe breaks; then ``llmctl status`` closes the run: FAILED.

After each trial, from the tracking store and /proc: the run has the kind's MLflow status and
``llmctl.status``, the controller's exit code is the outcome table's; nothing in the store is RUNNING;
every ``llmctl.attempt.<n>.start`` has its ``.end``, no later than the moment the checks began (billed
to the job's end, not to whoever looked); the run's pids.json controller and workers, and every
process seen below the workers while it ran, are gone; the newest complete checkpoint
(``checkpoint_layout.latest_complete``) is at least the step the fault allows and loads into the
model with the trainer's own loader (``workloads.pretrain.evaluate.load_model``), all weights finite.

Knobs: ``FAULT_TRIALS`` (trials per kind, default 3), ``FAULT_KINDS`` (comma-separated subset, default
all), ``LLMCTL_CACHE_DIR`` (tokenizer cache to reuse; default a fresh one). Usage:
``python benchmarks/fault_kinds.py`` (no arguments). One line per kind ``<kind>: k/N``, last
``fault_kinds: <passed>/<total>``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]  # the e2e tests' helpers

from helpers import cli_env_at, free_port, mlflow_client, mlflow_runs, run_cli, with_faults  # noqa: E402
from test_fault_close import _serve, _servers  # noqa: E402
from test_lifecycle import SMALL, _run_id, _start, _steps  # noqa: E402

from llmctl.controller.procs import descendants, same_process, start_time  # noqa: E402
from llmctl.cost import ledger  # noqa: E402
from llmctl.run.outcomes import RULES, Outcome  # noqa: E402

FOREVER = [*SMALL, "train.steps=100000"]  # stopped by the fault; checkpoint.every=2
WAIT_S = 600  # for a step or an exit on a loaded 2-core machine: a bound against hangs, not a timing


@dataclass
class Trial:
    """What one fault left behind, for ``check``."""

    cwd: Path
    uri: str  # where the run is read back (a restarted server's sqlite file for tracking_lost_on_close)
    outcome: Outcome
    status_prefix: str  # of ``llmctl.status``
    looked: float  # when the checks began: no attempt may end after it
    min_step: int  # the newest complete checkpoint is at least this step
    seen: dict[int, Optional[int]]  # pid -> start time: every process seen under the run's workers
    problems: list[str]  # what the kind itself found wrong (exit codes, what llmctl said)
    said: str = ""  # the tail of what llmctl printed, for a lost trial's line
    found: str = ""  # the run's MLflow status and llmctl.status, as check() read them


def _sqlite(cwd: Path) -> str:
    return f"sqlite:///{cwd / 'mlflow.db'}"


def _exit(what: str, got: int, want: int) -> list[str]:
    return [] if got == want else [f"{what} exited {got}, not {want}"]


def _note_tree(cwd: Path, seen: dict[int, Optional[int]]) -> None:
    runs = cwd / "llmctl-runs"
    if not runs.exists() or not any(runs.iterdir()):
        return
    pids = runs / _run_id(cwd) / "pids.json"
    if pids.exists():
        workers = int(json.loads(pids.read_text())["workers"])
        for pid in [workers, *descendants(workers)]:
            seen.setdefault(pid, start_time(pid))


def _watch(proc: subprocess.Popen[str], cwd: Path, seen: dict[int, Optional[int]], until: Callable[[], bool]) -> None:
    """Poll until ``until()``, noting every process under the run's workers (for the no-process check)."""
    deadline = time.monotonic() + WAIT_S
    while not until():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the launch ended (exit {proc.returncode}) or hung before its fault")
        _note_tree(cwd, seen)
        time.sleep(0.1)
    _note_tree(cwd, seen)


def _signal_mid_run(sig: signal.Signals) -> Callable[[Path, dict[str, str]], Trial]:
    """``sig`` to the controller once the workload logged two steps: the workers checkpoint and stop."""

    def run(cwd: Path, env: dict[str, str]) -> Trial:
        loss_file = cwd / "losses.jsonl"
        proc = _start(["launch", *FOREVER], cwd, {**env, "LLMCTL_LOSS_FILE": str(loss_file)})
        seen: dict[int, Optional[int]] = {}
        _watch(proc, cwd, seen, lambda: len(_steps(loss_file)) >= 2)
        os.kill(proc.pid, sig)
        _, said = proc.communicate(timeout=WAIT_S)
        problems = _exit("launch", proc.returncode, RULES[Outcome.PREEMPTED].exit_code)
        # min_step 1: any step; check() holds it to the emergency save the workers recorded
        return Trial(cwd, _sqlite(cwd), Outcome.PREEMPTED, "preempted at step ", time.time(), 1, seen, problems, said)

    return run


def sigterm_after_last(cwd: Path, env: dict[str, str]) -> Trial:
    """tests/e2e/test_fault_close.py's stop after the last step: 2 processes (torchrun, which exits 1
    when signalled although its workers end 0), held at exit until the SIGTERM."""
    proc = _start(
        ["launch", *SMALL, "train.steps=2", "parallel.dp_shard=2"], cwd, {**env, "LLMCTL_EXIT_PAUSE_S": "600"}
    )
    seen: dict[int, Optional[int]] = {}

    def completed() -> bool:  # the workload's own fact: every step ran, the final checkpoint committed
        if not (cwd / "mlflow.db").exists() or not (cwd / "llmctl-runs").exists():
            return False
        try:
            return "llmctl.completed" in mlflow_client(_sqlite(cwd)).get_run(_run_id(cwd)).data.tags
        except Exception:  # the run (or the store's tables) may not exist yet
            return False

    _watch(proc, cwd, seen, completed)
    os.kill(proc.pid, signal.SIGTERM)
    _, said = proc.communicate(timeout=WAIT_S)
    problems = _exit("launch", proc.returncode, RULES[Outcome.FINISHED].exit_code)
    return Trial(cwd, _sqlite(cwd), Outcome.FINISHED, "finished: all 2 steps", time.time(), 2, seen, problems, said)


def controller_error(cwd: Path, env: dict[str, str]) -> Trial:
    """The controller raises as the workload prints step 4. Step 2's checkpoint is saved (synchronously)
    before step 3 runs, so it is complete by then."""
    proc = _start(["launch", *FOREVER], cwd, with_faults(env, LLMCTL_TEST_RAISE_ON=" 4/100000 |"))
    seen: dict[int, Optional[int]] = {}
    _watch(proc, cwd, seen, lambda: proc.poll() is not None)  # the fault is the controller's own
    _, said = proc.communicate(timeout=WAIT_S)
    problems = _exit("launch", proc.returncode, 1)
    if not said.strip().splitlines()[-1:][0].startswith("RuntimeError: injected"):
        problems.append("the injected error is not what the controller raised last")
    status = "failed: RuntimeError: injected"
    return Trial(cwd, _sqlite(cwd), Outcome.FAILED, status, time.time(), 2, seen, problems, said)


def tracking_lost_on_close(cwd: Path, env: dict[str, str]) -> Trial:
    """The server is SIGKILLed as the controller starts closing; restarted; ``llmctl status`` closes."""
    port, server_root = free_port(), cwd / "server"
    uri = f"http://127.0.0.1:{port}"
    seen: dict[int, Optional[int]] = {}
    with _servers() as servers:
        servers.append(_serve(server_root, port))
        env = {
            **with_faults(env, LLMCTL_TEST_BEFORE_CLOSE=f"kill -s KILL -- -{servers[0].pid}"),
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",  # fail fast while the server is gone
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
        }
        proc = _start(["launch", *SMALL, "train.steps=2", f"tracking.uri={uri}"], cwd, env)
        _watch(proc, cwd, seen, lambda: proc.poll() is not None)
        _, said = proc.communicate(timeout=WAIT_S)
        problems = _exit("launch", proc.returncode, RULES[Outcome.FINISHED].exit_code)
        if "closes it once the tracking store is reachable" not in said:
            problems.append("the controller did not say how the run gets closed")
        servers.append(_serve(server_root, port))
        looked = time.time()
        out = run_cli(["status", _run_id(cwd), "--tracking-uri", uri], cwd, env)
    problems += _exit("status", out.returncode, 0)
    if "run closed as FINISHED" not in out.stdout:
        problems.append("status did not close the run FINISHED")
    said += out.stdout[-1500:] + out.stderr[-1500:]
    uri = f"sqlite:///{server_root / 'mlflow.db'}"  # the server's own store, read once it is gone
    return Trial(cwd, uri, Outcome.FINISHED, "finished", looked, 2, seen, problems, said)


def sigkill_then_status(cwd: Path, env: dict[str, str]) -> Trial:
    """SIGKILL to the controller at step 4 or later (step 2's checkpoint is in); its workers die when
    they next write to the broken pipe; ``llmctl status`` then finds nothing running and closes it."""
    loss_file = cwd / "losses.jsonl"
    proc = _start(["launch", *FOREVER], cwd, {**env, "LLMCTL_LOSS_FILE": str(loss_file)})
    seen: dict[int, Optional[int]] = {}
    _watch(proc, cwd, seen, lambda: max(_steps(loss_file), default=0) >= 4)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while [p for p, t in seen.items() if same_process(p, t)] and time.monotonic() < deadline:
        time.sleep(0.2)
    looked = time.time()
    out = run_cli(["status", _run_id(cwd)], cwd, env)
    problems = _exit("status", out.returncode, 0)
    if "run closed as FAILED" not in out.stdout:
        problems.append("status did not close the run FAILED")
    said = out.stdout[-1500:] + out.stderr[-1500:]
    return Trial(cwd, _sqlite(cwd), Outcome.FAILED, "job exited", looked, 2, seen, problems, said)


KINDS: dict[str, Callable[[Path, dict[str, str]], Trial]] = {
    "sighup": _signal_mid_run(signal.SIGHUP),
    "sigterm": _signal_mid_run(signal.SIGTERM),
    "sigterm_after_last": sigterm_after_last,
    "controller_error": controller_error,
    "tracking_lost_on_close": tracking_lost_on_close,
    "sigkill_then_status": sigkill_then_status,
}


def check(t: Trial) -> list[str]:
    """Every way the trial's run falls short; [] when it is closed, billed, cleaned up and loadable."""
    bad = list(t.problems)
    rid = _run_id(t.cwd)
    run = mlflow_client(t.uri).get_run(rid)
    tags = run.data.tags
    status = tags.get("llmctl.status", "")
    t.found = f"{run.info.status} {status[:70]!r}"
    if run.info.status != RULES[t.outcome].mlflow_status or not status.startswith(t.status_prefix):
        bad.append(f"{run.info.status} {status[:80]!r}, not {RULES[t.outcome].mlflow_status} {t.status_prefix!r}")
    running = [r.info.run_id for r in mlflow_runs(t.uri) if r.info.status == "RUNNING"]
    if running:
        bad.append(f"runs left RUNNING: {running}")
    starts = {int(m[1]) for k in tags if (m := re.fullmatch(r"llmctl\.attempt\.(\d+)\.start", k))}
    open_ = sorted(n for n in starts if f"llmctl.attempt.{n}.end" not in tags)
    if not starts or open_:
        bad.append(f"attempts left open: {open_}" if starts else "no attempt recorded")
    late = [(a.n, round(a.end - t.looked, 3)) for a in ledger.attempts(tags) if a.end is not None and a.end > t.looked]
    if late:
        bad.append(f"attempts billed past the checks' start (n, s): {late}")
    rdir = t.cwd / "llmctl-runs" / rid
    pids = json.loads((rdir / "pids.json").read_text())
    recorded = {pids[k]: pids.get(f"{k}_start") for k in ("controller", "workers")}
    left = sorted(p for p, s in {**t.seen, **recorded}.items() if same_process(p, s))
    if left:
        bad.append(f"processes left: {left}")
    min_step = t.min_step
    if t.outcome is Outcome.PREEMPTED:  # the workers' record of their emergency save
        saved = json.loads(tags.get("llmctl.preempted", "{}")).get("checkpoint")
        if saved is None:
            bad.append("preempted without a checkpoint")
        min_step = max(min_step, saved or 0)
    step, unloadable = _checkpoint(rdir, min_step)
    t.found += f"; step-{step} loads; {len({**t.seen, **recorded})} processes, none left"
    return bad + unloadable


def _checkpoint(rdir: Path, min_step: int) -> tuple[Optional[int], list[str]]:
    """The newest complete checkpoint's step, and what is wrong with it: it must be at least
    ``min_step`` and load into the model with the trainer's own loader, every weight finite."""
    import torch

    from workloads.pretrain.evaluate import load_model
    from workloads.protocol import config
    from workloads.protocol.checkpoint_layout import latest_complete, step_dir

    cfg = config.load(str(rdir / "config.yaml"))
    step = latest_complete(str(cfg.checkpoint.dir))
    if step is None or step < min_step:
        return step, [f"newest complete checkpoint {step}, expected at least step {min_step}"]
    try:
        model = load_model(cfg.model, step_dir(str(cfg.checkpoint.dir), step))
    except Exception as exc:  # any failure to load is the finding
        return step, [f"step-{step} does not load: {type(exc).__name__}: {exc}"[:300]]
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        return step, [f"step-{step} holds non-finite weights"]
    return step, []


def main() -> int:
    try:
        trials = int(os.environ.get("FAULT_TRIALS", "3"))
    except ValueError:
        trials = 0
    names = [k.strip() for k in os.environ.get("FAULT_KINDS", ",".join(KINDS)).split(",") if k.strip()]
    unknown = [k for k in names if k not in KINDS]
    if unknown or trials < 1:
        what = f"FAULT_KINDS names {unknown}: use some of {', '.join(KINDS)}" if unknown else ""
        print(f"error: {what or 'FAULT_TRIALS must be a whole number >= 1'}", file=sys.stderr)
        return 3
    passed: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="fault-kinds-") as tmp:
        base = Path(tmp)
        cache = Path(os.environ.get("LLMCTL_CACHE_DIR") or base / "cache")
        for kind in names:
            passed[kind] = 0
            for n in range(1, trials + 1):
                cwd = base / f"{kind}-{n}"
                cwd.mkdir()
                env = cli_env_at(cwd / "home", cache)
                t0 = time.monotonic()
                said = ""
                try:
                    trial = KINDS[kind](cwd, env)
                    said = trial.said
                    bad = check(trial)
                    detail = trial.found if not bad else "; ".join(bad)
                except Exception as exc:  # a trial that breaks is lost, with its reason
                    bad = [f"{type(exc).__name__}: {exc}"]
                    detail = bad[0][:500]
                    traceback.print_exc(file=sys.stderr)
                passed[kind] += not bad
                print(f"{kind} trial {n}: {'ok' if not bad else 'LOST'} - {detail} ({time.monotonic() - t0:.0f} s)")
                if bad and said:
                    print("  llmctl said: " + " | ".join(said.strip().splitlines()[-6:])[-1500:])
                sys.stdout.flush()
            print(f"{kind}: {passed[kind]}/{trials}", flush=True)
    total = sum(passed.values())
    print(f"fault_kinds: {total}/{trials * len(names)}")
    return 0 if total == trials * len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
