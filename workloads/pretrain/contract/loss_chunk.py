"""How many tokens the fused linear-CE takes per chunk (``losses``), and so what the memory plan
counts for one chunk of logits. Stdlib only: llmctl's plan imports it through ``memory_plan``."""

from __future__ import annotations

# Elements of fp32 logits per chunk (2**25 = 128 MiB): big enough for efficient matmuls on GPU,
# small enough that a 128k vocabulary still processes a few hundred tokens at a time.
_DEFAULT_CHUNK_ELEMENTS = 1 << 25
# On CPU the softmax passes are memory-bound: a 4 MiB chunk stays in cache. Measured on the smoke
# model's head (2048 tokens x 4096 vocab, 1 thread): 256 tokens/chunk 1.53x F.cross_entropy's
# speed (fwd+bwd), one 8192-token chunk 1.31x.
_CPU_CHUNK_ELEMENTS = 1 << 20
# ... but never fewer than 256 tokens: each chunk adds its grad into the whole [vocab, dim] output
# gradient, so small chunks re-stream it. At vocab 32000 x dim 768 (the 125m shape, 1 thread),
# 32-token chunks (4 MiB) took 6.1 s fwd+bwd for 2048 tokens, full logits 4.9 s, 256-token chunks 4.3 s.
_CPU_MIN_CHUNK_TOKENS = 256


def default_chunk_size(vocab_size: int, device_type: str = "cuda") -> int:
    """Tokens per chunk: one chunk of fp32 logits under ~128 MiB (GPU), or ~4 MiB but at least 256
    tokens (CPU)."""
    if device_type == "cpu":
        return max(_CPU_MIN_CHUNK_TOKENS, _CPU_CHUNK_ELEMENTS // max(1, vocab_size))
    return max(1, _DEFAULT_CHUNK_ELEMENTS // max(1, vocab_size))
