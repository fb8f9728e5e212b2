"""Per-device memory plan of one training step, from the config alone: what to expect before paying.

Stdlib only: llmctl imports this to print the plan, so neither torch nor numpy may be imported
here. ``memory_tracker.tracked_peak`` (torch's own memory tracker over a real step of the real model
on fake tensors) is the oracle the plan is checked against: ``benchmarks/memory_plan.py`` and
``tests/trainer/test_memory_plan.py`` hold it to the tracker (the test's tolerance; the
benchmark's figures are in docs/benchmarks.md).

The plan walks one optimizer step the way ``train.py`` runs it and keeps the largest moment:

* static: this rank's fp32 parameter shards, AdamW's two fp32 states per element, the token ids;
* forward of each micro-batch: FSDP (at every world size; one process has a 1-rank mesh) gathers
  one block at a time, in bf16 for bf16 compute (the root unit, i.e. embedding,
  final norm and LM head, stays gathered until its backward), and every block leaves behind what
  autograd saves for backward (``block_saved``: per token, per activation-checkpointing mode);
* the loss: the chunked fused linear+cross-entropy (one chunk of logits alive, but the LM head's
  gradient is made in the forward), or under TP the vocab-parallel loss over [tokens, vocab/tp]
  fp32 log-probabilities;
* backward, block by block from the last: the block's recomputation (AC), its gradient
  temporaries, its weight gradients (FSDP: gathered, reduce-scattered, then sharded), the next
  block's prefetched all-gather; the saved activations of the blocks behind it;
* between micro-batches, FSDP keeps every gathered fp32 gradient until the last micro-batch reduces
  them (``parallel.grad_sync=step``, and ``auto`` when not resolved), or only the shards when it
  reduces after each (``micro_batch``);
* the optimizer step (fused AdamW: no temporaries beyond its states).

Each quantity is counted in bytes on rank 0 (the rank that gets the rounded-up shards). What it
does not count, like the tracker: the CUDA context, cuBLAS/NCCL workspaces and the caching
allocator's fragmentation; add a margin for those (llmctl's memory check reserves one).

Checked against the tracker with the CPU rules (``device="cpu"``). The CUDA rules
(``device="cuda"``, the default) differ where the code paths differ and
are modelled from them, not measured here: ``F.rms_norm`` is one fused kernel that saves less,
the fused loss's chunks are larger (at most 8 per micro-batch) and add their weight gradient in
place. Not modelled: ``model.compile``
(planned as eager; compiled blocks usually save less), Liger's CUDA loss kernel when installed
(planned as ours), the ``reference`` kernels' explicit attention matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workloads.pretrain.contract import shape
from workloads.pretrain.contract.loss_chunk import default_chunk_size
from workloads.pretrain.contract.schema import TrainerCfg

# The parts of a plan, in display order. ``logits`` is the loss's share (logits, log-probs, the
# fused loss's gradient buffers); ``temporaries`` are backward's transient gradients.
PARTS = ("params", "grads", "optimizer", "unsharded", "activations", "logits", "temporaries", "comm")

_LABELS = {
    "params": "parameters (sharded, fp32) + buffers",
    "grads": "gradients (sharded, fp32)",
    "optimizer": "AdamW states (2 x fp32)",
    "unsharded": "FSDP-gathered params / grads",
    "activations": "activations saved for backward",
    "logits": "logits / loss buffers",
    "temporaries": "backward temporaries",
    "comm": "all-gather / reduce-scatter buffers",
}


@dataclass
class MemoryPlan:
    """Bytes per device at the step's peak, by part, and where in the step that peak falls."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    unsharded: int = 0
    activations: int = 0
    logits: int = 0
    temporaries: int = 0
    comm: int = 0
    phase: str = ""  # e.g. "backward of layer 31 (micro-batch 1/1)"
    layout: dict = field(default_factory=dict)  # dp_replicate, dp_shard, tp, micro_batch, micro_batches, device

    @property
    def total(self) -> int:
        return sum(getattr(self, p) for p in PARTS)

    def parts(self) -> dict[str, int]:
        """{part: bytes} in ``PARTS`` order, plus ``total``."""
        return {**{p: getattr(self, p) for p in PARTS}, "total": self.total}

    def describe(self) -> str:
        """A short table (GiB per device), for ``llmctl plan``."""
        lay = self.layout
        head = (
            f"memory per device (plan): {_gib(self.total)} at the peak, {self.phase}\n"
            f"  layout dp_replicate {lay.get('dp_replicate')} x dp_shard {lay.get('dp_shard')} x tp "
            f"{lay.get('tp')}, {lay.get('micro_batches')} micro-batch(es) of {lay.get('micro_batch')} "
            f"sequence(s){_sync_words(lay)}, ac {lay.get('ac')}, {lay.get('dtype')} on {lay.get('device')}"
        )
        rows = [f"  {_LABELS[p]:<40s} {_gib(getattr(self, p)):>10s}" for p in PARTS if getattr(self, p)]
        note = "  (tensors only: add the CUDA context, workspaces and allocator slack, ~0.5-2 GiB)"
        return "\n".join([head, *rows, f"  {'total':<40s} {_gib(self.total):>10s}", note])


