"""The model's shape arithmetic, in one place: FFN width, parameter count, training FLOPs per token.

Stdlib only, over a ``schema.ModelCfg`` (``config.typed(cfg).model`` for a plain mapping), so the
model (which builds these widths), the trainer (MFU) and llmctl's cost estimate (before anything
runs) agree by construction. ``tests/trainer/test_model.py`` holds the count against a built
model's parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from workloads.pretrain.contract.schema import ModelCfg


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim (same params as a 4*dim MLP), scaled, rounded up."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def hidden_dim(model: ModelCfg) -> int:
    """``model.hidden_dim`` when set (a checkpoint's intermediate_size), else Llama's rule."""
    if model.hidden_dim:
        return int(model.hidden_dim)
    return ffn_hidden_dim(int(model.dim), int(model.multiple_of), model.ffn_dim_multiplier)


def qkv_bias(model: ModelCfg) -> bool:
    """Qwen2's q/k/v projections carry biases."""
    return model.arch == "qwen2"


def num_params(model: ModelCfg, exclude_embedding: bool = True) -> int:
    """N. The input embedding is a lookup (no FLOPs), so by default it is left out; a tied
    embedding still counts once, as the LM head's weight."""
    dim, layers, heads = int(model.dim), int(model.n_layers), int(model.n_heads)
    kv_heads = int(model.n_kv_heads or heads)
    vocab, head_dim = int(model.vocab_size), dim // heads
    attention = dim * heads * head_dim + 2 * dim * kv_heads * head_dim + heads * head_dim * dim
    if qkv_bias(model):
        attention += heads * head_dim + 2 * kv_heads * head_dim
    block = attention + 3 * dim * hidden_dim(model) + 2 * dim  # q k v o + SwiGLU w1 w2 w3 + two RMSNorms
    n = layers * block + dim + vocab * dim  # + final norm + LM head
    if not exclude_embedding and not model.tie_embeddings:
        n += vocab * dim
    return n


def flops_per_token(model: ModelCfg, seq_len: int) -> int:
    """Training FLOPs per token: 6N (fwd+bwd matmuls) + 12·L·H·Q·T (attention scores and values).

    PaLM appendix B / nanoGPT / torchtitan; N excludes the input embedding.
    """
    heads = int(model.n_heads)
    return 6 * num_params(model) + 12 * int(model.n_layers) * heads * (int(model.dim) // heads) * seq_len
