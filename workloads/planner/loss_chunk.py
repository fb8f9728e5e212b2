"""How many tokens the fused linear-CE takes per chunk (``losses``), and so what the memory plan
counts for one chunk of logits. Stdlib only: llmctl's plan imports it through ``memory_plan``."""

from __future__ import annotations

# Elements of fp32 logits per chunk (2**25 = 128 MiB) on GPU: the least a chunk holds.
_DEFAULT_CHUNK_ELEMENTS = 1 << 25
# ... and at most this many chunks per micro-batch on GPU. Each chunk adds its product into the
# whole fp32 [vocab, dim] weight gradient, so its traffic scales with the number of chunks (about
# 1 GiB read + written per chunk at 128k x 2048), and a few hundred tokens is a poor GEMM shape.
_GPU_MAX_CHUNKS = 8
# GPU chunks are whole multiples of this many tokens: tensor-core GEMM tiles.
_GPU_TOKEN_MULTIPLE = 128
# On CPU the softmax passes are memory-bound: a 4 MiB chunk stays in cache (the measured effect on
# the training step: docs/benchmarks.md, kernels_cpu).
_CPU_CHUNK_ELEMENTS = 1 << 20
# ... but never fewer than 256 tokens: each chunk adds its grad into the whole [vocab, dim] output
# gradient, so small chunks re-stream it: at the 125m shape's vocabulary, 4 MiB chunks (32 tokens)
# were slower than full logits (docs/benchmarks.md, kernels_cpu, records the run that showed it).
_CPU_MIN_CHUNK_TOKENS = 256


def default_chunk_size(vocab_size: int, device_type: str = "cuda", tokens: int | None = None) -> int:
    """Tokens per chunk. CPU: ~4 MiB of fp32 logits but at least 256 tokens. GPU: a multiple of 128
    tokens, at least ~128 MiB of fp32 logits and, given the micro-batch's ``tokens``, large
    enough that it takes at most 8 chunks (the logits of one chunk are then at most 1/8 of the
    full logits, which is what the memory plan counts)."""
    if device_type == "cpu":
        return max(_CPU_MIN_CHUNK_TOKENS, _CPU_CHUNK_ELEMENTS // max(1, vocab_size))
    m = _GPU_TOKEN_MULTIPLE
    chunk = max(m, _DEFAULT_CHUNK_ELEMENTS // max(1, vocab_size) // m * m)
    if tokens:
        few = -(-tokens // _GPU_MAX_CHUNKS)  # ceil
        chunk = max(chunk, -(-few // m) * m)
    return chunk
