"""``plan`` for DPO (``train.objective=dpo``, issue #52): what a preference step holds and costs is
counted before anything is paid for. Each pair is two sequences (chosen, rejected) in one forward,
and every step also runs a reference forward without gradients: with LoRA the base with the adapters
off (no second copy), without it a frozen copy of the starting weights sharded like the policy and
held in bf16. The memory figures are the planner's (``memory_plan``; its DPO cases are held against
torch's memory tracker over the trainer's own DPO step in tests/trainer/test_memory_plan.py); the
FLOPs are the estimate's, checked here against the arithmetic written out.

The same shapes as tests/sky/test_lora_plan.py: Llama-3.1-8B, sequences of 2048 tokens, 8 pairs per
step; LoRA on one H100 with 2 pairs per micro-batch and selective checkpointing, full fine-tuning on
eight."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from sky_helpers import run_cli
from test_lora_plan import EIGHT_B, LORA, ON_H100  # the 8B LoRA job these plans make a DPO job of

ON_8XH100 = ["infra=lambda", "infra.accelerators=H100:8", "train.micro_batch_size=1", "parallel.ac=selective"]
GIB = 2**30


def _dpo(tmp_path: Path) -> list[str]:
    """The DPO overrides, with a tiny preference file of TRL's explicit-prompt records."""
    pairs = tmp_path / "pairs.jsonl"
    records = [
        {"prompt": "What is 2 + 2?", "chosen": "4.", "rejected": "5."},
        {"prompt": "Name a primary colour.", "chosen": "Blue.", "rejected": "Purple, obviously."},
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in records))
    return ["train.objective=dpo", "data=preference", f"data.source={pairs}"]


def _line(stdout: str, start: str) -> str:
    """The plan's line that starts with ``start`` (the resolved config above it left out)."""
    planned = stdout[stdout.index("\n# plan\n") :]
    line = next((ln.strip() for ln in planned.splitlines() if ln.strip().startswith(start)), None)
    assert line, stdout[-4000:]
    return line


def _plan(overrides: list[str]) -> Any:
    """The plan made in this process (SkyPilot's fixture catalog under ``sky_home``)."""
    from llmctl.config.compose import compose
    from llmctl.plan.make import make_plan

    return make_plan(compose(overrides))


def test_an_8b_lora_dpo_job_fits_one_h100_and_names_its_reference(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *EIGHT_B, *ON_H100, *LORA, *_dpo(tmp_path)], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    verdict = _line(out.stdout, "fits:")
    assert "of 80 GiB per H100" in verdict, verdict
    objective = _line(out.stdout, "objective:")
    assert objective.startswith("objective:   dpo | sigmoid, beta 0.1 | reference: the base with adapters off (LoRA)")
    assert "no second copy" in objective, objective
    # the memory plan: two rows per pair, and nothing of a second model
    assert "4 micro-batch(es) of 2 pair(s) (4 sequences)" in out.stdout, out.stdout[-4000:]
    assert "reference: the base with adapters off (LoRA), no second copy" in _line(out.stdout, "dpo:")
    assert "reference (frozen copy" not in out.stdout
    assert "per-token chunked CE (DPO" in _line(out.stdout, "loss kernel:")
    # the estimate counts both sequences of each pair, and the reference's forward on each
    assert "6,553,600 (200 steps x 8 pairs x 2 x 2048)" in _line(out.stdout, "tokens:")
    assert "(200 steps x 8 pairs x 2 sequences x 2048)" in _line(out.stdout, "compute:")
    reference = _line(out.stdout, "reference:")
    assert "the base with adapters off" in reference and "counted above" in reference, reference


