"""One torchrun worker of a command workload: runs the user's script (or ``-m`` module) as a child
process and records how it really ended, its exit code or the signal that killed it, where the
node's guard reads it (``$LLMCTL_EXIT_DIR/rank-<RANK>``, JSON).

Why a child and not the script in this process: a rank killed by a signal (the OOM killer's
SIGKILL) or ending through ``os._exit`` (the usual way to skip NCCL's teardown) runs no ``finally``
and leaves no record of its own; its parent sees both. And torchrun counts any non-zero exit as a
failure and stops the other ranks, SIGKILLing them after its shutdown timeout (30 s, fixed on torch
2.11): a rank that stopped with its state saved (75) therefore reports 0 to torchrun, so a slower
rank's save is never cut, while the record keeps the 75 for the guard. Any other ending is passed
on as the worker's own exit, so torchrun stops the ranks a failed one would leave hanging.

A stop (SIGTERM, SIGINT, SIGHUP, SIGUSR1) reaches the program directly: torchrun and the guard signal
the worker's whole process group, the program included; this process only waits for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from workloads.protocol.command import ENV_EXIT_DIR
from workloads.protocol.run_contract import EXIT_PREEMPTED

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


def _record(status: int) -> None:
    """``status`` as ``Popen.returncode`` gives it: an exit code, or minus the killing signal."""
    folder = os.environ.get(ENV_EXIT_DIR)
    if folder:
        fate = {"code": status, "signal": None} if status >= 0 else {"code": None, "signal": -status}
        Path(folder, f"rank-{os.environ.get('RANK', '0')}").write_text(json.dumps(fate))


def worker_exit(status: int) -> int:
    """What this worker tells torchrun: 0 for a saved stop, the program's code otherwise (a signal's
    death as 128 + its number, as a shell reports it)."""
    if status == EXIT_PREEMPTED:
        return 0
    return status if status >= 0 else 128 - status


def main(argv: list[str]) -> int:
    for sig in STOPS:  # a Python handler, not SIG_IGN: the program starts with the default handlers
        signal.signal(sig, lambda signum, frame: None)
    child = subprocess.Popen([sys.executable, *argv])
    status = child.wait()
    _record(status)
    return worker_exit(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