def _sync_words(lay: dict) -> str:
    """When FSDP reduces the gradients, where micro-batching makes it a choice (parallel.grad_sync)."""
    if (lay.get("micro_batches") or 1) < 2 or (lay.get("dp_replicate") or 1) * (lay.get("dp_shard") or 1) < 2:
        return ""
    return (
        " (gradients reduced after each)"
        if lay.get("grad_sync") == "micro_batch"
        else " (gradients reduced once, after the last)"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class Setup:
    """Everything the plan needs, resolved: shape, layout, dtypes and the code paths taken."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int  # FFN width
    vocab: int
    tied: bool
    qkv_bias: bool
    max_seq_len: int
    seq: int
    micro: int  # sequences per forward on this rank
    micro_batches: int  # forwards per optimizer step
    local_batch: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ac: str
    dtype: str
    device: str
    fused_kernels: bool
    rope_interleaved: bool
    packed: bool  # sft or data.document_mask: per-token RoPE positions and a block-causal attention mask
    grad_sync: str = "step"  # parallel.grad_sync resolved: "step" or "micro_batch" ("auto" plans as "step")

    @property
    def fsdp(self) -> bool:
        """``parallelize`` applies FSDP2 at every world size (on a 1-rank mesh for one data-parallel
        rank: it shards nothing there, but still gathers each unit's parameters into their own
        buffers and makes the gradients there)."""
        return True

    @property
    def reduce_each_micro_batch(self) -> bool:
        """FSDP reduce-scatters after every micro-batch (gradients stay sharded), not only the last."""
        return self.fsdp and self.grad_sync == "micro_batch"

    @property
    def compute_bytes(self) -> int:
        """Matmul inputs/outputs: bf16 under autocast, else fp32."""
        return 2 if self.dtype == "bf16" else 4

    @property
    def fsdp_bf16(self) -> bool:
        """FSDP gathers bf16 parameters for bf16 compute, on every device (``apply_fsdp``)."""
        return self.fsdp and self.dtype == "bf16"

    @property
    def resid_bytes(self) -> int:
        """The residual stream: fp32 (embedding + fp32 adds) unless FSDP computes in bf16."""
        return 2 if self.fsdp_bf16 else 4

    @property
    def param_bytes(self) -> int:
        """Dtype of the gathered (unsharded) parameters and their gradients."""
        return 2 if self.fsdp_bf16 else 4

    @property
    def autocast_casts(self) -> bool:
        """bf16 autocast over fp32 weights: every matmul casts its weight and fp32 input to bf16
        (a separate copy per matmul), and autograd keeps those copies until backward."""
        return self.dtype == "bf16" and not self.fsdp_bf16

    @property
    def composite_norm(self) -> bool:
        """``F.rms_norm`` is one fused kernel on CUDA (saves input and 1/rms); elsewhere it is
        composite and also saves the normalised input before the weight multiply."""
        return self.device != "cuda"

    @property
    def native_gqa(self) -> bool:
        """SDPA reads grouped k/v heads without copies (``transformer.native_gqa``): fused kernels,
        on CPU always, on CUDA in bf16 without a mask (flash / cuDNN; fp32 or a mask may take the
        memory-efficient kernel, which needs the copies)."""
        if not self.fused_kernels:
            return False
        return self.device != "cuda" or (self.dtype == "bf16" and not self.packed)

    @property
    def vocab_parallel_loss(self) -> bool:
        """Under TP the loss is plain cross-entropy on vocab-sharded logits (``apply_tp``);
        ``reference`` kernels also materialise full logits."""
        return self.tp > 1 or not self.fused_kernels

    @property
    def loss_chunk(self) -> int:
        """Tokens per chunk of the fused loss (``losses.default_chunk_size``), at most the
        micro-batch's tokens."""
        tokens = self.micro * self.seq
        return min(tokens, default_chunk_size(self.vocab, self.device, tokens))


def setup(cfg: TrainerCfg, world_size: int, device: str = "cuda") -> Setup:
    """Resolve ``cfg`` for ``world_size`` processes: the mesh degrees (``validate.resolve_layout``)
    and micro-batches."""
    from workloads.pretrain.contract.validate import resolve_layout

    model, train, par, data = cfg.model, cfg.train, cfg.parallel, cfg.data
    layout = resolve_layout(cfg, world_size)
    dp = layout["dp_replicate"] * layout["dp_shard"]
    local_batch = int(train.batch_size) // dp
    micro = int(train.micro_batch_size or local_batch)
    micro = min(micro, local_batch)
    heads = int(model.n_heads)
    return Setup(
        dim=int(model.dim),
        layers=int(model.n_layers),
        heads=heads,
        kv_heads=int(model.n_kv_heads or heads),
        head_dim=int(model.dim) // heads,
        hidden=shape.hidden_dim(model),
        vocab=int(model.vocab_size),
        tied=bool(model.tie_embeddings),
        qkv_bias=shape.qkv_bias(model),
        max_seq_len=int(model.max_seq_len),
        seq=int(train.seq_len),
        micro=micro,
        micro_batches=local_batch // micro,
        local_batch=local_batch,
        dp_replicate=layout["dp_replicate"],
        dp_shard=layout["dp_shard"],
        tp=layout["tp"],
        ac=par.ac.value,
        dtype=train.dtype.on(device),  # auto: bf16 on CUDA, fp32 on CPU, as the trainer resolves it
        device=device,
        fused_kernels=model.kernels == "fused",
        rope_interleaved=model.rope_layout == "interleaved",
        packed=data.format == "sft" or bool(data.document_mask),
        grad_sync="micro_batch" if par.grad_sync == "micro_batch" else "step",
    )


# ----------------------------------------------------------------------------- parameters


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def param_shapes(s: Setup) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(one block's, the root unit's) parameters as this rank's TP-local (rows, cols).

    Mirrors ``model.py`` and ``parallelize.apply_tp``: q/k/v/w1/w3 and the LM head split their
    rows (Colwise), wo/w2 their columns (Rowwise), the embedding its rows (vocab); norms are
    replicated. Rank 0 holds the rounded-up share of an uneven split.
    """
    t, d, hd = s.tp, s.dim, s.head_dim
    q, kv = _ceil(s.heads * hd, t), _ceil(s.kv_heads * hd, t)
    block = [
        (q, d),
        (kv, d),
        (kv, d),
        (d, q),
        (_ceil(s.hidden, t), d),
        (d, _ceil(s.hidden, t)),
        (_ceil(s.hidden, t), d),
        (d, 1),
        (d, 1),
    ]
    if s.qkv_bias:
        block += [(q, 1), (kv, 1), (kv, 1)]
    root = [(_ceil(s.vocab, t), d), (d, 1)]
    if not s.tied:
        root.append((_ceil(s.vocab, t), d))
    return block, root


def _sharded(shapes: list[tuple[int, int]], s: Setup) -> int:
    """Elements this rank keeps: FSDP2 splits every parameter's dim 0 over dp_shard (rank 0 gets
    the rounded-up rows)."""
    n = s.dp_shard if s.fsdp else 1
    return sum(_ceil(rows, n) * cols for rows, cols in shapes)


def _gathered(shapes: list[tuple[int, int]], s: Setup) -> int:
    """Elements of a gathered FSDP unit (each parameter padded to a multiple of dp_shard rows)."""
    return _sharded(shapes, s) * (s.dp_shard if s.fsdp else 1)


# ----------------------------------------------------------------------------- activations


def block_saved(s: Setup, ac: str | None = None) -> float:
    """Bytes one transformer block leaves for its backward, per token of the micro-batch.

    Counted op by op from ``TransformerBlock.forward`` (checked against the tracker with fake and
    real tensors). d = dim, H = FFN width, t = tp; c = matmul dtype (2 bf16 / 4), r = residual
    dtype. Under TP, norms and residuals run on a 1/t sequence shard and q/k/v/FFN on 1/t of the
    heads / width, but each norm's output is all-gathered to the full sequence before its matmuls.

    * none: each RMSNorm keeps its fp32 input and 1/rms (+ the normalised input when the norm is
      composite, off CUDA); the matmuls keep the norm output (one bf16 cast per matmul under
      autocast over fp32 weights: 3 for q/k/v, 2 for w1/w3); SDPA keeps q, k, v (k/v copied to all
      heads where SDPA cannot take grouped heads, see ``native_gqa``), its output and log-sum-exp (and
      for packed examples with reference kernels the mask); SwiGLU keeps w1 x, w3 x, silu(w1 x) and their
      product.
    * selective (``parallelize._SAC_SAVE``): the block input, every matmul output (q, k, v, wo,
      w1, w3, w2; wo/w2 before TP's reduce-scatter, so full width), SDPA's outputs and TP's
      all-gather / reduce-scatter outputs.
    * full: the block input only.
    """
    ac = ac or s.ac
    d, H, t, c, r = s.dim, s.hidden, s.tp, s.compute_bytes, s.resid_bytes
    dkv = s.kv_heads * s.head_dim
    lse = 4 * s.heads / t
    if ac == "full":
        return r * d / t
    if ac == "selective":
        kept = r * d / t + c * (d + 2 * dkv + 2 * H) / t + 2 * c * d + c * d / t + lse
        if t > 1:
            kept += 2 * r * d + 2 * c * d / t
        return kept
    norm = 4 * d / t + 4 / t + (4 * d / t if s.composite_norm else 0)
    matmul_inputs = (3 + 2) * c * d if s.autocast_casts else 2 * r * d
    # SDPA keeps k and v as they are when it takes grouped heads (``Attention.native_gqa``); else
    # repeat_kv copies them to all query heads, unless this rank has a single kv head (a view)
    kv = dkv if s.native_gqa or s.kv_heads // t <= 1 else d
    mask = c * s.seq if s.packed and not s.fused_kernels else 0  # reference: each layer's ~mask and masked scores
    return 2 * norm + matmul_inputs + c * (d + 2 * kv) / t + c * d / t + lse + 4 * c * H / t + mask


def weight_casts(s: Setup) -> int:
    """Bytes of the bf16 copies autocast makes of one block's fp32 matmul weights (0 when it does
    not cast). Autocast caches the cast of a leaf parameter until its context exits, i.e. the end
    of the forward and loss, whatever the AC mode; with ``ac=none`` autograd then keeps them to the
    block's backward, and AC recasts them for the block it recomputes."""
    if not s.autocast_casts:
        return 0
    block, _ = param_shapes(s)
    return 2 * sum(rows * cols for rows, cols in block if cols > 1)


