"""The estimate's recompute and FP8 terms (``contract.shape``) against what torch runs: torch's
FLOP counter over a real forward and backward of the trainer's model, with the trainer's own
activation checkpointing, and the linears torchao really converts."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from workloads.pretrain.model.transformer import Transformer, build_model
from workloads.pretrain.parallel.parallelize import apply_ac
from workloads.protocol.config import typed
from workloads.protocol.schema import ModelCfg
from workloads.protocol.shape import (
    fp8_flops_per_token,
    fp8_linear_params,
    lora_params,
    num_params,
    recompute_flops_per_token,
)

B, T, VOCAB = 2, 32, 512


def _model_cfg(**kw) -> ModelCfg:
    base = dict(name="t", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=32, max_seq_len=64)
    return typed({"model": {**base, **kw}}).model


def _step_flops(cfg: ModelCfg, ac: str) -> float:
    """Matmul FLOPs per token of one forward and backward, as torch counts them."""
    torch.manual_seed(0)
    model = build_model(cfg)
    if ac != "none":
        apply_ac(model, ac)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, VOCAB, (B, T), generator=g)
    with FlopCounterMode(display=False) as counter:
        model(x, y).backward()
    return counter.get_total_flops() / (B * T)


def test_full_recompute_adds_what_torch_runs_again_and_selective_no_matmuls() -> None:
    """The reference kernels' attention is plain matmuls, so the counter sees all of it (on CPU it
    does not count SDPA's kernel): full AC adds exactly the blocks' forward but their last matmul."""
    cfg = _model_cfg(kernels="reference")
    none, full, selective = (_step_flops(cfg, ac) for ac in ("none", "full", "selective"))
    assert full - none == recompute_flops_per_token(cfg, T, "full") > 0
    assert selective - none == recompute_flops_per_token(cfg, T, "selective") == 0
    assert recompute_flops_per_token(cfg, T, "none") == 0


def test_fp8_terms_cover_the_linears_torchao_converts() -> None:
    pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'llmctl-train[fp8]')")
    from torchao.float8.float8_linear import Float8Linear

    from workloads.pretrain.parallel import fp8

    for kw in ({}, {"hidden_dim": 40}):  # FFN 64 -> 40 -> 64: not FP8-able, attention is
        cfg = _model_cfg(**kw)
        with torch.device("meta"):
            model = Transformer(cfg)
        fp8.convert(model, "rowwise", fsdp=False)
        converted = [m for m in model.modules() if isinstance(m, Float8Linear)]
        assert fp8_linear_params(cfg) == sum(m.weight.numel() for m in converted) > 0
        assert fp8_flops_per_token(cfg, "none") == 6 * fp8_linear_params(cfg)
        w2 = cfg.n_layers * model.layers["0"].feed_forward.w2.weight.numel()
        repeated = fp8_linear_params(cfg) - (w2 if isinstance(model.layers["0"].feed_forward.w2, Float8Linear) else 0)
        assert fp8_flops_per_token(cfg, "full") == 6 * fp8_linear_params(cfg) + 2 * repeated


def test_lora_flops_per_token_are_what_torch_runs() -> None:
    """LoRA's count (``shape.flops_per_token``: 4N for the frozen base, 6 per adapter parameter)
    against torch's counter over a real forward and backward of the model with adapters: equal but
    for the one thing the count leaves out, as LoRA's peers do: layer 0's q/k/v take the frozen
    embedding's output, which needs no gradient, so their input-gradient GEMMs (base and adapter
    A) never run."""
    from workloads.pretrain.model import lora
    from workloads.protocol.shape import flops_per_token

    cfg = _model_cfg(kernels="reference", lora={"rank": 4})
    torch.manual_seed(0)
    model = build_model(cfg)
    lora.apply(model, cfg.lora)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, VOCAB, (B, T), generator=g)
    with FlopCounterMode(display=False) as counter:
        model(x, y).backward()
    counted = counter.get_total_flops() / (B * T)
    attention = model.layers["0"].attention
    skipped = sum(2 * (m.weight.numel() + m.lora_a.weight.numel()) for m in (attention.wq, attention.wk, attention.wv))
    # within what layer 0's skipped GEMMs (and the adapters' small ones next to them) account for
    assert flops_per_token(cfg, T) - 1.1 * skipped <= counted <= flops_per_token(cfg, T) - skipped
    dense = _model_cfg(kernels="reference")
    assert flops_per_token(dense, T) - flops_per_token(cfg, T) == 2 * num_params(dense) - 6 * lora_params(cfg)
