"""``plan`` shows memory per device against the accelerator's (SkyPilot's catalog knows it), and
``launch`` refuses a job that will not fit before anything exists, naming the cheapest fix; the
fixed job fits. The per-device numbers are the trainer's memory plan, itself held against torch's
memory tracker (tests/trainer/test_memory_plan.py)."""

from __future__ import annotations

import re
from pathlib import Path

from sky_helpers import run_cli
from test_plan_and_rules import _nothing_created

# the example: 8 sequences of 8192 tokens per H100, no activation checkpointing
EIGHT_B = [
    "infra=lambda",
    "infra.accelerators=H100:8",
    "model=8b",
    "train.seq_len=8192",
    "train.batch_size=64",
    "train.dtype=bf16",
    "tracking.uri=http://127.0.0.1:5000",
]


def _verdict(stdout: str) -> str:
    line = next((ln for ln in stdout.splitlines() if " fit" in f" {ln.lower()}" and " GiB per " in ln), None)
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
    assert "--ignore-memory-plan launches anyway" in refused.stderr  # the way past a plan not yet measured on GPUs
    assert "Traceback" not in refused.stderr
    _nothing_created(tmp_path, sky_env)

    fixed = run_cli(["plan", *EIGHT_B, *fix], tmp_path, sky_env)
    assert fixed.returncode == 0, fixed.stderr
    assert _verdict(fixed.stdout).strip().startswith("fits:"), _verdict(fixed.stdout)


def test_a_job_that_fits_says_so(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(
        [
            "plan",
            "infra=lambda",
            "infra.accelerators=H100:8",
            "model=8b",
            "train.seq_len=2048",
            "train.batch_size=8",
            "train.dtype=bf16",
            "parallel.ac=full",
            "tracking.uri=http://127.0.0.1:5000",
        ],
        tmp_path,
        sky_env,
    )
    assert out.returncode == 0, out.stderr
    assert _verdict(out.stdout).strip().startswith("fits:")


def test_auto_grad_sync_reduces_each_micro_batch_only_where_once_per_step_does_not_fit(
    sky_env: dict[str, str], tmp_path: Path
) -> None:
    """parallel.grad_sync=auto: a 70B job on 64 H100s with tp 4 and 4 micro-batches per rank keeps
    70 GiB of gathered fp32 gradients between micro-batches if FSDP reduces once per step; reducing
    after each keeps them sharded. auto takes that, and the trainer is given it; the 8B job that
    fits either way keeps one reduction per step. Asking for once per step gets it as the fix."""
    seventy = [
        "infra=aws",
        "infra.region=null",
        "infra.nodes=8",
        "infra.accelerators=H100:8",
        "model=llama3.1-70b",
        "parallel.tp=4",
        "parallel.ac=full",
        "train.seq_len=8192",
        "train.batch_size=64",
        "train.micro_batch_size=1",
        "train.dtype=bf16",
        "tracking.uri=http://127.0.0.1:5000",
    ]
    auto = run_cli(["plan", *seventy], tmp_path, sky_env)
    assert auto.returncode == 0, auto.stderr
    assert _verdict(auto.stdout).strip().startswith("fits:"), _verdict(auto.stdout)
    assert "(gradients reduced after each)" in auto.stdout
    assert re.search(r"^  grad_sync: micro_batch$", auto.stdout, re.M), "the resolved config the trainer gets"

    once = run_cli(["plan", *seventy, "parallel.grad_sync=step"], tmp_path, sky_env)
    assert once.returncode == 0, once.stderr
    verdict = _verdict(once.stdout)
    assert verdict.strip().startswith("DOES NOT FIT"), verdict
    assert "cheapest fix: parallel.grad_sync=micro_batch (" in verdict, verdict

    eight = run_cli(
        ["plan", *EIGHT_B[:-1], "parallel.ac=full", "train.micro_batch_size=1", EIGHT_B[-1]], tmp_path, sky_env
    )
    assert eight.returncode == 0, eight.stderr
    assert _verdict(eight.stdout).strip().startswith("fits:"), _verdict(eight.stdout)
    assert "(gradients reduced once, after the last)" in eight.stdout
    assert re.search(r"^  grad_sync: step$", eight.stdout, re.M)


def test_runpods_h100_is_held_against_its_80_gib(sky_env: dict[str, str], tmp_path: Path) -> None:
    """SkyPilot's RunPod catalog writes GiB into ``SizeInMiB`` (an H100 SXM reads 0.08 GiB): the plan
    still knows the card's 80 GiB, so the preset's own 8B job fits, a 70B one does not (it said "fit
    unknown" for both), and the spot rows that carry the on-demand price say so."""
    base = ["infra=runpod", "tracking.uri=http://127.0.0.1:5000"]
    small = run_cli(["plan", *base, "model=llama3.1-8b"], tmp_path, sky_env)
    assert small.returncode == 0, small.stderr
    verdict = _verdict(small.stdout)
    assert verdict.strip().startswith("fits:") and "of 80 GiB per H100-SXM" in verdict, verdict
    spot = [ln for ln in small.stdout.splitlines() if "runpod" in ln and " spot" in ln]
    assert spot and all("spot (= on-demand)" in ln for ln in spot), small.stdout[-3000:]
    big = run_cli(["plan", *base, "model=llama3.1-70b", "train.seq_len=8192"], tmp_path, sky_env)
    assert big.returncode == 0, big.stderr
    verdict = _verdict(big.stdout)
    assert verdict.strip().startswith("DOES NOT FIT") and "of 80 GiB per H100-SXM" in verdict, verdict
