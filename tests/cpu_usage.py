"""Each test's CPU seconds beside its wall time, with ``--cpu-report DIR``.

On CI's 2 cores the suite is CPU-bound (the cores stay ~90% busy), so a faster CI has to cut CPU,
and wall times alone hide where it goes: a test's wall stretches with whatever runs beside it.
Counted: the test process's own CPU and its reaped children's (the real CLI, torchrun, the
trainer, servers a fixture stops), as ``getrusage`` reports them; a daemon nobody reaps (SkyPilot's
API server) is not. One TSV per process in DIR (``nodeid``, wall s, CPU s); ``.ci/run`` passes
``.ci/out/cpu`` and ``.ci/report.py`` prints the tests that used the most.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any, Iterator

import pytest


def add_option(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-report", default=None, metavar="DIR", help="write each test's CPU seconds to DIR")


def pytest_addoption(parser: pytest.Parser) -> None:  # a conftest of its own (its self-test) loads it so
    add_option(parser)


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    out = item.config.getoption("--cpu-report")
    cpu, wall = _cpu_s(), time.monotonic()
    yield
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with (Path(out) / f"{worker}-{os.getpid()}.tsv").open("a") as f:
            f.write(f"{item.nodeid}\t{time.monotonic() - wall:.1f}\t{_cpu_s() - cpu:.1f}\n")
