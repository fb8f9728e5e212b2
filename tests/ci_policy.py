"""How the suite runs in CI, as pytest hooks (tests/conftest.py registers them).

- **No silent skip.** Under ``CI=true`` (``.ci/run`` exports it, as hosted CI services do) a test that
  skips, or a module that skips at collection (``pytest.importorskip``), fails instead, except in the
  GPU suite (``tests/gpu``: no CUDA here by design). A skip in CI means a check CI believes it ran did
  not run: a missing oracle (PEFT, transformers), Slurm harness or Chromium. Elsewhere a missing
  prerequisite still skips, so a developer's machine without Slurm runs the rest.
- **No process outlives its test.** Whatever a test body started and left running (a CLI it timed
  out on, a server it forgot) is killed when the test ends; on a 2-core CI machine a leaked trainer
  takes a core from every later test. Fixtures' processes (set up before the body) are theirs to stop.
- **The longest work units start first.** The collection is sorted by each unit's wall time in a CI
  run (``tests/unit_times.tsv``, written by ``python .ci/report.py unit-times``); with addopts'
  ``--dist loadfile --no-loadscope-reorder`` the workers take units in that order, so the long ones
  start first and the many short files fill in around them at the end, where they even out when the
  workers finish (xdist's own reorder, most tests first, left the Slurm file, few tests and many
  minutes, for last). A unit the file does not know counts as short.
- **The documentation sessions spread over the workers.** ``--dist loadfile`` keeps a test file on one
  worker (module fixtures such as a Slurm cluster run once); ``tests/e2e/test_docs.py`` has one
  independent session per document, minutes each, so each is its own work unit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Generator

import psutil
import pytest

GPU_SUITE = "tests/gpu/"
SPLIT_PER_TEST = ("tests/e2e/test_docs.py",)


def in_ci() -> bool:
    """CI sets ``CI=true`` (.ci/run does, as hosted CI services do)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def work_unit(nodeid: str) -> str:
    """The unit a worker takes whole: the test file, or the test itself in ``SPLIT_PER_TEST``."""
    path = nodeid.split("::", 1)[0]
    return nodeid if path in SPLIT_PER_TEST else path


UNIT_TIMES = Path(__file__).with_name("unit_times.tsv")


def unit_times() -> dict[str, float]:
    """``tests/unit_times.tsv``: each work unit's wall seconds in a CI run."""
    rows = (line.split("\t") for line in UNIT_TIMES.read_text().splitlines() if line.strip())
    return {unit: float(seconds) for unit, seconds in rows}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    seconds = unit_times()
    # stable: a unit's tests keep their order, and units of equal (or unknown) time theirs
    items.sort(key=lambda item: -seconds.get(work_unit(item.nodeid), 0.0))


def _skip_counts_as_failure(nodeid: str) -> bool:
    return in_ci() and not nodeid.startswith(GPU_SUITE)


def _skip_reason(longrepr: Any) -> str:
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and _skip_counts_as_failure(item.nodeid):
        report.outcome = "failed"
        report.longrepr = f"CI=true and this test skipped (a check CI did not run): {_skip_reason(report.longrepr)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _skip_counts_as_failure(report.nodeid):
        report.outcome = "failed"
        report.longrepr = f"CI=true and this module skipped at collection: {_skip_reason(report.longrepr)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    left = [p for p in me.children(recursive=True) if p.pid not in before]
    for proc in left:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=30)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with ``work_unit``'s split; any other mode keeps xdist's own scheduler."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class PerUnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return PerUnitScheduling(config, log)
