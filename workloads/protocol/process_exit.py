"""How every llmctl and trainer process ends: ``sys.exit`` after ``gc.freeze()``.

At shutdown CPython clears each imported module and runs its cyclic collector over everything still
alive; with torch, MLflow, SQLAlchemy and pandas loaded that is a few hundred thousand tracked
objects scanned again and again, seconds per process on an idle core and far more on a busy one,
after the work is done (a launch is three processes: controller, torchrun's agent, worker).
Freezing moves every live object out of the collector's reach, so those passes find nothing to
scan. What still runs: ``atexit`` handlers (MLflow's async logging flush), ``finally`` blocks,
reference-count deallocation and the final flush of stdout/stderr; only cycles still alive at exit
are left to the operating system, which reclaims the memory anyway. Stdlib only: llmctl and the
trainer both end through it (docs/benchmarks.md, "process exit", has the measurement).
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn, Union

# Extension modules built with nanobind count their objects still alive when they are unloaded and
# print a "leaked instance" line for each: frozen, triton's objects would be about 30 such lines on
# stderr after every exit (seen on a refused liger run). With one of these loaded the process ends
# through CPython's own shutdown, which frees them first. torch 2.13 imports triton wherever triton
# is installed (its native ops), so trainer processes here take that path: the gain is in llmctl's
# own processes (controller, sweep supervisor and trials, every CLI command).
LEAK_CHECKING = ("triton",)


def exit_process(code: Union[int, str, None]) -> NoReturn:
    """``sys.exit(code)`` without the collector's passes over a finished process's objects (unless a
    module that checks for leaks at unload is loaded)."""
    if not any(name in sys.modules for name in LEAK_CHECKING):
        gc.freeze()
    sys.exit(code)
