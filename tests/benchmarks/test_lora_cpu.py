"""``benchmarks/lora_cpu.py`` end to end at a tiny shape (its ``LORA_CPU_*`` knobs), so it cannot rot.

The script builds llmctl's LoRA, PEFT over transformers' Llama and llmctl's QLoRA on the same
weights, refuses to time them unless llmctl's and PEFT's first losses agree, and prints one line per
round and the headline last. Speed is not asserted (the figures of a 2-layer model mean nothing).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

TINY = {
    "LORA_CPU_DIM": "256",
    "LORA_CPU_LAYERS": "2",
    "LORA_CPU_VOCAB": "512",
    "LORA_CPU_BATCH": "2",
    "LORA_CPU_SEQ": "32",
    "LORA_CPU_WARMUP": "1",
    "LORA_CPU_ROUNDS": "3",
    "LORA_CPU_RANK": "4",
}


def test_tiny_run_checks_equal_losses_and_ends_with_the_headline() -> None:
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    env = {**os.environ, **TINY}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lora_cpu.py")],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"lora_cpu_llmctl_over_peft: \d+\.\d\dx", lines[-1]), lines[-1]
    first = re.search(r"step-1 loss llmctl (\S+), peft (\S+), qlora (\S+)", proc.stdout)
    assert first, proc.stdout
    ours, peft, qlora = map(float, first.groups())
    assert abs(ours - peft) <= 1e-4 and ours != qlora  # NF4 changes the base, PEFT does not
    rounds = [line for line in lines if re.match(r"lora_cpu \| round \d+: llmctl [\d,]+, peft [\d,]+, qlora", line)]
    assert len(rounds) == 3, lines
    assert "rank 4, alpha 8" in lines[0] and "2 x 256" in lines[0], lines[0]
