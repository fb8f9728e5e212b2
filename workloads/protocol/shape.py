"""The model's shape arithmetic, in one place: FFN width, parameter count, training FLOPs per token.

Stdlib only, over a ``schema.ModelCfg`` (``config.typed(cfg).model`` for a plain mapping), so the
model (which builds these widths), the trainer (MFU) and llmctl's cost estimate (before anything
runs) agree by construction. ``tests/trainer/test_model.py`` holds the count against a built
model's parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from workloads.protocol.schema import ModelCfg, TrainCfg


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

    With LoRA (``model.lora.rank``) the base is frozen: its matmuls run forward (2N) and produce
    input gradients (2N) but no weight gradients, so the base counts 4N, and the adapters, which
    train, 6 per parameter (``lora_params``), as LoRA's peers count it (the trainer's loss and
    linears skip the frozen weights' gradient GEMMs, so this is the work done). Attention has no
    weights: its 12·L·H·Q·T stays.
    """
    heads = int(model.n_heads)
    attention = 12 * int(model.n_layers) * heads * (int(model.dim) // heads) * seq_len
    if model.lora.rank:
        return 4 * num_params(model) + 6 * lora_params(model) + attention
    return 6 * num_params(model) + attention


def forward_flops_per_token(model: ModelCfg, seq_len: int) -> int:
    """FLOPs of one token's forward (a validation pass): 2N + 4·L·H·Q·T, a third of training's
    without LoRA; with it, the adapters' 2 per parameter too (forward is half a LoRA step, not a third)."""
    heads = int(model.n_heads)
    attention = 4 * int(model.n_layers) * heads * (int(model.dim) // heads) * seq_len
    return 2 * num_params(model) + (2 * lora_params(model) if model.lora.rank else 0) + attention


def sequences_per_step(train: TrainCfg) -> int:
    """Sequences one optimizer step runs through the model (global): ``train.batch_size``, or under
    ``train.objective=dpo``, whose batch counts pairs, twice that (a chosen and a rejected sequence
    per pair, of ``train.seq_len`` positions each: the trainer's ``tokens_per_step``)."""
    return int(train.batch_size) * (2 if train.objective == "dpo" else 1)


def reference_flops_per_token(model: ModelCfg, seq_len: int) -> int:
    """FLOPs per token of DPO's reference forward (``train.objective=dpo``): one forward of the base
    model, no gradients: 2N + 4·L·H·Q·T. The reference is the same model whatever it is made of:
    with LoRA the policy with its adapters off (the adapters' FLOPs are not run), else a frozen copy
    of the starting weights. Each step runs it over the same sequences as the policy."""
    heads = int(model.n_heads)
    return 2 * num_params(model) + 4 * int(model.n_layers) * heads * (int(model.dim) // heads) * seq_len


def _block_linears(model: ModelCfg) -> list[tuple[int, int]]:
    """(in, out) features of one block's linears: q k v o, then SwiGLU's w1 w3 w2."""
    dim, heads = int(model.dim), int(model.n_heads)
    kv_heads, head_dim, hidden = int(model.n_kv_heads or heads), dim // heads, hidden_dim(model)
    return [
        (dim, heads * head_dim),
        (dim, kv_heads * head_dim),
        (dim, kv_heads * head_dim),
        (heads * head_dim, dim),
        (dim, hidden),
        (dim, hidden),
        (hidden, dim),
    ]


def target_linears(model: ModelCfg) -> dict[str, tuple[int, int]]:
    """(in, out) features of one block's linears by the model's names (``schema.LORA_TARGETS``)."""
    return dict(zip(("wq", "wk", "wv", "wo", "w1", "w3", "w2"), _block_linears(model)))


def lora_params(model: ModelCfg) -> int:
    """The adapters' parameters, the only ones LoRA trains: rank x (in + out) per target linear
    per block (A is rank x in, B is out x rank); 0 with ``model.lora.rank=0``."""
    lora = model.lora
    shapes = target_linears(model)
    return int(model.n_layers) * sum(int(lora.rank) * (shapes[t][0] + shapes[t][1]) for t in set(lora.targets))


# QLoRA's NF4 storage (``model/nf4.py``, torchao's and bitsandbytes' defaults): one absmax scale per
# block of 64 weights, the scales quantized to 8 bits in groups of 256 blocks. A weight quantizes
# only if its size is a multiple of both (64 x 256 weights); FSDP must split whole groups.
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256


def nf4_weight_bytes(n: int, compute_bytes: int) -> int:
    """Bytes torchao's ``NF4Tensor`` keeps for ``n`` weights (or a shard's ``n``): two 4-bit codes per
    byte (``quantized_data``), an int8 scale per ``NF4_BLOCK`` weights (``quantized_scalers``) and a
    compute-dtype factor per ``NF4_SCALER_BLOCK`` scales (``quantization_factor``). Each tensor (each
    shard) also keeps its scale mean and 16-entry code table: ``17 * compute_bytes`` more."""
    return n // 2 + n // NF4_BLOCK + n // (NF4_BLOCK * NF4_SCALER_BLOCK) * compute_bytes


def lora_total_params(model: ModelCfg) -> int:
    """Every parameter of the adapted model, the input embedding and the adapters included: the
    denominator of the trainable share as PEFT's ``print_trainable_parameters`` and the trainer's
    LoRA line give it (Llama-3.1-8B, rank 16 on every linear: 41,943,040 of 8,072,204,288)."""
    return num_params(model, exclude_embedding=False) + lora_params(model)


def nf4_base_bytes(model: ModelCfg, compute_bytes: int) -> int:
    """The whole model's NF4 storage under QLoRA (``model.lora.quantize_base=nf4``): every target
    linear's frozen weight, whole (``nf4_weight_bytes`` plus its scale mean and code table); the
    embedding, norms and LM head stay in their own dtype. 0 without NF4."""
    lora = model.lora
    if not lora.rank or lora.quantize_base != "nf4":
        return 0
    shapes = target_linears(model)
    per_block = sum(
        nf4_weight_bytes(i * o, compute_bytes) + 17 * compute_bytes for t, (i, o) in shapes.items() if t in lora.targets
    )
    return int(model.n_layers) * per_block


def _fp8_able(linears: list[tuple[int, int]]) -> int:
    return sum(i * o for i, o in linears if i % 16 == 0 and o % 16 == 0)


def fp8_linear_params(model: ModelCfg) -> int:
    """Weights of the linears ``train.fp8`` runs in FP8: every block linear whose features are both
    multiples of 16 (``parallel/fp8.py``'s ``module_filter``; the LM head stays bf16)."""
    return int(model.n_layers) * _fp8_able(_block_linears(model))


def fp8_flops_per_token(model: ModelCfg, ac: str) -> int:
    """Hardware FLOPs per training token in FP8 linears: 6 per converted weight (forward and
    backward), plus the forward again under ``ac=full`` (``recompute_flops_per_token``: all but w2)."""
    flops = 6 * fp8_linear_params(model)
    if ac == "full":
        flops += 2 * int(model.n_layers) * _fp8_able(_block_linears(model)[:-1])
    return flops


def recompute_flops_per_token(model: ModelCfg, seq_len: int, ac: str) -> int:
    """Hardware FLOPs activation checkpointing adds per token, beyond ``flops_per_token`` (the model
    FLOPs, MFU's numerator, which recompute does not change):

    - ``full``: each block's forward runs again in backward, up to the last tensor backward needs:
      torch's non-reentrant checkpoint stops there, so the block's last matmul (SwiGLU's ``w2``,
      whose output backward does not keep) is not repeated. 2 x the other linears' weights +
      4·L·H·Q·T (attention's forward third of 12·L·H·Q·T). The embedding, final norm and LM head
      are outside the blocks. tests/trainer/test_recompute_flops.py counts the matmuls torch runs.
    - ``selective``: only the ops between matmuls (norms, RoPE, SiLU, adds; ``parallelize.sac_save_ops``
      keeps every matmul and attention output): no matmul FLOPs. Their time (memory-bound) is a
      cost of its own, which llmctl's estimate states as a prior.
    - ``none``: 0.
    """
    if ac != "full":
        return 0
    heads = int(model.n_heads)
    *repeated, _w2 = _block_linears(model)
    linears = int(model.n_layers) * sum(i * o for i, o in repeated)
    return 2 * linears + 4 * int(model.n_layers) * heads * (int(model.dim) // heads) * seq_len
