"""The smallest program that keeps llmctl's run contract: counts steps (a sleep each), logs a
metric per step with plain ``mlflow.log_metric`` (into ``MLFLOW_RUN_ID``), keeps its state in
``$LLMCTL_CHECKPOINT_DIR/state.json`` (saved every step), and on SIGTERM exits 75; a start with
``LLMCTL_RESUME=1`` continues from it.

    python steps.py [--steps 20] [--step_s 0.5] [--lr 0.1]
"""

from __future__ import annotations

import signal

stop = {"asked": False}  # first thing: a stop that comes while mlflow imports is not lost
signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(asked=True))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlflow  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--step_s", type=float, default=0.5)
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()

state_file = Path(os.environ["LLMCTL_CHECKPOINT_DIR"]) / "state.json"
step = 0
if os.environ.get("LLMCTL_RESUME") == "1" and state_file.is_file():
    step = json.loads(state_file.read_text())["step"]
    print(f"program | resumed at step {step}", flush=True)
loss = 1.0 / (1 + args.lr * step)


def save(step: int) -> None:
    """The state, replaced whole (a kill mid-write leaves the previous one)."""
    state_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, state_file)


while step < args.steps and not stop["asked"]:
    time.sleep(args.step_s)
    step += 1
    loss = 1.0 / (1 + args.lr * step)
    mlflow.log_metric("loss", loss, step=step)
    save(step)  # every step: cheap here, and a SIGKILL then loses nothing
    print(f"program | step {step} loss {loss:.4f}", flush=True)
save(step)
mlflow.log_metric("final_loss", loss, step=step)
print(f"program | {'stopped' if stop['asked'] else 'done'} at step {step}", flush=True)
sys.exit(75 if stop["asked"] else 0)
