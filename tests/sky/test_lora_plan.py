"""``plan`` for the fine-tunes most people rent a GPU for (issue #33): Llama-3.1-8B with LoRA fits one
H100 and with QLoRA one 24 GB card (an A10G, AWS's g5.xlarge in the fixture catalog), where the
same 8B trained in full, or with LoRA over an unquantized base on the 24 GB card, is refused. The
figures are the trainer's memory plan (frozen base: no gradients, no AdamW states; the adapters;
NF4 storage), held against torch's memory tracker by tests/trainer/test_memory_plan.py.

A user's choice of shape: sequences of 2048 tokens, 8 per step; LoRA 2 per micro-batch with
selective checkpointing, QLoRA 1 per micro-batch with full checkpointing (a 24 GB card's usual
setting)."""

from __future__ import annotations

import re
from pathlib import Path

from sky_helpers import run_cli
from test_plan_and_rules import _nothing_created

EIGHT_B = [
    "model=llama3.1-8b",
    "train.seq_len=2048",
    "train.batch_size=8",
    "train.dtype=bf16",
    "tracking.uri=http://127.0.0.1:5000",
]
ON_H100 = ["infra=lambda", "infra.accelerators=H100:1", "train.micro_batch_size=2", "parallel.ac=selective"]
ON_A10G = ["infra=aws", "infra.accelerators=A10G:1", "train.micro_batch_size=1", "parallel.ac=full"]
LORA = ["model.lora.rank=16"]
QLORA = [*LORA, "model.lora.quantize_base=nf4"]


def _fit(stdout: str, device: str) -> tuple[str, float]:
    """(verdict line, its GiB per device), checked against the plan's own total."""
    line = next((ln.strip() for ln in stdout.splitlines() if f" GiB per {device}" in ln), None)
    assert line, stdout[-3000:]
    gib = float(re.match(r"(?:fits|DOES NOT FIT): ([\d.]+) GiB of ", line).group(1))
    total = float(re.search(r"^  total\s+([\d.]+) GiB$", stdout, re.M).group(1))
    assert abs(total - gib) < 0.06, (total, line)
    return line, gib


def _lora_line(stdout: str) -> str:
    line = next((ln for ln in stdout.splitlines() if ln.startswith("lora:")), None)
    assert line, stdout[-3000:]
    return line


def test_an_8b_lora_job_fits_one_h100(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *EIGHT_B, *ON_H100, *LORA], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    verdict, gib = _fit(out.stdout, "H100")
    assert verdict.startswith("fits:") and "of 80 GiB per H100" in verdict, verdict
    assert 30 < gib < 75, verdict  # the frozen fp32 base alone is 29.9 GiB
    # PEFT's count for Llama-3.1-8B, r=16 on every linear: 41,943,040 of 8,072,204,288 (0.5196%)
    lora = _lora_line(out.stdout)
    assert "rank 16, alpha 16 on wq,wk,wv,wo,w1,w2,w3: 41.9M trainable params (0.52% of 8.07B" in lora, lora
    assert "base frozen" in lora and "(unquantized)" in lora, lora
    # FLOPs as peers count LoRA: no weight-gradient GEMMs for the frozen base (4N, not 6N)
    flops = re.search(r"; ([\d,.]+) MFLOP/token \(4N \+ 6 x adapter params", out.stdout)
    assert flops and 33_000 < float(flops.group(1).replace(",", "")) < 34_000, out.stdout[-3000:]


def test_an_8b_qlora_job_fits_a_24gb_card(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *EIGHT_B, *ON_A10G, *QLORA], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    verdict, gib = _fit(out.stdout, "A10G")
    assert verdict.startswith("fits:") and "of 24 GiB per A10G" in verdict, verdict
    assert gib > 7, verdict  # NF4 targets 3.35 GiB + the fp32 embedding and head 3.9 GiB
    lora = _lora_line(out.stdout)
    assert "41.9M trainable params" in lora and "targets' weights in nf4: 3.35 GiB" in lora, lora
    assert "g5.xlarge" in out.stdout  # priced from the catalog's 24 GB offer


def test_the_same_8b_without_nf4_or_without_lora_is_refused(sky_env: dict[str, str], tmp_path: Path) -> None:
    """What makes the two fits above LoRA's and NF4's doing: full fine-tuning keeps fp32 gradients and
    two AdamW states for every weight (no change of micro-batch, checkpointing or TP fits one H100),
    and LoRA's unquantized fp32 base alone outgrows 24 GB."""
    full = run_cli(["launch", *EIGHT_B, *ON_H100], tmp_path, sky_env)
    assert full.returncode == 3, full.stdout + full.stderr
    assert "would run out of memory" in full.stderr and "Traceback" not in full.stderr, full.stderr
    unquantized = run_cli(["launch", *EIGHT_B, *ON_A10G, *LORA], tmp_path, sky_env)
    assert unquantized.returncode == 3, unquantized.stdout + unquantized.stderr
    assert "would run out of memory" in unquantized.stderr, unquantized.stderr
    _nothing_created(tmp_path, sky_env)


def test_a_small_models_adapter_is_counted_exactly(sky_env: dict[str, str], tmp_path: Path) -> None:
    """Below a million the plan prints the counts themselves (was ``0.0M ... of 0.00B``), the ones
    the built model has (``contract.shape``'s counts, held against ``lora.apply`` in test_lora_counts.py)."""
    from llmctl.config.compose import compose
    from workloads.protocol import shape
    from workloads.protocol.config import typed

    out = run_cli(["plan", "model=tiny", "model.lora.rank=4"], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    resolved = _lora_line(out.stdout)
    m = typed(compose(["model=tiny", "model.lora.rank=4"]).cfg).model
    trainable, total = shape.lora_params(m), shape.lora_total_params(m)
    assert 0 < trainable < total < 1_000_000
    counted = f": {trainable:,} trainable params ({trainable / total:.2%} of {total:,}, as PEFT counts"
    assert counted in resolved, resolved