def rope_tables(s: Setup) -> int:
    """Bytes of the complex RoPE tables each block's attention builds for q and k and keeps
    (fused kernels, interleaved layout): [s, head_dim/2] complex64 each, per sequence when packed
    examples carry their own positions. AC recomputes them."""
    if not (s.fused_kernels and s.rope_interleaved):
        return 0
    return 2 * s.seq * s.head_dim * 4 * (s.micro if s.packed else 1)


def block_backward_extra(s: Setup) -> float:
    """Per token, what a block adds while its backward runs, beyond what it saved.

    Its peak is in the SwiGLU backward: the residual gradient (r d / t; under TP also all-gathered
    to the full sequence, c d) and three [tokens, H/t] gradients (of the product and of both its
    factors), while the product itself is already released. With AC the block first recomputes
    its forward: all of the none-mode set is alive again (SAC reuses its cached matmul outputs in
    place and drops the cached ones the graph does not keep), so the block holds its none-mode set.
    """
    d, H, t, c, r = s.dim, s.hidden, s.tp, s.compute_bytes, s.resid_bytes
    temps = r * d / t + 3 * c * H / t - c * H / t + (c * d if t > 1 else 0)
    # SAC's recomputation stops at the last tensor the graph needs (w2's input), so w2's cached
    # output (and TP's reduce-scatter of it) is never taken back out of the cache
    stale = c * d + (c * d / t if t > 1 else 0) if s.ac == "selective" else 0
    return temps + block_saved(s, "none") - block_saved(s) + stale


