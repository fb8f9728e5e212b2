"""A 2-rank program under torchrun that ends the ways real ones do (stdlib only: no process group is
needed for how a rank ends). Each rank prints ``fates | rank R ready`` once its stop handler is in.

    --fate sigkill      rank 1 is SIGKILLed (what the OOM killer does); rank 0, stopped by torchrun
                        after that, saves and exits 75 as the contract asks
    --fate os_exit      on a stop, every rank ends with os._exit(75) (skipping teardown, as NCCL
                        programs do)
    --fate slow_save    on a stop, every rank takes --save-s seconds to save, then exits 75
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--fate", required=True, choices=["sigkill", "os_exit", "slow_save"])
parser.add_argument("--save-s", type=float, default=0.5)
args = parser.parse_args()
rank = int(os.environ["RANK"])


def saved_after(seconds: float, how: str):
    def handler(signum: int, frame: object) -> None:
        print(f"fates | rank {rank} stopping ({signal.Signals(signum).name}): saving for {seconds:g} s", flush=True)
        time.sleep(seconds)
        print(f"fates | rank {rank} saved", flush=True)
        if how == "os_exit":
            os._exit(75)
        sys.exit(75)

    return handler


signal.signal(signal.SIGTERM, saved_after(args.save_s, "os_exit" if args.fate == "os_exit" else "exit"))
print(f"fates | rank {rank} ready", flush=True)
if args.fate == "sigkill" and rank == 1:
    time.sleep(3)  # rank 0's stop handler is in by now
    os.kill(os.getpid(), signal.SIGKILL)
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    time.sleep(0.2)
sys.exit(1)  # never stopped: the test failed to deliver its stop
