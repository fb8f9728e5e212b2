"""Text generation for eval samples: greedy or temperature sampling, with or without a KV cache.

The cached path reuses the model's own modules (norms, projections, RoPE, FFN) and only changes
how attention sees the past: keys/values of earlier positions are kept per layer instead of
recomputed. Without the cache every step re-runs the full forward — the oracle the cache is
tested against (identical greedy tokens).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from workloads.pretrain.model.transformer import Transformer, TransformerBlock, repeat_kv


class KVCache:
    """Per-layer keys and values of the positions seen so far, [batch, positions, kv_heads, head_dim]."""

    def __init__(self) -> None:
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}

    def length(self) -> int:
        return next(iter(self.keys.values())).shape[1] if self.keys else 0

    def extend(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=1)
            v = torch.cat([self.values[layer], v], dim=1)
        self.keys[layer], self.values[layer] = k, v
        return k, v


def _cached_block(
    block: TransformerBlock, layer: str, x: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    attn = block.attention
    bs, s, _ = x.shape
    h = block.attention_norm(x)
    q = attn.wq(h).view(bs, s, -1, attn.head_dim)
    k = attn.wk(h).view(bs, s, -1, attn.head_dim)
    v = attn.wv(h).view(bs, s, -1, attn.head_dim)
    q, k = attn.rotate(q, cos[pos:], sin[pos:]), attn.rotate(k, cos[pos:], sin[pos:])
    k, v = cache.extend(layer, k, v)
    n_rep = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, repeat_kv(k, n_rep), repeat_kv(v, n_rep)))
    # new position pos+i may attend to every cached position j <= pos+i
    mask = torch.ones(s, k.shape[2], dtype=torch.bool, device=x.device).tril(diagonal=pos)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    x = x + attn.wo(out.transpose(1, 2).reshape(bs, s, -1))
    return x + block.feed_forward(block.ffn_norm(x))


def _next_logits_cached(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    pos = cache.length()
    h = model.tok_embeddings(tokens)
    for name, block in model.layers.items():
        h = _cached_block(block, name, h, pos, model.freqs_cos, model.freqs_sin, cache)
    return model.output(model.norm(h[:, -1:]))[:, -1].float()


def _pick(
    logits: torch.Tensor, temperature: float, top_k: Optional[int], generator: Optional[torch.Generator]
) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    use_cache: bool = True,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Continue ``prompt`` ([batch, len] token ids) by ``max_new_tokens``; returns only the new ids.

    ``temperature=0`` is greedy. The total length may not exceed ``model.max_seq_len``.
    """
    if prompt.shape[1] + max_new_tokens > model.max_seq_len:
        raise ValueError(
            f"prompt ({prompt.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds "
            f"model.max_seq_len ({model.max_seq_len})"
        )
    was_training = model.training
    model.eval()
    tokens, new = prompt, []
    cache = KVCache() if use_cache else None
    step_input = prompt
    for _ in range(max_new_tokens):
        if cache is not None:
            logits = _next_logits_cached(model, step_input, cache)
        else:
            logits = model(tokens)[:, -1].float()
        nxt = _pick(logits, temperature, top_k, generator)
        new.append(nxt)
        step_input = nxt[:, None]
        tokens = torch.cat([tokens, step_input], dim=1)
    model.train(was_training)
    return torch.stack(new, dim=1) if new else prompt[:, :0]