def final_norm_saved(s: Setup) -> float:
    """Per token: the final RMSNorm's fp32 input and 1/rms (+ normalised input off CUDA)."""
    d, t = s.dim, s.tp
    return 4 * d / t + 4 / t + (4 * d / t if s.composite_norm else 0)


def loss_memory(s: Setup) -> tuple[int, int]:
    """(peak of the loss's forward, peak of its backward) in bytes, on top of the blocks' saved
    activations; the backward's includes what the forward saved for it.

    Fused chunked CE (``losses.py``): the LM head's gradients are computed during the forward, so
    it holds grad_hidden [T, d] and an fp32 grad_weight [V, d] plus one chunk of logits and
    log-probs (8 bytes per logit; under autocast the bf16 matmul output and, per chunk off CUDA, a
    bf16 [V, d] product and its fp32 copy, and the head weight's bf16 copy). TP's vocab-parallel loss:
    fp32 log-probs [T, V/t] saved; its backward holds three more of that size (gradient, softmax,
    their product).
    """
    tokens, d, V, t, c, r = s.micro * s.seq, s.dim, s.vocab, s.tp, s.compute_bytes, s.resid_bytes
    if s.vocab_parallel_loss:
        logits = tokens * _ceil(V, t)
        head_in = (c if s.autocast_casts else r) * tokens * d  # the gathered (cast) hidden the head keeps
        weight_copy = 2 * _ceil(V, t) * d if s.autocast_casts else 0
        saved = 4 * logits + head_in + weight_copy
        # logits, their fp32 copy (bf16), then log-softmax's shifted logits and their exp
        forward = saved - 4 * logits + c * logits + (4 * logits if c != 4 else 0) + 2 * 4 * logits
        backward = saved + 3 * 4 * logits
        return forward, backward
    chunk = s.loss_chunk * V
    hidden = r * tokens * d
    grads = hidden + 4 * V * d  # grad_hidden, fp32 grad_weight
    if s.dtype == "bf16":
        weight_copy = 2 * V * d if s.autocast_casts else 0
        # CPU: a bf16 [V, d] product and its fp32 copy per chunk; CUDA adds it into the fp32
        # gradient in place (``losses._add_weight_grad``), holding only the chunk's bf16 gradient
        per_chunk = 8 * chunk if s.device == "cuda" else max(8 * chunk, 6 * chunk + 6 * V * d)
        forward = hidden + grads + weight_copy + per_chunk
    else:
        forward = hidden + grads + 8 * chunk
    saved = hidden + s.param_bytes * V * d
    # grad_hidden * grad_output, and grad_weight * grad_output: the weight's gradient, made while
    # the saved one still exists
    backward = saved + hidden + s.param_bytes * V * d
    return forward, backward


