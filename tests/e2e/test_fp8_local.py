"""``train.fp8`` on infra=local without a CUDA device: ``plan`` and ``launch`` exit 3 with one line
naming the key and the fix, before any run or directory exists (tests/sky/test_fp8_plan.py: cloud)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_cli


@pytest.mark.parametrize("command", ["plan", "launch"])
def test_fp8_without_a_local_gpu_is_refused(command: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    from llmctl.plan.devices import local_gpu_count

    if local_gpu_count():
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    out = run_cli([command, "model=tiny", "train.dtype=bf16", "train.fp8=rowwise"], tmp_path, cli_env)
    assert out.returncode == 3, (out.stdout[-2000:], out.stderr)
    message = out.stderr.strip()
    assert message == (
        "error: train.fp8=rowwise needs an FP8 GPU (compute capability >= 8.9: H100, H200, B200, "
        "L40S, L4...); this run targets CPU (no CUDA device). Fix: train.fp8=none"
    ), message
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()
    assert not (tmp_path / "llmctl-runs").exists()


def test_fp8_runs_are_their_own_shape_for_measured_throughput() -> None:
    """The cost estimate only reuses a measured tokens/s from a run of the same shape key: an FP8
    run must not price a bf16 plan (nor the reverse), and the key keeps its dash-separated fields."""
    from llmctl.config.compose import compose
    from llmctl.cost.estimate import shape_key

    cfg = compose(["model=tiny", "train.dtype=bf16"]).cfg
    keys = {r: shape_key({**cfg, "train": {**cfg["train"], "fp8": r}}) for r in ("none", "tensorwise", "rowwise")}
    assert len(set(keys.values())) == 3, keys
    assert "-bf16-" in keys["none"] and "-bf16+fp8rowwise-" in keys["rowwise"]
    assert {len(k.split("-")) for k in keys.values()} == {len(keys["none"].split("-"))}
