"""Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA), with a reference and a fused kernel path.

Module names follow Llama / torchtitan (``tok_embeddings``, ``layers[i].attention.wq`` ...,
``norm``, ``output``) so tensor-parallel plans and DCP checkpoints can address them by name.
Parallel-friendly by construction: q/k/v are separate linears, attention infers its (possibly
TP-local) head count from the projected tensor, and RoPE tables are non-persistent buffers that
``init_weights`` recomputes after ``to_empty`` (build on ``meta``, shard, materialise, init).

``kernels='reference'`` is the test oracle: explicit softmax attention, hand RMSNorm and full
logits, all numerically plain. ``kernels='fused'`` uses SDPA, ``F.rms_norm``, complex-multiply
RoPE and the chunked fused linear-cross-entropy (Liger-Kernel's Triton version on CUDA when it is
installed).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workloads.pretrain.model.losses import IGNORE_INDEX, chunked_linear_cross_entropy, per_token_cross_entropy
from workloads.protocol.schema import ModelCfg
from workloads.protocol.shape import hidden_dim, qkv_bias
from workloads.protocol.validate import ConfigError


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None, scaling: Any = None):
    """cos/sin of position * theta^(-2i/d), shape [max_seq_len, head_dim // 2], fp32.

    ``scaling``: Llama 3.1's frequency rescaling (``rope_type: llama3``): wavelengths longer than
    the original context divided by ``factor``, shorter than ``original / high_freq_factor`` kept,
    a smooth blend between (Meta's ``apply_scaling``, as transformers computes it).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling:
        inv_freq = _llama3_scaled(
            inv_freq,
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            float(scaling["original_max_position_embeddings"]),
        )
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _llama3_scaled(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: float) -> torch.Tensor:
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    middle = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(middle, blended, out)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x0, x1), (x2, x3)... as Meta's Llama does; x: [b, s, h, d]."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = _per_token(cos, x), _per_token(sin, x)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def _per_token(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A RoPE table broadcast against x [b, s, h, d]: the first s rows of a [max_seq, d/2] table,
    or a [b, s, d/2] table already gathered at each token's position (packed examples)."""
    if table.dim() == 3:
        return table.unsqueeze(2)
    s = x.shape[1]
    return table[:s].view(1, s, 1, -1)


def apply_rope_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` as one complex multiply (Meta's formulation): the fused path's RoPE.

    Same pairs, same math as ``apply_rope``, in one kernel where the real-valued form takes several
    (``benchmarks/kernels_cpu.py`` times the fused path).
    """
    # .float(): the trainer's tables arrive in fp32 (``apply_fsdp`` leaves block inputs uncast);
    # a caller's bf16 tables still rotate in fp32
    freqs = torch.complex(_per_token(cos, x).float(), _per_token(sin, x).float())
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * freqs).flatten(-2).type_as(x)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first half of each head with its second half, as Hugging Face's Llama/Qwen do."""
    cos, sin = _per_token(cos, x), _per_token(sin, x)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, s, kv_heads, d] -> [b, s, kv_heads * n_rep, d]: each kv head serves n_rep query heads."""
    if n_rep == 1:
        return x
    b, s, h, d = x.shape
    return x[:, :, :, None, :].expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 on both paths (bf16 squares lose too much)."""

    def __init__(self, dim: int, eps: float, kernels: str):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.kernels == "fused":
            out = F.rms_norm(xf, (xf.shape[-1],), self.weight.float(), self.eps)
        else:
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return out.type_as(x)

    def reset_parameters(self):
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Causal GQA self-attention. Head counts come from tensor shapes, so TP-sharded q/k/v work."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        kernels: str,
        qkv_bias: bool = False,
        rope_layout: str = "interleaved",
    ):
        super().__init__()
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"need dim % n_heads == 0 and n_heads % n_kv_heads == 0 (got {dim}, {n_heads}, {n_kv_heads})"
            )
        self.head_dim = dim // n_heads
        self.kernels = kernels
        self.rope_layout = rope_layout
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE in this model's layout (the KV-cached generator rotates with it too)."""
        if self.rope_layout == "half":
            return apply_rope_half(x, cos, sin)
        # Under torch.compile Inductor fuses the real-valued form into one kernel (it has no
        # complex codegen); eager runs the complex multiply.
        if self.kernels == "fused" and not torch.compiler.is_compiling():
            return apply_rope_complex(x, cos, sin)
        return apply_rope(x, cos, sin)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``mask``: None for plain causal attention, else [b, 1, s, s]: bool, True where a query may
        attend (block-causal for packed examples), or for fused kernels its ``additive_mask``."""
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        n_rep = q.shape[2] // k.shape[2]
        gqa = n_rep > 1 and self.kernels == "fused" and native_gqa(q, mask)
        if not gqa:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))

        if self.kernels == "fused":
            if mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(self.head_dim)
            if mask is None:
                mask = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).tril()
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            out = probs.to(v.dtype) @ v
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


def native_gqa(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether SDPA should read the kv heads as they are (``enable_gqa``) rather than copies of
    them per query head (``repeat_kv``), for q of this dtype and device and this mask.

    The copies cost bandwidth and their saved activations (kv heads x n_rep per token and layer).
    But not every SDPA kernel takes grouped heads, and one that does not sends SDPA to its math
    kernel, which materialises the [s, s] scores. CPU's flash kernel takes them with or without a
    mask. On CUDA, flash and cuDNN take them for bf16/fp16 without a mask; the memory-efficient
    kernel, CUDA's choice for fp32 and (without cuDNN) for an explicit mask, does not.
    """
    if q.device.type == "cuda":
        return mask is None and q.dtype in (torch.bfloat16, torch.float16)
    return True


def attention_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype q, k and v will have: autocast's, else the residual stream's (bf16 under FSDP's
    bf16 parameters, the trainer's recipe)."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [b, 1, s, s] bool mask as SDPA's additive form (0 where allowed, -inf elsewhere), made
    once per forward: given the bool mask, SDPA would convert it in every layer, and each layer's
    autograd would keep its own s x s copy until the backward (16 layers x 128 MiB per sequence at
    seq 8192 in bf16); this one is shared by all layers."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: h = x + attn(norm(x)); out = h + ffn(norm(h))."""

    def __init__(self, cfg: ModelCfg, kernels: str):
        super().__init__()
        self.attention = Attention(
            cfg.dim,
            cfg.n_heads,
            cfg.n_kv_heads or cfg.n_heads,
            kernels,
            qkv_bias(cfg),
            cfg.rope_layout.value,
        )
        self.feed_forward = FeedForward(cfg.dim, hidden_dim(cfg))
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, kernels)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, kernels)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Causal LM. ``forward(tokens)`` -> logits; ``forward(tokens, targets)`` -> mean loss.

    ``cfg`` is a ``schema.ModelCfg``; its parameter count and FLOPs per token are
    ``shape.num_params`` / ``shape.flops_per_token`` of the same cfg.
    """

    def __init__(self, cfg: ModelCfg):
        super().__init__()
        self.kernels = cfg.kernels.value  # "reference" or "fused"
        self.loss_kernel = cfg.loss_kernel.value  # the fused kernels' loss (``loss_kernel``)
        self.n_layers = cfg.n_layers
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.tie_embeddings = bool(cfg.tie_embeddings)
        self.max_seq_len = cfg.max_seq_len
        self.rope_theta = float(cfg.rope_theta)
        self.rope_scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        # Set by parallelize.apply_tp: the LM head yields vocab-sharded logits (a DTensor), so the
        # loss is plain cross-entropy on them under ``loss_parallel()``, not the chunked kernel.
        self.vocab_parallel_loss = False

        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # ModuleDict keyed "0".."L-1": FQNs stay stable if pipeline stages drop some layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, self.kernels) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, self.kernels)
        self.output = LMHead(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(self.head_dim, self.max_seq_len, self.rope_theta, scaling=self.rope_scaling)
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)
        self.tie_weights()
        if self.output.weight.device.type != "meta":
            self.init_weights()

    def tie_weights(self):
        """Share the input embedding with the LM head (redo after ``to_empty``, which unties)."""
        if self.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None):
        """Initial weights (``init.init_rule``): N(0, 0.02), residual outputs scaled by 1/sqrt(2 L),
        norms 1, biases 0, each parameter from its own (seed, name) generator, so plain and sharded
        (DTensor) parameters get the same values (``init.init_parameters``).

        ``seed`` None: drawn from torch's RNG (deterministic given ``torch.manual_seed``). Call
        after ``to_empty`` on a meta-built (and possibly parallelised) model.
        """
        from workloads.pretrain.model.init_weights import init_parameters

        self.tie_weights()
        self.init_rope(buffer_device)
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        init_parameters(self, seed, self.n_layers)

    @torch.no_grad()
    def init_rope(self, device: torch.device | None = None):
        """The RoPE tables (buffers ``to_empty`` leaves uninitialised; weights loaded from a
        checkpoint need only these)."""
        device = device or self.freqs_cos.device
        self.freqs_cos, self.freqs_sin = rope_tables(
            self.head_dim, self.max_seq_len, self.rope_theta, device=device, scaling=self.rope_scaling
        )

    def hidden_states(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final-norm hidden states [b, s, dim], before the LM head.

        ``positions`` / ``doc_ids`` ([b, s], packed examples): each token's position within its
        example (RoPE) and its example's index; attention then never crosses examples.
        """
        seqlen = tokens.shape[1]
        if seqlen > self.freqs_cos.shape[0]:
            raise ValueError(f"sequence length {seqlen} exceeds model.max_seq_len {self.freqs_cos.shape[0]}")
        cos, sin, mask = self.freqs_cos, self.freqs_sin, None
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        if doc_ids is not None:
            causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=tokens.device).tril()
            mask = ((doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)) & causal).unsqueeze(1)
        h = self.tok_embeddings(tokens)
        if mask is not None and self.kernels == "fused":
            mask = additive_mask(mask, attention_dtype(h))
        for block in self.layers.values():
            h = block(h, cos, sin, mask)
        return self.norm(h)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Logits, or with ``targets`` the cross-entropy over targets that are not IGNORE_INDEX:
        their mean, or with ``reduction="sum"`` their sum (training divides it by the global
        batch's count of targets, so the loss is exact whatever the ranks and micro-batches), or
        with ``reduction="none"`` each token's, flattened ([b * s], fp32, 0 where ignored; not a view,
        which FSDP's backward hook could not follow): DPO's sequence log-probabilities are minus
        their row sums."""
        h = self.hidden_states(tokens, positions, doc_ids)
        if targets is None:
            return self.output(h)
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        if self.kernels == "reference" or self.vocab_parallel_loss:
            logits = self.output(h)
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
            )
            return loss
        return self.output(h, targets, reduction=reduction, kernel=self.loss_kernel)


class LMHead(nn.Linear):
    """The LM head: logits, or given ``targets`` the fused head + cross-entropy (``fused_lm_loss``).

    The loss goes through this module's own call, not a read of ``output.weight`` from outside it,
    so FSDP's hooks see the head run: it can be its own unit with the final norm, gathered for the
    loss and resharded after its backward, instead of staying gathered with the embedding in the
    root unit for the whole step (``parallelize.apply_fsdp``). A plain ``nn.Linear`` to TP's plans.
    """

    def forward(
        self, h: torch.Tensor, targets: torch.Tensor | None = None, *, reduction: str = "mean", kernel: str = "auto"
    ) -> torch.Tensor:
        if targets is None:
            return F.linear(h, self.weight, self.bias)
        return fused_lm_loss(h, self.weight, targets, reduction, kernel)


def fused_lm_loss(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str = "mean", kernel: str = "auto"
) -> torch.Tensor:
    """LM head + CE without full logits, by ``model.loss_kernel`` (``loss_kernel``): Liger's Triton
    kernel or our chunked one. ``liger`` that cannot run raises rather than falling back, so what
    the header named is what ran."""
    if reduction == "none":  # per token: chunks recomputed in backward, one chunk's logits alive at a time
        return per_token_cross_entropy(h, weight, targets)
    if loss_kernel(kernel, h.device.type) == "liger":
        liger_ce = _liger_fused_linear_ce(reduction)
        return liger_ce(weight, h.flatten(0, 1), targets.flatten())
    return chunked_linear_cross_entropy(h, weight, targets, ignore_index=IGNORE_INDEX, reduction=reduction)


_LIGER: dict = {}
_LIGER_PROBLEM: dict = {}


def _liger_fused_linear_ce(reduction: str):
    """Liger's fused linear-CE module, or None (why: ``_LIGER_PROBLEM``). Imported lazily: optional,
    GPU-only. ``accum_dtype=float32``: its weight gradient accumulates over chunks in fp32, not in
    the parameter's dtype (bf16 under FSDP's bf16 policy would round every chunk's addition)."""
    if reduction not in _LIGER:
        try:
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

            _LIGER[reduction] = LigerFusedLinearCrossEntropyLoss(
                ignore_index=IGNORE_INDEX, reduction=reduction, accum_dtype=torch.float32
            )
        except Exception as exc:  # not installed, no Triton driver, an incompatible version
            _LIGER[reduction] = None
            _LIGER_PROBLEM[reduction] = f"{type(exc).__name__}: {exc}"
    return _LIGER[reduction]


def loss_kernel(choice: str, device_type: str) -> str:
    """What ``model.loss_kernel`` runs on ``device_type``: "liger" or "chunked". ``choice``: the
    schema's ``LossKernel`` (a ``str`` enum, equal to its value) or its value.

    ``auto``: Liger on CUDA when it loads, else chunked (the header names which). ``liger`` where
    it cannot run is a ``ConfigError`` naming the key and the fix: a user who asked for Liger and
    silently got the slower chunked loss would compare the wrong numbers.
    """
    if choice == "chunked" or (choice == "auto" and device_type != "cuda"):
        return "chunked"
    if device_type != "cuda":
        problem = f"it runs on CUDA only, and this process runs on {device_type}"
    elif _liger_fused_linear_ce("mean") is None:
        problem = f"liger-kernel does not load ({_LIGER_PROBLEM['mean']})"
    else:
        return "liger"
    if choice == "auto":
        return "chunked"
    raise ConfigError(
        f"Bad value for 'model.loss_kernel': liger cannot run here: {problem}. Fix: pip install liger-kernel"
        " (llmctl-train[gpu]) on a CUDA machine, or model.loss_kernel=chunked (or auto)"
    )


LOSS_KERNEL_NAMES = {"liger": "liger (Triton fused linear-CE)", "chunked": "chunked (PyTorch fused linear-CE)"}


def attention_backend(
    cfg: ModelCfg, batch: int, seq_len: int, dtype: torch.dtype, device: torch.device, masked: bool, tp: int = 1
) -> str:
    """Which SDPA kernel the model's attention will run: ``torch._fused_sdp_choice`` asked with the
    q/k/v/mask a block passes to SDPA (shapes, strides, dtype, mask, ``enable_gqa``), so the log
    names what runs (on CUDA cuDNN or flash, by torch version and mask) rather than what we expect.
    Empty tensors: the choice reads only their metadata."""
    if cfg.kernels.value == "reference":
        return "explicit softmax (reference kernels)"
    heads = cfg.n_heads // tp
    kv_heads = (cfg.n_kv_heads or cfg.n_heads) // tp
    head_dim = cfg.dim // cfg.n_heads
    q = torch.empty(batch, seq_len, heads, head_dim, dtype=dtype, device=device)
    mask = None
    if masked:  # the additive [b, 1, s, s] mask of the q dtype (``additive_mask``)
        mask = torch.zeros(batch, 1, seq_len, seq_len, dtype=dtype, device=device)
    gqa = heads != kv_heads and native_gqa(q, mask)
    kv_n = kv_heads if gqa else heads
    k, v = (torch.empty(batch, seq_len, kv_n, head_dim, dtype=dtype, device=device) for _ in range(2))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    kwargs = {"attn_mask": mask} if masked else {"is_causal": True}
    if gqa:
        kwargs["enable_gqa"] = True
    from torch.nn.attention import SDPBackend

    choice = SDPBackend(torch._fused_sdp_choice(q, k, v, **kwargs)).name
    return f"SDPA {choice}{' (GQA native)' if gqa else ''}{', document mask' if masked else ''}"


def build_model(cfg: ModelCfg, device: torch.device | str = "cpu") -> Transformer:
    """Build on ``meta``, materialise on ``device``, initialise from the current RNG state."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.init_weights(buffer_device=torch.device(device))
    return model


def apply_compile(model: Transformer) -> None:
    """Compile each block in place (``Module.compile`` keeps FQNs, so checkpoints are unaffected).

    Per-block compile reuses one graph for identical blocks and composes with FSDP2/AC.
    ``fullgraph=True``: the blocks compile without a graph break under every AC mode, FSDP, bf16,
    FP8 and the document mask, so a change that introduces one fails here, loudly, instead of
    splitting the block into slower pieces unnoticed.
    """
    for block in model.layers.values():
        block.compile(fullgraph=True)
