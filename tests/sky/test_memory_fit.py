"""``plan`` shows memory per device against the accelerator's (SkyPilot's catalog knows it), and
``launch`` refuses a job that will not fit before anything exists, naming the cheapest fix; the
fixed job fits. The per-device numbers are the trainer's memory plan, itself held against torch's
memory tracker (tests/workload/test_memory_plan.py)."""

from __future__ import annotations

import re
from pathlib import Path

from sky_helpers import run_cli
from test_plan_and_rules import _nothing_created

# the example: 8 sequences of 8192 tokens per H100, no activation checkpointing
EIGHT_B = ["infra=lambda", "infra.accelerators=H100:8", "model=8b", "train.seq_len=8192", "train.batch_size=64",
           "train.dtype=bf16", "tracking.uri=http://127.0.0.1:5000"]


def _verdict(stdout: str) -> str:
    line = next((l for l in stdout.splitlines() if " fit" in f" {l.lower()}" and " GiB per " in l), None)
    assert line, stdout[-3000:]
    return line


def test_the_8b_job_is_refused_with_a_fix_and_the_fixed_job_fits(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *EIGHT_B], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    verdict = _verdict(out.stdout)
    assert verdict.strip().startswith("DOES NOT FIT") and "of 80 GiB per H100" in verdict, verdict
    assert "activations saved for backward" in out.stdout and "AdamW states" in out.stdout
    fix = re.search(r"cheapest fix: (.+?) \(", verdict).group(1).split()
    assert fix and all(re.fullmatch(r"(parallel|train)\.\w+=\S+", f) for f in fix), fix

    refused = run_cli(["launch", *EIGHT_B], tmp_path, sky_env)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "would run out of memory" in refused.stderr and f"Fix: add {' '.join(fix)}" in refused.stderr
    assert "Traceback" not in refused.stderr
    _nothing_created(tmp_path, sky_env)

    fixed = run_cli(["plan", *EIGHT_B, *fix], tmp_path, sky_env)
    assert fixed.returncode == 0, fixed.stderr
    assert _verdict(fixed.stdout).strip().startswith("fits:"), _verdict(fixed.stdout)


def test_a_job_that_fits_says_so(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", "infra=lambda", "infra.accelerators=H100:8", "model=8b", "train.seq_len=2048",
                   "train.batch_size=8", "train.dtype=bf16", "parallel.ac=full", "tracking.uri=http://127.0.0.1:5000"],
                  tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    assert _verdict(out.stdout).strip().startswith("fits:")
