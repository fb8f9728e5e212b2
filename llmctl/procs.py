"""Process bookkeeping: stop requests as exceptions, is a pid still ours, signal a whole process tree.

torchrun starts each worker in a session of its own, so signalling torchrun's process group
does not reach the workers; a hard stop must walk the tree (read from /proc, stdlib only).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Optional


class Interrupted(KeyboardInterrupt):
    """A stop request the controller received: SIGINT (Ctrl-C) or SIGTERM (``llmctl down``, a
    scheduler, a sweep's cancel). A KeyboardInterrupt, so every ``except KeyboardInterrupt`` that
    stops child processes still runs; ``signum`` tells the lifecycle which outcome it was."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_STOP_REQUESTS: list[int] = []  # signals this process was asked to stop by, during the current attempt


def note_stop_request(signum: int) -> None:
    """Remember that someone asked this process to stop (a handler that passes the request on,
    e.g. to workers that checkpoint first, still leaves a record of it)."""
    _STOP_REQUESTS.append(signum)


def stop_requested() -> Optional[int]:
    """The first stop signal since ``clear_stop_requests``, or None."""
    return _STOP_REQUESTS[0] if _STOP_REQUESTS else None


def clear_stop_requests() -> None:
    _STOP_REQUESTS.clear()


def raise_interrupted(signum: int, frame: Any) -> None:
    """A signal handler: turn SIGINT/SIGTERM into ``Interrupted`` (and note the request)."""
    note_stop_request(signum)
    raise Interrupted(signum)


def pid_alive(pid: Optional[int]) -> bool:
    """A live (not zombie) python/llmctl process; reaps it first if it is our exited child."""
    if not pid:
        return False
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        return b"python" in cmdline or b"llmctl" in cmdline
    except OSError:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def start_time(pid: Optional[int]) -> Optional[int]:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22), or None (no such
    process, no /proc). A pid is reused; a pid and its start time name one process."""
    if not pid:
        return None
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def same_process(pid: Optional[int], started: Optional[int]) -> bool:
    """``pid`` is alive and is still the process that started at ``started`` (see ``start_time``);
    without a recorded start time (an older record, no /proc) only ``pid_alive`` can be checked."""
    if not pid_alive(pid):
        return False
    return started is None or start_time(pid) == started


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren ...), from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``'s process group and to every descendant (workers in own sessions)."""
    targets = descendants(pid)
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for child in targets:
        try:
            os.kill(child, sig)
        except (ProcessLookupError, PermissionError):
            pass
