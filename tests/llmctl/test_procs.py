"""Liveness of a recorded process: a process that has only just started is alive.

``subprocess.Popen`` returns once exec has passed its point of no return, before the new program's
arguments are laid out, so /proc/<pid>/cmdline can read empty for a moment. ``status``, ``down``
and ``resume`` check a supervisor or worker they may have started a moment before.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time

from llmctl.controller import procs
from llmctl.sweep import state


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_just_started_recorded_process_is_never_read_as_dead(tmp_path, monkeypatch) -> None:
    """500 spawn/check rounds with every core busy: the product's checks (``pid_alive``, and the
    sweep's ``supervisor_pid``, which holds the pid against its recorded start time) never take a
    live recorded process for a dead one. The raw cmdline is counted too, to show the window is hit."""
    monkeypatch.chdir(tmp_path)
    d = state.sweep_dir("sweep-live")
    d.mkdir(parents=True)
    burners = [
        multiprocessing.Process(target=_burn, args=(600,), daemon=True) for _ in range(multiprocessing.cpu_count())
    ]
    for b in burners:
        b.start()
    misread, empty_cmdlines = [], 0
    try:
        for i in range(500):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            try:
                with open(f"/proc/{child.pid}/cmdline", "rb") as f:
                    empty_cmdlines += not f.read()
                state.write_pid(d, child.pid)
                alive, recorded = procs.pid_alive(child.pid), state.supervisor_pid("sweep-live")
                if not alive or recorded != child.pid:
                    misread.append((i, alive, recorded))
            finally:
                child.kill()
                child.wait()
    finally:
        for b in burners:
            b.kill()
    assert misread == [], f"{len(misread)} of 500 live processes read as dead: {misread[:5]}"
    print(f"cmdline empty right after Popen in {empty_cmdlines} of 500 spawns")


def test_an_exited_or_replaced_process_is_dead(tmp_path) -> None:
    """The other side: a reaped child, a zombie and a pid whose start time differs are not alive."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started = procs.start_time(child.pid)
    assert procs.same_process(child.pid, started) or child.poll() is not None
    while child.poll() is None:
        time.sleep(0.01)
    assert not procs.pid_alive(child.pid)
    assert not procs.same_process(child.pid, started)

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = procs.start_time(sleeper.pid)
        assert procs.same_process(sleeper.pid, started)
        assert not procs.same_process(sleeper.pid, started - 1)
        sleeper.kill()
        deadline = time.monotonic() + 10
        while procs._live(sleeper.pid) is not None and time.monotonic() < deadline:  # zombie until reaped
            time.sleep(0.01)
        assert not procs.same_process(sleeper.pid, started)
    finally:
        sleeper.kill()
        sleeper.wait()
