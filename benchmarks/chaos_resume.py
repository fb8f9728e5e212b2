"""Chaos: kill training at random moments, ``llmctl resume`` it, check that nothing was lost.

Each trial launches a 2-process tiny-model run (``llmctl launch``, CPU/gloo, checkpoints every 5
steps), waits a random number of steps plus a random fraction of a second, then sends the whole
job either SIGTERM (a spot reclaim: emergency checkpoint, exit 75) or SIGKILL (a dead node: no
warning, possibly mid-save), runs ``llmctl resume RUN_ID`` and compares the per-step fp32 train
losses (``LLMCTL_LOSS_FILE``) with one uninterrupted reference run. A trial survives when the
resume exits 0, the MLflow run is FINISHED with ``llmctl.attempt`` = 2 and one run in the store,
and every step's loss is within 1e-6 of the reference; a stop that lands after the last step and
its final checkpoint must leave the launch itself FINISHED (exit 0, one attempt), with no resume.

The machine is kept loaded on purpose: one CPU-burning process per core runs beside the trials and
is stopped and restarted at random moments (``Burners``), so kills land while the job is slowed,
sped up, mid-checkpoint or mid-start, as on a busy node. Timing that only works on a quiet machine
loses here.

Usage: ``python benchmarks/chaos_resume.py`` (no arguments). Last line: ``chaos_resume: S/N``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRIALS = 20
STEPS = 20
RUN = [
    "experiment=smoke",
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.val_every=10",
    "checkpoint.every=5",
    "parallel.dp_shard=2",
]
TOL = 1e-6


def losses(path: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "train/loss" in rec:
                out[rec["step"]] = rec["train/loss"]
    return out


def llmctl(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmctl", *args], cwd=cwd, env=env, text=True, capture_output=True, timeout=900
    )


def environment(home: Path, cache: Path, loss_file: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}
    env.update(
        {
            "HOME": str(home),
            "LLMCTL_CACHE_DIR": str(cache),
            "PYTHONUNBUFFERED": "1",
            "LLMCTL_LOSS_FILE": str(loss_file),
            "PYTHONPATH": str(ROOT),
            "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    return env


def trial(n: int, rng: random.Random, ref: dict[int, float], base: Path, cache: Path) -> tuple[bool, str]:
    cwd = base / f"trial-{n}"
    cwd.mkdir()
    loss_file = cwd / "losses.jsonl"
    env = environment(base, cache, loss_file)
    sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
    at, delay = rng.randint(1, STEPS - 4), rng.uniform(0.0, 0.5)
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmctl", "launch", *RUN],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    while not any(s >= at for s in losses(loss_file)):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False, f"launch ended before step {at} (exit {proc.returncode})"
        time.sleep(0.02)
    time.sleep(delay)
    rdir = next((cwd / "llmctl-runs").iterdir())
    pgid = json.loads((rdir / "pids.json").read_text())["workers"]
    killed_after = max(losses(loss_file))
    kids = subprocess.run(["pgrep", "-P", str(pgid)], capture_output=True, text=True).stdout.split()
    for pid in [pgid, *map(int, kids)]:  # the whole "node": torchrun and its workers (own sessions)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    proc.wait(timeout=300)
    # a stop that landed after the last step and its checkpoint: FINISHED, exit 0, nothing to resume
    done = proc.returncode == 0
    res = None if done else llmctl(["resume", rdir.name], cwd, env)
    what = f"{sig.name} after step {killed_after} (launch exit {proc.returncode}, " + (
        "no resume needed)" if res is None else f"resume exit {res.returncode})"
    )
    if res is not None and res.returncode != 0:
        return False, what + ": " + (res.stderr.strip().splitlines() or ["?"])[-1]
    from mlflow.tracking import MlflowClient

    mc = MlflowClient(tracking_uri=f"sqlite:///{cwd / 'mlflow.db'}")
    runs = mc.search_runs([e.experiment_id for e in mc.search_experiments()])
    got = losses(loss_file)
    worst = max((abs(got[s] - ref[s]) for s in ref if s in got), default=float("inf"))
    ok = (
        len(runs) == 1
        and runs[0].info.status == "FINISHED"
        and runs[0].data.tags.get("llmctl.attempt") == ("1" if done else "2")
        and sorted(got) == sorted(ref)
        and worst <= TOL
    )
    return ok, f"{what}; max |dloss| {worst:.2e}, attempts {runs[0].data.tags.get('llmctl.attempt') if runs else '-'}"


class Burners:
    """One busy-looping process per core, stopped and restarted at random intervals (1-8 s)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.procs, self.stop = rng, [], threading.Event()
        self.thread = threading.Thread(target=self._toggle, daemon=True)
        self.switches = 0

    def _start(self) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]

    def _kill(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []

    def _toggle(self) -> None:
        while not self.stop.wait(self.rng.uniform(1.0, 8.0)):
            self._kill() if self.procs else self._start()
            self.switches += 1

    def __enter__(self) -> "Burners":
        self._start()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self._kill()


def main() -> int:
    rng = random.Random(int(os.environ.get("CHAOS_SEED", "2026")))
    with tempfile.TemporaryDirectory(prefix="chaos-resume-") as tmp:
        base, cache = Path(tmp), Path(tmp) / "cache"
        ref_dir = base / "reference"
        ref_dir.mkdir()
        t0 = time.monotonic()
        out = llmctl(["launch", *RUN], ref_dir, environment(base, cache, ref_dir / "losses.jsonl"))
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            print("chaos_resume: reference run failed")
            return 1
        ref = losses(ref_dir / "losses.jsonl")
        print(f"reference: {STEPS} steps, 2 processes, {time.monotonic() - t0:.0f} s", flush=True)
        survived = 0
        with Burners(random.Random(rng.random())) as burners:
            for n in range(1, TRIALS + 1):
                t = time.monotonic()
                ok, detail = trial(n, rng, ref, base, cache)
                survived += ok
                print(
                    f"trial {n}: {'survived' if ok else 'LOST'} - {detail} ({time.monotonic() - t:.0f} s,"
                    f" load avg {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
            print(f"CPU burners ({os.cpu_count()} processes) switched on/off {burners.switches} times", flush=True)
    print(f"chaos_resume: {survived}/{TRIALS}")
    return 0 if survived == TRIALS else 1


if __name__ == "__main__":
    sys.exit(main())
