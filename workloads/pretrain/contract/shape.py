"""The model's shape arithmetic, in one place: FFN width, parameter count, training FLOPs per token.

Stdlib only, over any mapping or object with ``ModelCfg``'s fields, so the model (which builds
these widths), the trainer (MFU) and llmctl's cost estimate (before anything runs) agree by
construction. ``tests/workload/test_model.py`` holds the count against a built model's parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional


def _get(model: Any, key: str) -> Any:
    return model[key] if isinstance(model, Mapping) else getattr(model, key)


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim (same params as a 4*dim MLP), scaled, rounded up."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def hidden_dim(model: Any) -> int:
    """``model.hidden_dim`` when set (a checkpoint's intermediate_size), else Llama's rule."""
    explicit = _get(model, "hidden_dim") if _has(model, "hidden_dim") else None
    if explicit:
        return int(explicit)
    return ffn_hidden_dim(int(_get(model, "dim")), int(_get(model, "multiple_of")), _get(model, "ffn_dim_multiplier"))


def _has(model: Any, key: str) -> bool:
    return key in model if isinstance(model, Mapping) else hasattr(model, key)


def qkv_bias(model: Any) -> bool:
    """Qwen2's q/k/v projections carry biases."""
    arch = _get(model, "arch") if _has(model, "arch") else "llama"
    return str(getattr(arch, "value", arch)) == "qwen2"


def num_params(model: Any, exclude_embedding: bool = True) -> int:
    """N. The input embedding is a lookup (no FLOPs), so by default it is left out; a tied
    embedding still counts once, as the LM head's weight."""
    dim, layers, heads = int(_get(model, "dim")), int(_get(model, "n_layers")), int(_get(model, "n_heads"))
    kv_heads = int(_get(model, "n_kv_heads") or heads)
    vocab, head_dim = int(_get(model, "vocab_size")), dim // heads
    attention = dim * heads * head_dim + 2 * dim * kv_heads * head_dim + heads * head_dim * dim
    if qkv_bias(model):
        attention += heads * head_dim + 2 * kv_heads * head_dim
    block = attention + 3 * dim * hidden_dim(model) + 2 * dim  # q k v o + SwiGLU w1 w2 w3 + two RMSNorms
    n = layers * block + dim + vocab * dim  # + final norm + LM head
    if not exclude_embedding and not bool(_get(model, "tie_embeddings")):
        n += vocab * dim
    return n


def flops_per_token(model: Any, seq_len: int) -> int:
    """Training FLOPs per token: 6N (fwd+bwd matmuls) + 12·L·H·Q·T (attention scores and values).

    PaLM appendix B / nanoGPT / torchtitan; N excludes the input embedding.
    """
    heads = int(_get(model, "n_heads"))
    return (
        6 * num_params(model) + 12 * int(_get(model, "n_layers")) * heads * (int(_get(model, "dim")) // heads) * seq_len
    )
