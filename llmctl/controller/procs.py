"""Process bookkeeping: stop requests as exceptions, is a pid still ours, signal a whole process tree.

torchrun starts each worker in a session of its own, so signalling torchrun's process group
does not reach the workers; a hard stop must walk the tree (psutil's, portable).
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


# the stop requests the controller acts on: Ctrl-C, SIGTERM (llmctl down, a scheduler) and SIGHUP
# (the SSH session or terminal it ran in is gone); SIGTERM and SIGHUP are passed to the workers
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def install_stop_handlers(handler: Any, only: Optional[dict[int, Any]] = None) -> dict[int, Any]:
    """``handler`` for each stop signal (or those in ``only``); returns the handlers it replaced. A
    SIGHUP ignored by whoever started llmctl (``nohup``) stays ignored: they asked it to outlive the
    terminal."""
    replaced = {}
    for sig in STOP_SIGNALS if only is None else only:
        if sig == signal.SIGHUP and only is None and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        replaced[sig] = signal.signal(sig, handler)
    return replaced


def ignore_late_stop(signum: int, frame: Any) -> None:
    """A stop request while the attempt is being closed: the job has already ended; finish closing."""


def restore_handlers(previous: dict[int, Any]) -> None:
    """Put back the handlers ``install_stop_handlers`` replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _stat_fields(pid: int) -> Optional[tuple[str, list[str]]]:
    """``(comm, fields after comm)`` of /proc/<pid>/stat, or None when there is no such process.
    comm may hold spaces and parentheses, so it is cut at the first "(" and the last ")"."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    head, _, tail = stat.rpartition(")")
    return head.partition("(")[2], tail.split()


def _looks_like_ours(pid: int, comm: str) -> bool:
    """A python or llmctl program. The command line is empty between exec's point of no return,
    when the parent's ``Popen`` already returns, and the moment the new program's arguments are
    laid out; the kernel names the task (comm) before that window opens, so it is read then."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    text = cmdline if cmdline else comm.encode()
    return b"python" in text or b"llmctl" in text


def _reaped(pid: int) -> bool:
    """True when ``pid`` is our own child that has exited (and is reaped now)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return False


def _live(pid: int) -> Optional[tuple[str, list[str]]]:
    """/proc's view of ``pid`` if it is running (not exited, not a zombie); None otherwise."""
    if _reaped(pid):
        return None
    stat = _stat_fields(pid)
    if stat is None or not stat[1] or stat[1][0] == "Z":
        return None
    return stat


def pid_alive(pid: Optional[int]) -> bool:
    """A live (not zombie) python/llmctl process; reaps it first if it is our exited child."""
    if not pid:
        return False
    if not Path("/proc/self/stat").exists():  # no /proc: only the kernel's word is left
        if _reaped(pid):
            return False
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    stat = _live(pid)
    return stat is not None and _looks_like_ours(pid, stat[0])


def start_time(pid: Optional[int]) -> Optional[int]:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22), or None (no such
    process, no /proc). A pid is reused; a pid and its start time name one process."""
    if not pid:
        return None
    stat = _stat_fields(pid)
    try:
        return int(stat[1][19]) if stat else None
    except (IndexError, ValueError):
        return None


def same_process(pid: Optional[int], started: Optional[int]) -> bool:
    """``pid`` is alive and is still the process that started at ``started`` (see ``start_time``).
    A pid and its start time name one process, so with a recorded start time a live, non-zombie
    pid that matches it is ours whatever its command line reads (it is empty for a moment after
    exec). Without one (an older record, no /proc) only ``pid_alive`` can be checked."""
    if started is None or not pid or not Path("/proc/self/stat").exists():
        return pid_alive(pid)
    stat = _live(pid)
    try:
        return stat is not None and int(stat[1][19]) == started
    except (IndexError, ValueError):
        return False


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren ...): psutil's process tree, the same on
    Linux and macOS."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:  # gone, or not ours to read
        return []


def signal_ranks(agent: int, sig: int) -> None:
    """``sig`` to each rank torchrun's agent ``agent`` started (each leads a session of its own), not
    to the agent: the agent, stopped itself, SIGKILLs its ranks after its shutdown timeout (30 s on
    torch 2.11), however long the grace promised. While no rank runs yet, or when the process table
    cannot be read, the agent gets it: it passes the stop on (within its shutdown timeout, which every
    launch sets past the grace: torch 2.12 and later honour it)."""
    import psutil

    try:
        ranks = [child.pid for child in psutil.Process(agent).children()]
    except psutil.Error:  # gone (then nothing below is signalled), or no process table to read (no /proc)
        ranks = []
    for group in ranks or [agent]:
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass


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


def record_controller(run_id: str) -> None:
    """This process is the run's controller now (``controller.json`` in its folder: pid, start time)."""
    from llmctl.controller.workdir import CONTROLLER_FILE, update_json

    update_json(run_id, CONTROLLER_FILE, pid=os.getpid(), start=start_time(os.getpid()))


def live_controller(run_id: str) -> Optional[int]:
    """The pid of the run's controller when it is alive on this machine (and not this process): it
    closes the run itself, so nobody else may (one closer per run). None when there is none."""
    from llmctl.controller.workdir import CONTROLLER_FILE, read_json

    rec = read_json(run_id, CONTROLLER_FILE)
    pid = rec.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return None
    return pid if same_process(pid, rec.get("start")) else None


def stop_controller(run_id: str, wait_s: float) -> Optional[int]:
    """SIGTERM to the run's live controller (it stops the job its own way and closes the run), then
    wait up to ``wait_s`` for it to exit. Returns its pid if it is still alive after that, else None."""
    import time

    pid = live_controller(run_id)
    if pid is None:
        return None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return None
    deadline = time.monotonic() + wait_s
    while live_controller(run_id) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    return live_controller(run_id)
