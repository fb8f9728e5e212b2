"""The trainer's Liger loss, checked on CPU: Liger's Triton kernels run under triton's interpreter
(``TRITON_INTERPRET=1``) and must match the chunked loss, forward and gradients, in fp32.

On a GPU this is tests/gpu/test_gpu.py's check; here it catches a change in how the trainer calls Liger
(argument order, ``ignore_index``, ``reduction``, ``accum_dtype``) or a Liger release that computes
something else, before GPU time is spent. The interpreter says nothing about speed or the CUDA-only
branches (Liger's in-place ``addmm`` accumulation on CUDA). It runs in a subprocess because the
variable must be set before triton is first imported."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOKENS, DIM, VOCAB = 256, 64, 2048  # every 7th target is ignored (the worker sets them)
TOLERANCE = 1e-5  # relative, fp32: the two differ only in summation order


def _require_the_interpreter() -> None:
    """Skip where triton's interpreter cannot run Liger: triton 3.6 (torch 2.11's) fails inside it
    (``InterpreterError: TypeError('only 0-dimensional arrays can be converted to Python scalars')``),
    3.9 (torch 2.13's) runs the kernels. liger-kernel or triton missing fails in CI (the dev extra
    installs both there: tests/ci_policy.py fails a skip under CI=true) and skips elsewhere."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (liger-kernel==0.8.5, in llmctl-train[dev], brings it)")
    version = importlib.metadata.version("triton")
    if tuple(int(part) for part in version.split(".")[:2]) < (3, 9):
        pytest.skip(
            f"triton {version}'s interpreter cannot run Liger's kernels on CPU (InterpreterError: TypeError "
            "'only 0-dimensional arrays can be converted to Python scalars'); it needs triton >= 3.9"
        )
    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed (pip install liger-kernel==0.8.5; it is in llmctl-train[dev])")


def test_liger_matches_the_chunked_loss_under_the_triton_interpreter(workload_env) -> None:
    _require_the_interpreter()
    env = {**workload_env, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("liger_interpret_worker.py")), *map(str, (TOKENS, DIM, VOCAB))],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    records = {r["reduction"]: r for r in map(json.loads, lines)}
    assert set(records) == {"sum", "mean"}, proc.stdout
    for reduction, r in records.items():
        for key in ("rel_loss", "rel_grad_h", "rel_grad_w"):
            assert r[key] < TOLERANCE, (reduction, key, r)
        assert r["grad_h_ignored_rows_zero"], r  # ignored targets contribute no gradient
    # sum over the kept targets vs their mean: the reductions were not swapped
    kept = TOKENS - len(range(0, TOKENS, 7))
    assert records["sum"]["loss_chunked"] == pytest.approx(records["mean"]["loss_chunked"] * kept, rel=1e-5)
