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
    pytest_make_collect_report,
    pytest_runtest_call,
    pytest_runtest_makereport,
    pytest_xdist_make_scheduler,
    work_unit,
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


# Work units (a test file, or one documentation session: ci_policy.work_unit) that take a minute or
# more, longest first (CI's durations). With addopts' `--dist loadfile --no-loadscope-reorder` the
# xdist workers take units in this collection order, so these start first and the many short files
# fill in around them at the end, where they even out when the workers finish; xdist's own reorder
# (most tests first) left the Slurm file, with few tests and many minutes, for last. Keep it current
# when a unit's share changes (`.ci/run` prints the slowest tests).
LONGEST_FIRST = (
    "tests/sky/test_slurm_launch.py",
    "tests/e2e/test_docs.py::test_doc_commands_run[docs/eval.md]",
    "tests/e2e/test_docs.py::test_doc_commands_run[README.md]",
    "tests/e2e/test_lora_e2e.py",
    "tests/e2e/test_docs.py::test_doc_commands_run[docs/finetune.md]",
    "tests/e2e/test_lifecycle.py",
    "tests/e2e/test_resume.py",
    "tests/e2e/test_sweep_search_e2e.py",
    "tests/e2e/test_command_workload.py",
    "tests/e2e/test_sweep_e2e.py",
    "tests/e2e/test_docs.py::test_doc_commands_run[docs/resume.md]",
    "tests/e2e/test_docs.py::test_doc_commands_run[docs/quickstart.md]",
    "tests/e2e/test_docs.py::test_doc_commands_run[docs/workloads.md]",
    "tests/e2e/test_fault_close.py",
    "tests/e2e/test_eval_e2e.py",
    "tests/e2e/test_runs_local.py",
    "tests/trainer/test_hf_init.py",
    "tests/trainer/test_lora.py",
    "tests/benchmarks/test_fault_kinds.py",
    "tests/benchmarks/test_gpu_agenda.py",
    "tests/trainer/test_compile_fullgraph.py",
    "tests/e2e/test_mlflow_ui.py",
    "tests/e2e/test_launch_e2e.py",
    "tests/e2e/test_concurrent_launch.py",
    "tests/trainer/test_parallel.py",
    "tests/trainer/test_checkpoint.py",
    "tests/e2e/test_run_ids.py",
    "tests/llmctl/test_history_reader.py",
    "tests/e2e/test_smoke.py",
    "tests/sky/test_plan_and_rules.py",
    "tests/sky/test_unpriced.py",
    "tests/e2e/test_cost_ledger.py",
    "tests/trainer/test_train_e2e.py",
    "tests/sky/test_sky_facts.py",
    "tests/trainer/test_grad_accum.py",
    "tests/trainer/test_memory_plan.py",
    "tests/llmctl/test_bad_overrides.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    # stable: units keep their order; a documentation session not listed goes with its file's place
    items.sort(key=lambda item: rank.get(work_unit(item.nodeid), rank.get(item.nodeid.split("::", 1)[0], len(rank))))


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
    from helpers import cli_env_at

    return cli_env_at(tmp_path / "home", cache_dir)
