"""The baselines ``benchmarks/kernels_cpu.py`` times llmctl's fused path against compute the same thing.

A speed ratio means something only if the contenders train the same model: from the same weights,
the plain-PyTorch Llama (``benchmarks/plain_llama.py``) and transformers' ``LlamaForCausalLM``
(weights through ``export_hf``, its own loss) must give the fused path's loss and gradients.
transformers is the outside oracle here; the plain model is held to it too.
"""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import kernels_cpu


@pytest.mark.parametrize("tie", [False, True])
def test_plain_and_hf_match_the_fused_path(tie):
    cfg = kernels_cpu.model_cfg("smoke")
    cfg.n_layers, cfg.tie_embeddings = 2, tie
    contenders = kernels_cpu.build_contenders(cfg)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    losses, grads = {}, {}
    for name, (model, loss_fn) in contenders.items():
        loss = loss_fn(x, y)
        loss.backward()
        losses[name] = loss.item()
        emb = model.model.embed_tokens if name == "hf" else model.tok_embeddings
        grads[name] = emb.weight.grad
    assert abs(losses["plain"] - losses["fused"]) < 1e-5, losses
    assert abs(losses["hf"] - losses["fused"]) < 1e-5, losses
    for name in ("plain", "hf"):  # the embedding's gradient has passed through every layer
        assert torch.allclose(grads[name], grads["fused"], rtol=1e-4, atol=1e-6), name
