"""Shared fixtures: a hermetic working directory and tokenizer cache for the real CLI.

Helpers that tests import live in ``helpers.py``: every conftest.py is imported under the same
module name, so ``from conftest import ...`` would pick whichever conftest was loaded last.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    # here, not in tests/sky/conftest.py: options must be known before collection starts
    parser.addoption(
        "--no-slurm",
        action="store_true",
        default=False,
        help="skip the test that brings up Slurm on localhost (needs root and apt packages)",
    )


# Test files that take minutes, longest first (CI's durations). With addopts' `--dist loadfile
# --no-loadscope-reorder` the xdist workers take files in this collection order, so these start first
# and the many short files fill in around them; xdist's own reorder (most tests first) left the
# Slurm file, with 3 tests and 15 minutes, for last.
LONGEST_FIRST = (
    "tests/e2e/test_docs.py",
    "tests/sky/test_slurm_launch.py",
    "tests/e2e/test_sweep_search_e2e.py",
    "tests/e2e/test_lifecycle.py",
    "tests/e2e/test_resume.py",
    "tests/e2e/test_sweep_e2e.py",
    "tests/e2e/test_eval_e2e.py",
    "tests/e2e/test_runs_local.py",
    "tests/e2e/test_schedule_extend.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: files keep their order


def _split_cores_between_workers() -> None:
    """xdist workers share the cores: every torch they start (in-process or a child) takes its share.

    Without this each training a test starts takes every core: two 80-step smoke launches at once
    took 49-65 s with 2 threads each on a 2-core machine, 27 s with 1 each (alone: 23 s). The trainer
    and torch both honour an explicit ``OMP_NUM_THREADS``; a value the caller set is kept.
    """
    from workloads.pretrain.contract.hardware import cpu_threads  # stdlib only

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads(workers))  # the trainer's own rule, per worker


_split_cores_between_workers()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenizer/corpus cache per test session (training the BPE takes a few seconds)."""
    return tmp_path_factory.mktemp("llmctl-cache")


@pytest.fixture()
def cli_env(cache_dir: Path, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}
    env.update(
        {
            "LLMCTL_CACHE_DIR": str(cache_dir),
            "PYTHONUNBUFFERED": "1",
            "HOME": str(tmp_path / "home"),
            "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    (tmp_path / "home").mkdir(exist_ok=True)
    return env
