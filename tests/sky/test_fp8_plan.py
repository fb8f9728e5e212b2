"""``train.fp8`` is refused before anything exists where the planned accelerator has no FP8 tensor
cores (SkyPilot's catalog names it: an A100 here), with the key and the fix, by ``plan`` and by
``launch`` (exit 3, no MLflow run, no cluster); on an H100 the same config plans."""

from __future__ import annotations

from pathlib import Path

import pytest
from sky_helpers import REMOTE_URI, run_cli
from test_plan_and_rules import _nothing_created

FP8 = ["infra=lambda", "model=tiny", "train.dtype=bf16", "train.fp8=tensorwise", f"tracking.uri={REMOTE_URI}"]


@pytest.mark.parametrize("command", ["plan", "launch"])
def test_fp8_on_an_a100_is_refused_with_the_fix(command: str, sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli([command, *FP8, "infra.accelerators=A100:4"], tmp_path, sky_env)
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr
    message = out.stderr.strip()
    assert (
        message.startswith("error: train.fp8=tensorwise needs an FP8 GPU (compute capability >= 8.9")
        and len(message.splitlines()) == 1
    ), message
    assert "this run targets A100 (compute capability 8.0)" in message and "Fix: train.fp8=none" in message
    assert "Traceback" not in out.stderr
    _nothing_created(tmp_path, sky_env)


def test_fp8_on_an_h100_plans(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *FP8, "infra.accelerators=H100:8"], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    assert "  fp8: tensorwise" in out.stdout and "8x H100 per node" in out.stdout
    bf16 = run_cli(
        ["plan", *FP8[:-2], "train.fp8=none", f"tracking.uri={REMOTE_URI}", "infra.accelerators=A100:4"],
        tmp_path,
        sky_env,
    )
    assert bf16.returncode == 0, bf16.stderr  # the A100 itself is fine without FP8
