"""A managed job's recoveries seen while the controller follows it: billed and announced as they happen.

SkyPilot's jobs controller reruns a preempted managed job on new nodes without the launcher; the
workload's new start tag is how llmctl learns of it (``ledger.reconcile`` turns it into the next
attempt, billed at what served it). Reconciling only when the run closes would leave the ledger
one attempt behind and no one told for the rest of the run, so the controller does it every
``POLL_S`` while it follows the job, and sends ``recovered`` for each new attempt.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

from llmctl.cost import ledger
from llmctl.tracking.mlflow_run import RunHandle, client

POLL_S = 10.0


@contextlib.contextmanager
def watched(handle: RunHandle, on_recovery: Optional[Callable[[int, dict[str, str]], None]]) -> Iterator[None]:
    """Reconcile ``handle``'s ledger every ``POLL_S`` in the body; ``on_recovery(n, tags)`` for each
    attempt a recovery opened. None: nothing to watch (a run that cannot recover on its own)."""
    if on_recovery is None:
        yield
        return
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(POLL_S):
            try:
                mc = client(handle.uri)
                opened = ledger.reconcile(mc, handle.run_id)
                if opened is not None:
                    on_recovery(opened, mc.get_run(handle.run_id).data.tags)
            except Exception:  # the store away for a moment: the close reconciles anyway
                continue

    thread = threading.Thread(target=poll, name="llmctl-recoveries", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=POLL_S + 30)


def recovery_line(n: int, tags: dict[str, Any]) -> str:
    """What the terminal (and the ``recovered`` message) says of attempt ``n``."""
    served = tags.get(f"llmctl.attempt.{n}.served")
    step = tags.get(f"llmctl.attempt.{n}.from_step", "?")
    where = f" on {served}" if served else ""
    return f"llmctl: recovered by SkyPilot: attempt {n}{where}, from step {step}"
