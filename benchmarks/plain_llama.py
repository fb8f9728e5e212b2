"""The plain-PyTorch Llama that ``kernels_cpu`` holds llmctl's fused path against.

What a competent engineer writes with stock PyTorch ops and nothing else: SDPA with
``is_causal``, ``F.rms_norm``, complex-multiply RoPE, ``F.cross_entropy`` on full logits; the
benchmark steps it with fused AdamW. Its parameter names are the workload's (``layers.0.attention.wq``
...), so it loads the same weights with ``load_state_dict`` and must give the same loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, eps: float):
        super().__init__()
        self.n_heads, self.n_kv, self.hd, self.eps = n_heads, n_kv_heads, dim // n_heads, eps
        self.attention = nn.Module()
        self.attention.wq = nn.Linear(dim, n_heads * self.hd, bias=False)
        self.attention.wk = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.attention.wv = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.attention.wo = nn.Linear(n_heads * self.hd, dim, bias=False)
        self.feed_forward = nn.Module()
        self.feed_forward.w1 = nn.Linear(dim, hidden, bias=False)
        self.feed_forward.w2 = nn.Linear(hidden, dim, bias=False)
        self.feed_forward.w3 = nn.Linear(dim, hidden, bias=False)
        self.attention_norm = nn.RMSNorm(dim, eps=eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        a, h = self.attention, self.attention_norm(x)
        q = a.wq(h).view(b, s, self.n_heads, self.hd)
        k = a.wk(h).view(b, s, self.n_kv, self.hd)
        v = a.wv(h).view(b, s, self.n_kv, self.hd)
        q, k = rope(q, freqs), rope(k, freqs)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.n_kv != self.n_heads,
        )
        x = x + a.wo(out.transpose(1, 2).reshape(b, s, -1))
        f, h = self.feed_forward, self.ffn_norm(x)
        return x + f.w2(F.silu(f.w1(h)) * f.w3(h))


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Meta's Llama RoPE: consecutive pairs as complex numbers times e^(i pos theta)."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * freqs[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(-2).type_as(x)


class PlainLlama(nn.Module):
    """forward(tokens, targets) -> mean cross-entropy over full fp32 logits."""

    def __init__(
        self,
        vocab: int,
        dim: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        hidden: int,
        max_seq_len: int,
        theta: float,
        eps: float,
        tie: bool,
    ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, n_heads, n_kv_heads, hidden, eps) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight
        hd = dim // n_heads
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, self.freqs)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def from_model_cfg(cfg) -> PlainLlama:
    """The plain model for a workload ``ModelCfg`` (same shape; load the weights separately)."""
    from workloads.protocol.shape import hidden_dim

    return PlainLlama(
        int(cfg.vocab_size),
        int(cfg.dim),
        int(cfg.n_layers),
        int(cfg.n_heads),
        int(cfg.n_kv_heads or cfg.n_heads),
        hidden_dim(cfg),
        int(cfg.max_seq_len),
        float(cfg.rope_theta),
        float(cfg.norm_eps),
        bool(cfg.tie_embeddings),
    )