def test_a_full_fine_tune_counts_a_bf16_reference_copy_sharded_like_the_policy(
    sky_home: Path, sky_env: dict[str, str], tmp_path: Path
) -> None:
    from workloads.protocol.shape import num_params

    job = [*EIGHT_B, *ON_8XH100, *_dpo(tmp_path)]
    plan = _plan(job)
    mem, m = plan.memory.plan, plan.typed.model
    # Llama-3.1-8B's parameters as the model holds them, each split by rows over the 8 FSDP ranks
    d, hd, kv, ffn, vocab = m.dim, m.dim // m.n_heads, m.n_kv_heads, m.hidden_dim, m.vocab_size
    block = [(d, d), (kv * hd, d), (kv * hd, d), (d, d), (ffn, d), (d, ffn), (ffn, d), (d, 1), (d, 1)]
    shapes = [(vocab, d), *block * m.n_layers, (d, 1), (vocab, d)]  # embedding, blocks, final norm, head
    shard = sum(-(-rows // 8) * cols for rows, cols in shapes)
    assert shard * 8 == num_params(m, exclude_embedding=False) == 8_030_261_248  # every split is even
    rope = 4 * m.max_seq_len * hd  # the copy's own RoPE tables (fp32 cos and sin), as the policy's
    assert mem.reference == 2 * shard + rope  # its shards in bf16, 1.87 GiB + 0.06 GiB of tables
    assert mem.params == 4 * shard + rope  # the policy's: the same shards, in fp32
    assert plan.memory.fits is True, plan.memory.verdict()

    out = run_cli(["plan", *job], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    row = re.search(r"^  reference \(frozen copy, bf16, sharded\)\s+([\d.]+) GiB$", out.stdout, re.M)
    assert row and float(row.group(1)) == round(mem.reference / GIB, 2), out.stdout[-4000:]
    objective = _line(out.stdout, "objective:")
    extra = mem.reference / GIB
    assert f"reference: frozen copy (bf16, sharded like the policy) +{extra:.2f} GiB/device" in objective, objective
    assert "1 micro-batch(es) of 1 pair(s) (2 sequences)" in out.stdout, out.stdout[-4000:]
    assert "a frozen copy of the starting weights" in _line(out.stdout, "reference:")


@pytest.mark.parametrize("lora", [[], LORA], ids=["full", "lora"])
def test_a_dpo_step_is_twice_the_sequences_and_a_reference_forward(
    sky_home: Path, tmp_path: Path, lora: list[str]
) -> None:
    """FLOPs per step: 2 x batch_size sequences through forward and backward (6N + 12LHQT per token;
    LoRA 4N + 6 x adapter params + 12LHQT) and through the reference's forward (2N + 4LHQT), where an
    lm step runs batch_size sequences once: (6 + 2) / 6 x 2 of it without LoRA. With ac=none the
    prior's training time moves by the same factor."""
    from workloads.protocol.shape import num_params

    common = [*EIGHT_B, *ON_8XH100[:2], "parallel.ac=none", *lora]
    lm = _plan(common).estimate
    dpo_plan = _plan([*common, *_dpo(tmp_path)])
    dpo, m = dpo_plan.estimate, dpo_plan.typed.model
    assert dpo.tokens == 2 * lm.tokens == 200 * 2 * 8 * 2048
    reference = 2 * num_params(m) + 4 * m.n_layers * m.dim * 2048  # 2N + 4·L·H·Q·T (H·Q = dim)
    assert dpo.flops_per_token == lm.flops_per_token + reference
    if not lora:
        assert dpo.flops / dpo.steps == pytest.approx(8 / 6 * 2 * lm.flops / lm.steps, rel=1e-12)
        assert dpo.tokens * dpo.flops_per_token * 6 == 8 * 2 * lm.tokens * lm.flops_per_token
        assert dpo.train_s == pytest.approx(8 / 6 * 2 * lm.train_s, rel=1e-9)
    assert "reference's forward" in dpo.describe() and "reference" not in lm.describe()
    assert dpo.to_json()["objective"] == "dpo" and "objective" not in lm.to_json()


def test_dpo_runs_are_their_own_shape(sky_home: Path, tmp_path: Path) -> None:
    """A DPO run's tokens/s is not an lm run's (each token also runs the reference): its shape key
    ends in ``-dpo``, which the transfer reads back (``work.objective_of``), and its regime fields
    parse as an lm key's."""
    from llmctl.cost.estimate import shape_key
    from llmctl.cost.work import objective_of, regime

    common = [*EIGHT_B, *ON_8XH100[:2], "parallel.ac=full"]
    lm, dpo = (shape_key(_plan(o).typed, gpu=True) for o in (common, [*common, *_dpo(tmp_path)]))
    assert dpo == lm + "-dpo"
    assert (objective_of(lm), objective_of(dpo)) == ("lm", "dpo")
    assert regime(dpo) == regime(lm) == ("full", "none")
