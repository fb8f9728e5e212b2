"""Slurm's GRES names a GPU (``H100``) but not its memory, and SkyPilot has no Slurm catalog: the
plan takes that name's memory from SkyPilot's cloud catalogs (the table aws/lambda plans already
use), so a Slurm job that will not fit is refused as on a cloud, and one that fits says so;
``infra.device_memory_gib`` still overrides, and a name no catalog lists asks for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sky_helpers import run_cli
from test_memory_fit import EIGHT_B, _verdict
from test_plan_and_rules import _nothing_created

SLURM = ["infra=slurm", "infra.accelerators=H100:8", "tracking.uri=http://127.0.0.1:5000"]
# the case: 70B at seq 8192 on one node of 8 H100s, about 2 TB per GPU
SEVENTY_B = [*SLURM, "model=llama3.1-70b", "train.seq_len=8192", "train.batch_size=64", "train.dtype=bf16"]


def test_listed_memory_is_the_same_name_in_the_cloud_catalogs(sky_home: Path) -> None:
    from llmctl.backends.sky.rules import listed_memory_gib

    assert listed_memory_gib("H100") == (80.0, ["aws", "lambda"])
    assert listed_memory_gib("h100") == (80.0, ["aws", "lambda"])  # GRES names are often lower case
    assert listed_memory_gib("A100") == (40.0, ["aws", "lambda"])  # the 40 GB part, not RunPod's A100-80GB
    assert listed_memory_gib("MI300X") == (None, [])


def test_the_70b_job_on_slurm_is_refused_and_nothing_is_created(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *SEVENTY_B], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    verdict = _verdict(out.stdout)
    assert verdict.strip().startswith("DOES NOT FIT") and "of 80 GiB per H100 (as SkyPilot's" in verdict, verdict
    assert "more devices or a smaller model" in verdict, verdict

    refused = run_cli(["launch", *SEVENTY_B], tmp_path, sky_env)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "the job would run out of memory: DOES NOT FIT" in refused.stderr and "Traceback" not in refused.stderr
    _nothing_created(tmp_path, sky_env)


def _fit(overrides: list[str]) -> Any:
    """The plan's MemoryFit, planned in this process (SkyPilot imported once for the module)."""
    from llmctl.config.compose import compose
    from llmctl.plan.make import make_plan

    return make_plan(compose(overrides)).memory


def test_slurm_names_the_same_fix_as_lambda_and_the_fixed_8b_job_fits(sky_home: Path) -> None:
    eight_b = [a for a in EIGHT_B if not a.startswith(("infra=", "infra.accelerators=", "tracking.uri="))]
    lam, slurm = _fit(EIGHT_B), _fit([*SLURM, *eight_b])
    assert slurm.fits is False and slurm.fix and slurm.fix == lam.fix, (slurm.verdict(), lam.verdict())
    assert slurm.device_bytes == lam.device_bytes == 80 * 2**30
    assert _fit([*SLURM, *eight_b, *slurm.fix]).fits is True


def test_device_memory_gib_overrides_and_an_unlisted_name_asks_for_it(sky_home: Path) -> None:
    given = _fit([*SEVENTY_B, "infra.device_memory_gib=4096"])
    assert given.fits is True and given.device_label == "H100 (infra.device_memory_gib)", given.verdict()
    unknown = _fit([*SLURM, "infra.accelerators=MI300X:8", "model=8b"])
    assert unknown.fits is None
    assert unknown.verdict() == (
        "fit unknown: no memory size for MI300X. Fix: infra.device_memory_gib=<GiB per device> to hold the job"
        " against it"
    )