# ----------------------------------------------------------------------------- the step


class _Peak:
    """A running ledger of bytes by part; remembers the largest moment."""

    def __init__(self) -> None:
        self.now: dict[str, float] = dict.fromkeys(PARTS, 0)
        self.best: dict[str, float] = dict(self.now)
        self.phase = ""

    def moment(self, phase: str, **transient: float) -> None:
        snap = dict(self.now)
        for part, nbytes in transient.items():
            snap[part] += nbytes
        if sum(snap.values()) > sum(self.best.values()):
            self.best, self.phase = snap, phase


def plan_memory(cfg: TrainerCfg, world_size: int, device: str = "cuda") -> MemoryPlan:
    """Per-device memory of a training step of ``cfg`` at ``world_size`` processes, by part.

    ``cfg``: the trainer's typed config (``config.typed`` makes one from a plain mapping, schema
    defaults filling the rest). ``device``: "cuda" (the trainer's GPU path: bf16 FSDP compute,
    fused RMSNorm) or "cpu". Raises ``validate.ConfigError`` for a layout that does not fit
    ``world_size``.
    """
    s = setup(cfg, world_size, device)
    ledger = _walk_step(s)
    layout = {
        "dp_replicate": s.dp_replicate,
        "dp_shard": s.dp_shard,
        "tp": s.tp,
        "micro_batch": s.micro,
        "micro_batches": s.micro_batches,
        "grad_sync": s.grad_sync,
        "ac": s.ac,
        "dtype": s.dtype,
        "device": s.device,
    }
    return MemoryPlan(**{p: round(ledger.best[p]) for p in PARTS}, phase=ledger.phase, layout=layout)


