"""Shared fixtures: a hermetic working directory and tokenizer cache for the real CLI.

Helpers that tests import live in ``helpers.py``: every conftest.py is imported under the same
module name, so ``from conftest import ...`` would pick whichever conftest was loaded last.
"""

from __future__ import annotations

import os
from pathlib import Path

import cpu_usage
import pytest
from ci_policy import (  # noqa: F401  (hooks: registered by being in this module)
    pytest_collection_modifyitems,
    pytest_make_collect_report,
    pytest_runtest_call,
    pytest_runtest_makereport,
    pytest_xdist_make_scheduler,
)
from cpu_usage import pytest_runtest_protocol  # noqa: F401  (hook: --cpu-report)


def pytest_addoption(parser: pytest.Parser) -> None:
    # here, not in tests/sky/conftest.py: options must be known before collection starts
    parser.addoption(
        "--no-slurm",
        action="store_true",
        default=False,
        help="skip the test that brings up Slurm on localhost (needs root and apt packages)",
    )
    cpu_usage.add_option(parser)


def _split_cores_between_workers() -> None:
    """xdist workers share the cores: every torch they start (in-process or a child) takes its share.

    Without this each training a test starts takes every core: two 80-step smoke launches at once
    took 49-65 s with 2 threads each on a 2-core machine, 27 s with 1 each (alone: 23 s). The trainer
    and torch both honour an explicit ``OMP_NUM_THREADS``; a value the caller set is kept.
    """
    from workloads.planner.hardware import cpu_threads  # stdlib only

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads(workers))  # the trainer's own rule, per worker


_split_cores_between_workers()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenizer/corpus cache per test session, shared by its xdist workers (training the BPE and
    tokenizing the corpus take seconds of CPU, once instead of once per worker): the trainer builds
    each entry once under its cache lock, whichever process asks first (tests/trainer/test_cache_lock.py);
    the workers' base temp directories share a parent, xdist's documented place for session-wide files."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / "llmctl-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture()
def cli_env(cache_dir: Path, tmp_path: Path) -> dict[str, str]:
    from helpers import cli_env_at

    return cli_env_at(tmp_path / "home", cache_dir)
