"""The counts ``llmctl plan`` prints for a LoRA run before anything exists (``contract/shape.py``,
stdlib only) against the trainer's model with adapters and an NF4 base, built the trainer's way
(``lora.apply``): trainable parameters, all parameters as PEFT counts them, and the NF4 base's bytes
as torchao's ``NF4Tensor`` stores them."""

from __future__ import annotations

import pytest
import torch

from workloads.pretrain.model import lora, nf4
from workloads.pretrain.model.transformer import build_model
from workloads.protocol import shape
from workloads.protocol.config import typed

# NF4 quantizes whole groups of 64 x 256 weights: every linear here holds whole groups
BASE = dict(name="t", dim=256, hidden_dim=512, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=64)
NF4_TENSORS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


@pytest.mark.parametrize("targets", [None, ["wq", "wv", "w2"]])
def test_plan_counts_equal_the_built_model(targets: list[str] | None) -> None:
    spec = {"rank": 8, "quantize_base": "nf4", **({"targets": targets} if targets else {})}
    cfg = typed({"model": {**BASE, "lora": spec}}).model
    model = build_model(cfg)
    lora.apply(model, cfg.lora, compute_dtype=torch.bfloat16)

    trainable = lora.trainable_parameters(model)
    quantized = nf4.linears(model)
    total = sum(p.numel() for p in model.parameters() if not nf4.is_nf4(p))
    total += sum(m.weight.numel() for _, m in quantized)
    stored = sum(
        getattr(m.weight, t).numel() * getattr(m.weight, t).element_size() for _, m in quantized for t in NF4_TENSORS
    )

    assert trainable == shape.lora_params(cfg) > 0
    assert total == shape.lora_total_params(cfg)
    assert len(quantized) == cfg.n_layers * len(cfg.lora.targets)
    assert stored == shape.nf4_base_bytes(cfg, 2)
    plain = typed({"model": {**BASE, "lora": {**spec, "quantize_base": "none"}}}).model
    assert shape.nf4_base_bytes(plain, 2) == 0