def _walk_step(s: Setup) -> _Peak:
    """One optimizer step, event by event, as ``train.py`` runs it (see the module doc)."""
    block_p, root_p = param_shapes(s)
    L, tokens, d, t, pb = s.layers, s.micro * s.seq, s.dim, s.tp, s.param_bytes
    shard_block, shard_root = _sharded(block_p, s), _sharded(root_p, s)
    full_block, full_root = _gathered(block_p, s), _gathered(root_p, s)
    head = _ceil(s.vocab, t) * d  # the LM head's local elements (its gradient appears in the loss)
    w2 = d * _ceil(s.hidden, t)  # the first weight gradient of a block's backward, there at its peak
    # Under TP the embedding's gradient comes back Replicate: the full vocabulary on every rank
    # (DTensor's embedding backward), in .grad without FSDP, among the gathered gradients with it.
    embedding_grad = (s.vocab * d if t > 1 else head) if not s.tied else 0
    root_grads = full_root + (embedding_grad - head if not s.tied else 0)

    ledger = _Peak()
    now = ledger.now
    now["params"] = 4 * (L * shard_block + shard_root) + 4 * s.max_seq_len * s.head_dim  # + RoPE cos/sin
    # AdamW: exp_avg and exp_avg_sq in fp32, and a scalar step count per parameter tensor (fused
    # AdamW keeps it on the device: a 512-byte block there)
    now["optimizer"] = 2 * 4 * (L * shard_block + shard_root) + (512 if s.device == "cuda" else 4) * (
        L * len(block_p) + len(root_p)
    )
    now["activations"] = 2 * 8 * s.local_batch * s.seq  # token ids and targets of the whole local batch

    casts = weight_casts(s)
    saved = block_saved(s) * tokens + (casts + rope_tables(s) if s.ac == "none" else 0)
    cast_cache = casts if s.ac != "none" else 0  # autocast's copies, released when the forward ends
    backward_extra = block_backward_extra(s) * tokens + (cast_cache + rope_tables(s) if s.ac != "none" else 0)
    loss_fwd, loss_bwd = loss_memory(s)
    norm_saved = final_norm_saved(s) * tokens
    # packed examples: the bool [b, 1, s, s] mask (reference kernels) and the RoPE tables gathered
    # at each position, alive through the forward; AC's checkpoints keep them (block inputs) until
    # the backward ends. Fused kernels turn the mask into one additive mask in the compute dtype,
    # which every layer's SDPA keeps for its backward: alive until the backward ends
    packed_inputs = s.micro * s.seq * ((0 if s.fused_kernels else s.seq) + 4 * s.head_dim) if s.packed else 0
    shared_mask = s.micro * s.seq * s.seq * s.compute_bytes if s.packed and s.fused_kernels else 0
    # one block's all-gather output, ahead of its use; with one shard (one process, or HSDP's
    # dp_shard=1) FSDP2 copies the parameters out of the shard without an all-gather buffer
    gather = pb * full_block if s.fsdp and s.dp_shard > 1 else 0
    prefetch = gather

    # Micro-batches between the second and the last repeat the second exactly: walk 1, 2 and the last.
    for k in sorted({0, 1, s.micro_batches - 1} & set(range(s.micro_batches))):
        first, last = k == 0, k == s.micro_batches - 1
        reduce = last or s.reduce_each_micro_batch  # FSDP reduce-scatters this backward's gradients
        tag = f"(micro-batch {k + 1}/{s.micro_batches})"
        # Gradients a backward allocates: all of them in the first micro-batch; later ones add into
        # the kept fp32 gradients in place, except FSDP's bf16 ones (cast to fp32 after each backward)
        # and any FSDP reduced after the previous micro-batch (its gathered gradients were freed).
        new_grads = first or pb != 4 or s.reduce_each_micro_batch
        # forward: FSDP gathers the root unit first; it stays gathered until the end of its backward
        if s.fsdp:
            now["unsharded"] += pb * full_root
        now["activations"] += packed_inputs + shared_mask
        for i in range(L):
            if s.fsdp:  # this block's all-gather output and its copy-out into the parameters
                ledger.moment(f"forward of layer {i} {tag}", unsharded=pb * full_block, comm=gather)
            now["activations"] += saved + cast_cache
        now["activations"] += norm_saved
        if s.ac == "none":
            now["activations"] -= packed_inputs
        # FSDP keeps the last all-gather's output until the next one (the root's backward prefetch)
        ledger.moment(f"loss forward {tag}", logits=loss_fwd, comm=prefetch)
        now["activations"] -= L * cast_cache
        ledger.moment(f"loss backward {tag}", logits=loss_bwd, comm=prefetch)
        now["activations"] -= norm_saved
        if new_grads:  # the LM head's gradient, from the loss
            now["unsharded" if s.fsdp else "grads"] += (pb if s.fsdp else 4) * head
        for i in reversed(range(L)):
            moment = {"temporaries": backward_extra}
            if s.fsdp:
                moment["unsharded"] = pb * full_block + (pb * w2 if new_grads else 0)  # parameters, first gradient
                moment["comm"] = prefetch if i > 0 else 0  # the next block's all-gather
                if reduce and i < L - 1:
                    moment["comm"] += 4 * full_block  # the previous block's reduce-scatter input (fp32)
            elif new_grads:
                moment["grads"] = 4 * w2
            ledger.moment(f"backward of layer {i} {tag}", **moment)
            now["activations"] -= saved
            if not s.fsdp:
                now["grads"] += 4 * shard_block if new_grads else 0
            elif s.reduce_each_micro_batch:  # reduce-scattered, then added into the fp32 shard
                now["grads"] += 4 * shard_block if first else 0
            elif last:  # reduce-scattered into this rank's fp32 shard; the kept gradient goes
                now["grads"] += 4 * shard_block
                now["unsharded"] -= 0 if first else 4 * full_block
            elif first:  # no sync before the last micro-batch: the gradient stays gathered, in fp32
                now["unsharded"] += 4 * full_block
        now["activations"] -= shared_mask + (packed_inputs if s.ac != "none" else 0)
        # embedding backward, then (FSDP) the root unit reshards and reduce-scatters
        if not s.fsdp:
            if new_grads:
                now["grads"] += 4 * (embedding_grad + shard_root - head - (head if not s.tied else 0))
            ledger.moment(f"end of backward {tag}")
            continue
        now["unsharded"] -= pb * (full_root + (head if new_grads else 0))
        if s.reduce_each_micro_batch:
            now["grads"] += 4 * shard_root if first else 0
        elif last:
            now["grads"] += 4 * shard_root
            now["unsharded"] -= 0 if first else 4 * root_grads
        elif first:
            now["unsharded"] += 4 * root_grads
        ledger.moment(f"end of backward {tag}", comm=4 * full_root if reduce else 0)
    ledger.moment("optimizer step")
    return ledger
