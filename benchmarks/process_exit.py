"""How long a finished llmctl or trainer process takes to exit, with and without ``gc.freeze()``.

    python benchmarks/process_exit.py

Every ``llmctl`` command and every trainer process ends through
``workloads/protocol/process_exit.exit_process``: ``gc.freeze()``, then ``sys.exit``. This
measures what that saves. Each contender is a fresh interpreter that imports what a launch's
controller and worker hold (torch, MLflow with its SQLAlchemy store, pandas), opens a sqlite MLflow
store, prints a marker and exits; the time from the marker to the process's end is its exit time:

- ``plain``: ``sys.exit(0)``, CPython's shutdown as is (its collector passes over every live object);
- ``frozen``: ``exit_process(0)``, what llmctl does.

Rounds alternate the two (the order rotating), ``PROCESS_EXIT_ROUNDS`` of them (default 5); a
contender's figure is its median, the headline the median of the per-round ratios plain / frozen.

Last line: ``process_exit_plain_over_frozen: <ratio>x``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "imported"
CHILD = """
import sys
import torch, pandas, mlflow
from mlflow.tracking import MlflowClient
MlflowClient({uri!r}).search_experiments()
print({mark!r}, flush=True)
{exit}
"""
EXITS = {
    "plain": "sys.exit(0)",
    "frozen": "from workloads.protocol.process_exit import exit_process\nexit_process(0)",
}


def exit_seconds(how: str, uri: str) -> float:
    code = CHILD.format(uri=uri, mark=MARK, exit=EXITS[how])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == MARK:
            t0 = time.perf_counter()
            break
    else:
        raise SystemExit(f"{how}: the child never got to its exit ({proc.wait()})")
    rc = proc.wait()
    took = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{how}: exited {rc}")
    return took


def main() -> None:
    rounds = int(os.environ.get("PROCESS_EXIT_ROUNDS", "5"))
    with tempfile.TemporaryDirectory() as d:
        uri = f"sqlite:///{Path(d) / 'mlflow.db'}"
        exit_seconds("plain", uri)  # creates the store's tables once, outside the timing
        times: dict[str, list[float]] = {k: [] for k in EXITS}
        ratios = []
        for r in range(rounds):
            order = list(EXITS) if r % 2 == 0 else list(reversed(EXITS))
            got = {how: exit_seconds(how, uri) for how in order}
            for how, s in got.items():
                times[how].append(s)
            ratios.append(got["plain"] / got["frozen"])
            print(f"round {r + 1}: plain {got['plain']:.3f} s, frozen {got['frozen']:.3f} s", flush=True)
    for how, ts in times.items():
        print(f"{how:<7} median {statistics.median(ts):.3f} s (min {min(ts):.3f}, max {max(ts):.3f})")
    print(f"process_exit_plain_over_frozen: {statistics.median(ratios):.1f}x")


if __name__ == "__main__":
    main()
