"""Per-device memory plan of one training step, from the config alone: what to expect before paying.

Stdlib only: llmctl imports this to print the plan, so neither torch nor numpy may be imported
here. ``memory_tracker.tracked_peak`` (torch's own memory tracker over a real step of the real model
on fake tensors) is the oracle the plan is checked against: ``benchmarks/memory_plan.py`` and
``tests/trainer/test_memory_plan.py`` hold it to the tracker (the test's tolerance; the
benchmark's figures are in docs/benchmarks.md).

The plan walks one optimizer step the way ``train.py`` runs it and keeps the largest moment:

* static: this rank's fp32 parameter shards, AdamW's two fp32 states per element, the token ids;
* forward of each micro-batch: FSDP (at every world size; one process has a 1-rank mesh) gathers
  one unit at a time, in bf16 for bf16 compute (``outer_units``: the embedding for its forward,
  then each block, then [final norm, LM head], kept through the loss; tied embeddings instead
  keep one root unit with embedding and norm gathered all step), and every block leaves behind
  what autograd saves for backward (``block_saved``: per token, per activation-checkpointing mode);
* the loss: the chunked fused linear+cross-entropy (a chunk of logits alive, and the previous
  chunk's gradient until the next replaces it; the LM head's gradient is made in the forward),
  or under TP the vocab-parallel loss over [tokens, vocab/tp] fp32 log-probabilities;
* backward: [norm, head] reshards and reduces its gradient after the norm's backward; then block
  by block from the last: the block's recomputation (AC), its gradient temporaries, its weight
  gradients (FSDP: gathered, reduce-scattered, then sharded), the next unit's prefetched
  all-gather, the previous unit's reduce-scatter input; the saved activations of the blocks
  behind it; last the embedding, gathered again for its backward;
* between micro-batches, FSDP keeps every gathered fp32 gradient until the last micro-batch reduces
  them (``parallel.grad_sync=step``, and ``auto`` when not resolved), or only the shards when it
  reduces after each (``micro_batch``);
* the optimizer step (fused AdamW: no temporaries beyond its states).

LoRA and QLoRA (``model.lora``) change what trains, not the walk: the base is frozen, so it has no
gradients and no AdamW states, its shards are held in the compute dtype (no fp32 master for a weight
that never changes), and backward makes no weight gradient for it (only the gradients flowing
through it to the activations); FSDP still gathers it unit by unit. The adapters train:
their fp32 shards, gradients and AdamW states (``adapter_shapes``), and what they save for
backward (``adapter_saved``: A's rank-r output, and with ``model.lora.dropout`` the mask and the
dropped input). QLoRA stores the targets' frozen weights in NF4 exactly as torchao's ``NF4Tensor``
does (``nf4_bytes``: 4 bits per weight, an int8 scale per 64-weight block, a factor per 256
scales, a scale mean and code table per tensor), gathered in NF4 form where FSDP shards them, and
each NF4 linear dequantizes its weight to the compute dtype in forward and again in backward: that
transient is counted at the moments it exists (``nf4_dequantized``).

DPO (``train.objective=dpo``, ``components/dpo.py``) changes the rows and adds a reference. Its
batch sizes count pairs, and each micro-batch of pairs runs as one forward of twice as many rows
(the chosen answers' rows, then the rejected ones': TRL's concatenated forward), so the walk is an
lm step over ``2 x micro`` rows: every activation, the token ids and the loss chunk follow. Its
loss head is not the fused linear-CE: a sequence's log-probability needs each token's loss, so the
head runs ``losses.per_token_cross_entropy`` (a chunk of tokens at a time under
``torch.utils.checkpoint``: one chunk's fp32 logits alive, recomputed in backward, the LM head's
gradient made in backward), counted by ``dpo_loss_memory``; under TP or the reference kernels it is
the same vocab-parallel / full-logits cross-entropy as lm's. Each micro-batch first runs the
REFERENCE forward over the same rows without gradients. With LoRA the reference is the policy with
its adapters off: no weights of its own, but FSDP gathers the policy's units for it, and the
[norm, head] unit (``reshard_after_forward=False``) and a tied model's root stay gathered from that
forward through the policy's. Without LoRA it is a frozen copy of the starting weights, built and
sharded like the policy and held in the compute dtype (``parallelize(frozen=True)``): its shards and
its own RoPE tables are the plan's ``reference`` part; the trainer reshards its [norm, head] unit (a
tied model's root) when its forward ends, since no backward follows to do it (``components.dpo``),
so nothing of it stays gathered. The reference forward's own moments are walked too, and they seldom set the
peak: they hold what the step holds before the policy's forward (parameters, states, gradients kept
between micro-batches) plus one gathered unit and one block's forward working set
(``reference_block_transient``) or one loss chunk (``reference_loss_memory``), where the policy's
forward of the same rows holds the same static parts, an equal gathered unit and every block's saved
activations besides; its loss chunk is the policy's, without the saved ones. The exception is
LoRA's: there the reference forward is the one that all-gathers [norm, head] (the policy's forward
finds it gathered), so its loss moment holds that all-gather's output where the policy's holds the
last block's; with few layers and a large vocabulary (two 512-wide layers, 152k vocabulary, 8 shards)
that outweighs every block's saved activations and the reference's loss is the peak (a tracker
case holds it). The copy never gathers its [norm, head] again after its first step.

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

from workloads.planner.loss_chunk import default_chunk_size
from workloads.protocol import shape
from workloads.protocol.schema import TrainerCfg

# The parts of a plan, in display order. ``logits`` is the loss's share (logits, log-probs, the
# fused loss's gradient buffers); ``temporaries`` are backward's transient gradients.
PARTS = ("params", "reference", "grads", "optimizer", "unsharded", "activations", "logits", "temporaries", "comm")

_LABELS = {
    "params": "parameters (sharded, fp32) + buffers",
    "reference": "reference (frozen copy, sharded)",
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
    reference: int = 0  # DPO without LoRA: the frozen reference copy's shards (compute dtype) + its buffers
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
            f"{lay.get('tp')}, {lay.get('micro_batches')} micro-batch(es) of {_micro_words(lay)}"
            f"{_sync_words(lay)}, ac {lay.get('ac')}, {lay.get('dtype')} on {lay.get('device')}"
        )
        labels = {
            **_LABELS,
            "params": _params_label(lay.get("frozen_dtype")),
            "reference": f"reference (frozen copy, {lay.get('dtype')}, sharded)",
        }
        rows = [f"  {labels[p]:<40s} {_gib(getattr(self, p)):>10s}" for p in PARTS if getattr(self, p)]
        note = "  (tensors only: add the CUDA context, workspaces and allocator slack, ~0.5-2 GiB)"
        dpo = [f"  {self.reference_words()}"] if lay.get("objective") == "dpo" else []
        return "\n".join([head, *dpo, *rows, f"  {'total':<40s} {_gib(self.total):>10s}", note])

    def reference_words(self) -> str:
        """DPO: what the plan counted for the reference (one line; "" for objective lm)."""
        lay = self.layout
        if lay.get("objective") != "dpo":
            return ""
        forward = (
            "its no-grad forward is the peak"
            if self.phase.startswith("reference forward")
            else "its no-grad forward peaks below the step's"
        )
        if lay.get("reference") != "copy":
            return (
                "dpo: chosen + rejected rows in one forward; reference: the base with adapters off (LoRA), no second"
                f" copy; {forward}"
            )
        return (
            f"dpo: chosen + rejected rows in one forward; reference: frozen copy ({lay.get('dtype')}, sharded like"
            f" the policy) {_gib(self.reference)}; {forward}"
        )


def _params_label(frozen_dtype: str | None) -> str:
    """The parameters' row: fp32 shards, or under LoRA in bf16 compute a frozen base held in bf16."""
    if frozen_dtype and frozen_dtype != "fp32":
        return f"params (sharded; frozen {frozen_dtype}) + buffers"
    return _LABELS["params"]


def _micro_words(lay: dict) -> str:
    """A micro-batch's size: sequences, or under DPO pairs (two sequences each)."""
    if lay.get("objective") == "dpo":
        return f"{lay.get('pairs')} pair(s) ({lay.get('micro_batch')} sequences)"
    return f"{lay.get('micro_batch')} sequence(s)"


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
    lora_rank: int = 0  # model.lora.rank: 0 trains every weight; else only the adapters train
    lora_targets: tuple = ()  # the block linears with adapters (``schema.LORA_TARGETS`` names)
    lora_dropout: bool = False  # model.lora.dropout > 0: a dropout (mask and output) per adapter
    nf4: bool = False  # model.lora.quantize_base=nf4: the targets' frozen weights stored in NF4
    # train.objective=dpo: ``micro`` and ``local_batch`` count rows (2 per pair: chosen, rejected),
    # the loss is per token (``dpo_loss_memory``) and a reference forward runs first
    dpo: bool = False
    reference_copy: bool = False  # dpo without LoRA: a frozen copy of the starting weights, sharded like the policy

    @property
    def nf4_sharded(self) -> bool:
        """NF4 weights are FSDP parameters (split and gathered as 4-bit bytes) when FSDP shards
        over more than one rank; on one shard they are buffers FSDP leaves alone (``nf4.placeholder``)."""
        return self.nf4 and self.dp_shard > 1

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
    def frozen_bytes(self) -> int:
        """Bytes per element of a frozen parameter: LoRA's base is held in the compute dtype
        (``lora.hold_frozen_in``); without LoRA every weight trains and keeps its fp32 master."""
        return self.compute_bytes if self.lora_rank else 4

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
        composite and also saves the normalised input before the weight multiply, for the
        weight's gradient: none under LoRA, whose norms are frozen."""
        return self.device != "cuda" and not self.lora_rank

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
    from workloads.protocol.validate import resolve_layout

    model, train, par, data = cfg.model, cfg.train, cfg.parallel, cfg.data
    layout = resolve_layout(cfg, world_size)
    dp = layout["dp_replicate"] * layout["dp_shard"]
    local_batch = int(train.batch_size) // dp
    micro = int(train.micro_batch_size or local_batch)
    micro = min(micro, local_batch)
    # DPO's batch sizes count pairs; each pair is two rows of one forward (TRL's concatenated forward)
    dpo = train.objective == "dpo"
    rows = 2 if dpo else 1
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
        micro=rows * micro,
        micro_batches=local_batch // micro,
        local_batch=rows * local_batch,
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
        lora_rank=int(model.lora.rank),
        lora_targets=tuple(model.lora.targets) if model.lora.rank else (),
        lora_dropout=bool(model.lora.rank and model.lora.dropout),
        nf4=bool(model.lora.rank) and model.lora.quantize_base == "nf4",
        dpo=dpo,
        reference_copy=dpo and not model.lora.rank,  # validate: reference=copy is refused under LoRA
    )


# ----------------------------------------------------------------------------- parameters


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def param_shapes(s: Setup) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(one block's, those outside the blocks) parameters as this rank's TP-local (rows, cols): the
    latter are the embedding, the final norm and (untied) the LM head, ``outer_units``' FSDP units.

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


def outer_units(s: Setup) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
    """The FSDP units of the parameters outside the blocks (``parallelize.apply_fsdp``), as
    (embedding, [final norm, LM head], root) shapes of ``param_shapes``' root part.

    Untied, each is gathered only while it runs: the embedding for its forward and its backward,
    [norm, head] from the norm's forward to the norm's backward; the root unit holds no parameter.
    Tied, embedding and head are one matrix: the root unit holds it with the norm, gathered for
    the whole step.
    """
    _, root = param_shapes(s)
    if s.tied:
        return [], [], root
    return root[:1], root[1:], []


def _sharded(shapes: list[tuple[int, int]], s: Setup) -> int:
    """Elements this rank keeps: FSDP2 splits every parameter's dim 0 over dp_shard (rank 0 gets
    the rounded-up rows)."""
    n = s.dp_shard if s.fsdp else 1
    return sum(_ceil(rows, n) * cols for rows, cols in shapes)


def _gathered(shapes: list[tuple[int, int]], s: Setup) -> int:
    """Elements of a gathered FSDP unit (each parameter padded to a multiple of dp_shard rows)."""
    return _sharded(shapes, s) * (s.dp_shard if s.fsdp else 1)


# The block's linears in ``param_shapes``' order, by the model's names (``schema.LORA_TARGETS``).
_BLOCK_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def adapter_shapes(s: Setup) -> list[tuple[int, int]]:
    """One block's LoRA adapters as this rank's TP-local (rows, cols): per target, A [rank, in] and
    B [out, rank] (``lora.add_adapters``: under TP, A is split like the base's input features, B
    like its output rows, so both follow the base's local shape). Empty without LoRA."""
    block, _ = param_shapes(s)
    shapes: list[tuple[int, int]] = []
    for name, (rows, cols) in zip(_BLOCK_LINEARS, block):
        if name in s.lora_targets:
            shapes += [(s.lora_rank, cols), (rows, s.lora_rank)]
    return shapes


def nf4_shapes(s: Setup) -> list[tuple[int, int]]:
    """One block's weights stored in NF4 (QLoRA: the targets' frozen weights), else none. Under TP a
    colwise target stores its rows, a rowwise one (wo, w2) its whole weight on every TP rank
    (``nf4.TensorParallelNF4Linear``: NF4 has no column split)."""
    block, _ = param_shapes(s)
    return [
        (rows, cols * s.tp) if name in ("wo", "w2") else (rows, cols)
        for name, (rows, cols) in zip(_BLOCK_LINEARS, block)
        if s.nf4 and name in s.lora_targets
    ]


def _in_nf4(s: Setup, i: int) -> bool:
    """Whether the block's ``i``-th linear (``_BLOCK_LINEARS``) is stored in NF4."""
    return s.nf4 and _BLOCK_LINEARS[i] in s.lora_targets


def nf4_bytes(shapes: list[tuple[int, int]], s: Setup, gathered: bool = False) -> int:
    """Bytes of NF4 weights as torchao's ``NF4Tensor`` stores them, this rank's shard (or, with
    ``gathered``, the whole weights FSDP's all-gather rebuilds): two 4-bit codes per byte
    (``quantized_data``), one int8 scale per block of ``NF4_BLOCK`` weights (``quantized_scalers``),
    one compute-dtype factor per ``NF4_SCALER_BLOCK`` scales (``quantization_factor``); each shard
    also carries the whole tensor's scale mean and its 16-entry code table in the compute dtype,
    which the all-gather does not move."""
    c, k = s.compute_bytes, (s.dp_shard if s.nf4_sharded else 1)
    total = 0
    for rows, cols in shapes:
        n = _ceil(rows, k) * cols * (k if gathered else 1)
        total += shape.nf4_weight_bytes(n, c)
        total += 0 if gathered else 17 * c
    return total


def nf4_dequantized(s: Setup) -> int:
    """What dequantizing the largest NF4 weight holds at once (torchao's ``get_original_weight``,
    run by each NF4 linear in its forward and again in its backward): both halves of the codes as
    int64 indices (8 bytes per weight), the looked-up and the scaled values (each half, compute
    dtype) and the interleaved weight (compute dtype), all alive until it returns."""
    biggest = max((rows * cols for rows, cols in nf4_shapes(s)), default=0)
    return biggest * (8 + 3 * s.compute_bytes)


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
    * selective (``parallelize.sac_save_ops``): the block input, every matmul output (q, k, v, wo,
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
        return kept + adapter_saved(s, ac)
    norm = 4 * d / t + 4 / t + (4 * d / t if s.composite_norm else 0)
    matmul_inputs = (3 + 2) * c * d if s.autocast_casts else 2 * r * d
    # SDPA keeps k and v as they are when it takes grouped heads (``Attention.native_gqa``); else
    # repeat_kv copies them to all query heads, unless this rank has a single kv head (a view)
    kv = dkv if s.native_gqa or s.kv_heads // t <= 1 else d
    mask = c * s.seq if s.packed and not s.fused_kernels else 0  # reference: each layer's ~mask and masked scores
    saved = 2 * norm + matmul_inputs + c * (d + 2 * kv) / t + c * d / t + lse + 4 * c * H / t + mask
    return saved + adapter_saved(s, ac)


def adapter_saved(s: Setup, ac: str) -> float:
    """Per token, what one block's LoRA adapters add to its saved activations (``lora.LoRAMixin``):
    per target, ``lora_b`` keeps its rank-r input (A's output), and with ``model.lora.dropout`` the
    dropout keeps its mask (1 byte per input feature) and ``lora_a`` the dropped input (compute
    dtype). The adapters' own input is the base's, already kept; ``scaling`` and the sum save
    nothing. Selective AC keeps both adapter matmuls' outputs instead (rank r, and the base's
    output width). Full AC keeps the block input only."""
    if not s.lora_rank or ac == "full":
        return 0
    block, _ = param_shapes(s)
    c, total = s.compute_bytes, 0.0
    for name, (rows, cols) in zip(_BLOCK_LINEARS, block):
        if name not in s.lora_targets:
            continue
        if ac == "selective":  # the two matmul outputs; the dropout runs again in the recomputation
            total += c * (s.lora_rank + rows)
        else:
            total += c * s.lora_rank + ((1 + c) * cols if s.lora_dropout else 0)
    return total


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
    bf16 [V, d] product and its fp32 copy, and the head weight's bf16 copy), and from the second
    chunk on the previous chunk's logit gradient (4 bytes per logit, 6 with its bf16 copy): the
    loop's names still hold it while the next chunk's log-softmax runs. TP's vocab-parallel loss:
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
    # a frozen head (LoRA) gets no weight gradient: the loss makes none (``needs_input_grad``)
    head_grad = 0 if s.lora_rank else V * d
    grads = hidden + 4 * head_grad  # grad_hidden, fp32 grad_weight
    # Past the first chunk, the previous chunk's fp32 logit gradient (and its bf16 copy, bf16
    # weights without autocast) lives on until the next chunk's log-softmax replaces it
    bf16_copy = 2 if s.dtype == "bf16" and not s.autocast_casts else 0
    previous = (4 + bf16_copy) * chunk if tokens > s.loss_chunk else 0
    if s.dtype == "bf16":
        weight_copy = 2 * V * d if s.autocast_casts else 0
        # CPU: a bf16 [V, d] product and its fp32 copy per chunk; CUDA adds it into the fp32
        # gradient in place (``losses._add_weight_grad``), holding only the chunk's bf16 gradient
        per_chunk = 8 * chunk + previous
        if s.device != "cuda" and head_grad:
            per_chunk = max(per_chunk, 6 * chunk + 6 * V * d)
        forward = hidden + grads + weight_copy + per_chunk
    else:
        forward = hidden + grads + 8 * chunk + previous
    saved = hidden + s.param_bytes * head_grad
    # grad_hidden * grad_output, and grad_weight * grad_output: the weight's gradient, made while
    # the saved one still exists
    backward = saved + hidden + s.param_bytes * head_grad
    return forward, backward


def dpo_loss_memory(s: Setup) -> tuple[int, int]:
    """DPO's loss head with the fused kernels (``losses.per_token_cross_entropy``): (peak of its
    forward, peak of its backward) in bytes, on top of the blocks' saved activations, like
    ``loss_memory``. Under TP or the reference kernels DPO's per-token cross-entropy is lm's
    vocab-parallel / full-logits one (``loss_memory``).

    Each chunk of ``loss_chunk`` tokens runs under ``torch.utils.checkpoint``, which keeps only its
    inputs: a view of the final norm's output [T, d] (residual dtype), alive from the forward to
    the backward's last chunk. Forward, per chunk: the fp32 logits and their log-softmax (8 bytes
    per logit; the bf16 matmul output is gone once copied to fp32, and nothing is saved), plus the
    per-token losses (fp32, their chunks and the concatenation). Backward, per chunk: the chunk is
    recomputed (its log-softmax kept, 4 per logit), then the log-softmax's backward holds that,
    the incoming gradient and its own output (12 per logit); the matmul's backward then holds the
    logits' gradient (in the compute dtype), the chunk's input gradient and a new [V, d] weight
    gradient (param dtype; none for LoRA's frozen head). From the second chunk on, the hidden
    states' accumulated gradient [T, d] and (head trains) the head's accumulated gradient are
    there too; the slice of the last chunk adds a whole [T, d] gradient to the accumulated one.
    The head's gradient is left behind, as lm's is (the walk adds it after the loss).
    """
    tokens, d, V, r, pb = s.micro * s.seq, s.dim, s.vocab, s.resid_bytes, s.param_bytes
    chunk = s.loss_chunk * V
    hidden = r * tokens * d
    head_grad = 0 if s.lora_rank else V * d
    forward = hidden + 8 * chunk + 8 * tokens
    several = tokens > s.loss_chunk
    kept = (hidden + pb * head_grad) if several else 0  # the accumulated gradients, from the second chunk on
    backward = hidden + max(
        kept + 12 * chunk,
        kept + s.compute_bytes * chunk + r * s.loss_chunk * d + pb * head_grad,
        2 * hidden + (pb * head_grad if several else 0),
    )
    return forward, backward


def reference_block_transient(s: Setup) -> float:
    """Per token, a block's working set in the reference's forward (no gradients: nothing is saved,
    each intermediate is freed once used). Its peak is in SwiGLU: the block's input and the
    residual sum (r d / t each), the norm's output gathered to the full sequence (c d) and three
    [tokens, H/t] tensors (silu(w1 x), w3 x and their product) at once. The attention half holds
    less (q, k, v and its output: at most 4 c d / t beside the same inputs)."""
    d, H, t, c, r = s.dim, s.hidden, s.tp, s.compute_bytes, s.resid_bytes
    return 2 * r * d / t + c * d + max(3 * c * H / t, 4 * c * d / t)


def reference_loss_memory(s: Setup) -> int:
    """The reference forward's loss head, no gradients: the final norm's output and one chunk's fp32
    logits and log-softmax (``per_token_cross_entropy`` without checkpointing), or under TP / the
    reference kernels the logits [T, V/t] (compute dtype), their fp32 copy and log-softmax."""
    tokens, d, V, t, c, r = s.micro * s.seq, s.dim, s.vocab, s.tp, s.compute_bytes, s.resid_bytes
    if s.vocab_parallel_loss:
        return c * tokens * d + (c + 8) * tokens * _ceil(V, t)
    return r * tokens * d + 8 * s.loss_chunk * V + 8 * tokens


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
    walk = _StepWalk(s)
    ledger = walk.run()
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
        "frozen_dtype": ("bf16" if s.frozen_bytes == 2 else "fp32") if s.lora_rank else None,
    }
    if s.dpo:
        layout.update(
            objective="dpo",
            pairs=s.micro // 2,
            reference="copy" if s.reference_copy else "adapters_off",
        )
    return MemoryPlan(**{p: round(ledger.best[p]) for p in PARTS}, phase=ledger.phase, layout=layout)


class _StepWalk:
    """One optimizer step, event by event, as ``train.py`` runs it (see the module doc): the sizes the
    walk needs, worked out once from the ``Setup``, then each micro-batch's forward and backward."""

    def __init__(self, s: Setup) -> None:
        self.s = s
        self.block_p, self.root_p = param_shapes(s)
        self.emb_p, self.head_p, self.whole_p = outer_units(s)
        self.L, self.tokens, self.d, self.t, self.pb = s.layers, s.micro * s.seq, s.dim, s.tp, s.param_bytes
        self.lora = bool(s.lora_rank)
        # LoRA: the base is frozen (no gradients, no optimizer state), the adapters train; QLoRA keeps
        # the targets' weights in NF4, FSDP-gathered as NF4 (``nf4_bytes``) where it shards them
        self.adapters, self.nf4_p = adapter_shapes(s), nf4_shapes(s)
        # the block's parameters FSDP handles as plain tensors: all but the NF4 weights, and the adapters
        self.plain_block = [
            shp for i, shp in enumerate(self.block_p) if not (i < len(_BLOCK_LINEARS) and _in_nf4(s, i))
        ] + self.adapters
        self.train_block, self.train_root = (self.adapters, []) if self.lora else (self.block_p, self.root_p)
        self.shard_block, self.shard_root = _sharded(self.plain_block, s), _sharded(self.root_p, s)
        self.train_shard_block, self.train_shard_root = _sharded(self.train_block, s), _sharded(self.train_root, s)
        self.grad_block = _gathered(self.train_block, s)  # a gathered block's gradients (FSDP reduce-scatters these)
        self.nf4_gathered = nf4_bytes(self.nf4_p, s, gathered=True) if s.nf4_sharded else 0
        # a gathered block's parameters, bytes
        self.unit_block = self.pb * _gathered(self.plain_block, s) + self.nf4_gathered
        self.full_emb, self.full_head, self.full_whole = (
            _gathered(self.emb_p, s),
            _gathered(self.head_p, s),
            _gathered(self.whole_p, s),
        )
        self.head = _ceil(s.vocab, self.t) * self.d  # the LM head's local elements (its gradient appears in the loss)
        self.head_grad = 0 if self.lora else self.head  # frozen under LoRA: the loss's weight gradient is dropped
        # the first weight gradient of a block's backward, there at its peak: w2's (LoRA: its adapters')
        self.w2 = self.d * _ceil(s.hidden, self.t)
        if self.lora:
            self.w2 = s.lora_rank * (self.d + _ceil(s.hidden, self.t)) if "w2" in s.lora_targets else 0
        # Under TP the embedding's gradient comes back Replicate: the full vocabulary on every rank
        # (DTensor's embedding backward), in .grad without FSDP, among the gathered gradients with it.
        self.embedding_grad = (s.vocab * self.d if self.t > 1 else self.head) if not s.tied and not self.lora else 0
        # the embedding unit's gathered gradient; [norm, head]'s and the root's
        self.emb_grads = self.full_emb + self.embedding_grad - self.head if self.emb_p and not self.lora else 0
        self.head_grads, self.whole_grads = (0, 0) if self.lora else (self.full_head, self.full_whole)
        self.dequant = nf4_dequantized(s)

        self.casts = weight_casts(s)
        self.saved = block_saved(s) * self.tokens + (self.casts + rope_tables(s) if s.ac == "none" else 0)
        # LoRA: the first block's input (the frozen embedding's output) needs no gradient, so its
        # attention norm saves nothing for the backward (the adapters' inputs follow it)
        self.first_relief = (4 * self.d / self.t + 4 / self.t) * self.tokens if self.lora and s.ac == "none" else 0
        self.cast_cache = self.casts if s.ac != "none" else 0  # autocast's copies, released when the forward ends
        self.backward_extra = block_backward_extra(s) * self.tokens + (
            self.cast_cache + rope_tables(s) if s.ac != "none" else 0
        )
        self.loss_fwd, self.loss_bwd = dpo_loss_memory(s) if s.dpo and not s.vocab_parallel_loss else loss_memory(s)
        # DPO's frozen reference copy: its shards in the compute dtype and its own RoPE tables; its
        # units gathered for its forward only (the trainer reshards the [norm, head] unit, tied: the
        # root, after it: no backward follows). With LoRA the policy's own units, gathered for it.
        self.reference = (
            s.compute_bytes * (self.L * self.shard_block + self.shard_root) + 4 * s.max_seq_len * s.head_dim
            if s.reference_copy
            else 0
        )
        self.norm_saved = final_norm_saved(s) * self.tokens
        # packed examples: the bool [b, 1, s, s] mask (reference kernels) and the RoPE tables gathered
        # at each position, alive through the forward; AC's checkpoints keep them (block inputs) until
        # the backward ends. Fused kernels turn the mask into one additive mask in the compute dtype,
        # which every layer's SDPA keeps for its backward: alive until the backward ends
        self.packed_inputs = s.micro * s.seq * ((0 if s.fused_kernels else s.seq) + 4 * s.head_dim) if s.packed else 0
        self.shared_mask = s.micro * s.seq * s.seq * s.compute_bytes if s.packed and s.fused_kernels else 0

        self.gather = self._gather_of(self.unit_block)  # one block's
        self.prefetch = self.gather

    def _gather_of(self, nbytes: int) -> int:
        """A unit's all-gather output, ahead of its copy-out; with one shard (one process, or HSDP's
        dp_shard=1) FSDP2 copies the parameters out of the shard without an all-gather buffer."""
        return nbytes if self.s.fsdp and self.s.dp_shard > 1 else 0

    def _settle(self, now: dict[str, float], first: bool, last: bool, shard: int, kept: int) -> None:
        """A unit's post-backward, after its parameters are resharded and the gradient it just
        made is dropped from ``now``: reduce-scattered into this rank's fp32 shard, or (no sync
        before the last micro-batch) its ``kept`` gathered elements stay, in fp32."""
        if self.s.reduce_each_micro_batch:
            now["grads"] += 4 * shard if first else 0
        elif last:
            now["grads"] += 4 * shard
            now["unsharded"] -= 0 if first else 4 * kept
        elif first:
            now["unsharded"] += 4 * kept

    def run(self) -> _Peak:
        s, ledger = self.s, _Peak()
        now = ledger.now
        # the parameters' shards: fp32 masters of what trains, the frozen rest (LoRA's base, NF4
        # apart) in its own dtype (``Setup.frozen_bytes``); + RoPE cos/sin
        trained = self.L * self.train_shard_block + self.train_shard_root
        frozen = self.L * self.shard_block + self.shard_root - trained
        now["params"] = 4 * trained + s.frozen_bytes * frozen + 4 * s.max_seq_len * s.head_dim
        now["params"] += self.L * nf4_bytes(self.nf4_p, s)
        # AdamW: exp_avg and exp_avg_sq in fp32, and a scalar step count per parameter tensor (fused
        # AdamW keeps it on the device: a 512-byte block there); only what trains
        now["optimizer"] = 2 * 4 * (self.L * self.train_shard_block + self.train_shard_root) + (
            512 if s.device == "cuda" else 4
        ) * (self.L * len(self.train_block) + len(self.train_root))
        now["activations"] = 2 * 8 * s.local_batch * s.seq  # token ids and targets of the whole local batch
        now["reference"] = self.reference

        # Micro-batches between the second and the last repeat the second exactly: walk 1, 2 and the last.
        for k in sorted({0, 1, s.micro_batches - 1} & set(range(s.micro_batches))):
            self._micro_batch(ledger, k)
        ledger.moment("optimizer step")
        return ledger

    def _micro_batch(self, ledger: _Peak, k: int) -> None:
        s = self.s
        first, last = k == 0, k == s.micro_batches - 1
        reduce = last or s.reduce_each_micro_batch  # FSDP reduce-scatters this backward's gradients
        tag = f"(micro-batch {k + 1}/{s.micro_batches})"
        # Gradients a backward allocates: all of them in the first micro-batch; later ones add into
        # the kept fp32 gradients in place, except FSDP's bf16 ones (cast to fp32 after each backward)
        # and any FSDP reduced after the previous micro-batch (its gathered gradients were freed).
        new_grads = first or self.pb != 4 or s.reduce_each_micro_batch
        if s.dpo:
            self._reference_forward(ledger, tag)
        self._forward(ledger, tag)
        self._backward(ledger, first, last, reduce, new_grads, tag)

    def _reference_forward(self, ledger: _Peak, tag: str) -> None:
        """DPO's reference over the micro-batch's rows, without gradients, before the policy's forward:
        one gathered unit at a time, one block's working set, then one loss chunk; nothing saved.
        The copy's units are the policy's in the compute dtype (the bytes FSDP gathers for the
        policy); its [norm, head] / root is gathered like the policy's and resharded by the trainer
        when the forward ends. With LoRA the policy's own units: its [norm, head] (tied: its root)
        stays gathered from here through the policy's forward, which then gathers it no more
        (``_forward``)."""
        s, now = self.s, ledger.now
        tokens, shared = self.tokens, not s.reference_copy  # LoRA: the policy's units
        held = 0  # gathered until the forward ends: the root (tied), then [norm, head]
        if self.whole_p:
            held += self.pb * self.full_whole  # the root, gathered first
            now["unsharded"] += self.pb * self.full_whole
        now["activations"] += self.packed_inputs
        if self.emb_p:
            ledger.moment(
                f"reference forward: embedding {tag}",
                unsharded=self.pb * self.full_emb,
                comm=self._gather_of(self.pb * self.full_emb),
            )
        for i in range(self.L):
            ledger.moment(
                f"reference forward: layer {i} {tag}",
                unsharded=self.unit_block,
                comm=self.gather,
                temporaries=reference_block_transient(s) * tokens + self.dequant + self.shared_mask,
            )
        if self.head_p:
            held += self.pb * self.full_head  # gathered as the norm runs
            now["unsharded"] += self.pb * self.full_head
        ledger.moment(
            f"reference forward: loss {tag}",
            logits=reference_loss_memory(s),
            comm=self._gather_of(self.pb * self.full_head) if self.head_p else 0,
        )
        if not shared:  # the copy's: resharded when its forward ends (LoRA's: kept for the policy's forward)
            now["unsharded"] -= held
        now["activations"] -= self.packed_inputs

    def _forward(self, ledger: _Peak, tag: str) -> None:
        """FSDP gathers the root unit first (tied embeddings: embedding, norm and head), and it stays
        gathered until the end of its backward; untied, the embedding is gathered for its forward only."""
        s, now = self.s, ledger.now
        # DPO with LoRA: the reference forward left the root (tied) or [norm, head] gathered
        held = s.dpo and not s.reference_copy

        if s.fsdp and not held:
            now["unsharded"] += self.pb * self.full_whole
        now["activations"] += self.packed_inputs
        if s.fsdp and self.emb_p:
            ledger.moment(
                f"embedding forward {tag}",
                unsharded=self.pb * self.full_emb,
                comm=self._gather_of(self.pb * self.full_emb),
            )
        now["activations"] += self.shared_mask
        for i in range(self.L):
            if s.fsdp:  # this block's all-gather output and its copy-out into the parameters
                ledger.moment(
                    f"forward of layer {i} {tag}", unsharded=self.unit_block, comm=self.gather, temporaries=self.dequant
                )
            now["activations"] += self.saved + self.cast_cache - (self.first_relief if i == 0 else 0)
        now["activations"] += self.norm_saved
        if s.fsdp and not held:  # [norm, head] (untied): gathered as the norm runs, kept through the loss
            now["unsharded"] += self.pb * self.full_head
        if s.ac == "none":
            now["activations"] -= self.packed_inputs
        # FSDP keeps the forward's last all-gather output until the forward ends: the last
        # block's, or (untied) [norm, head]'s
        ledger.moment(
            f"loss forward {tag}",
            logits=self.loss_fwd,
            comm=self._gather_of(self.pb * self.full_head) if self.head_p and not held else self.prefetch,
        )
        now["activations"] -= self.L * self.cast_cache

    def _backward(self, ledger: _Peak, first: bool, last: bool, reduce: bool, new_grads: bool, tag: str) -> None:
        s, now = self.s, ledger.now

        # The last block's all-gather, prefetched by the unit whose output the loss is: the root, or
        # [norm, head] for the fused loss. With logits out of the head (TP's loss, reference
        # kernels) the cross-entropy's backward runs before [norm, head]'s pre-backward.
        loss_prefetch = 0 if self.head_p and s.vocab_parallel_loss else self.prefetch
        ledger.moment(f"loss backward {tag}", logits=self.loss_bwd, comm=loss_prefetch)
        now["activations"] -= self.norm_saved
        if new_grads:  # the LM head's gradient, from the loss
            now["unsharded" if s.fsdp else "grads"] += (self.pb if s.fsdp else 4) * self.head_grad
        if s.fsdp and self.head_p:  # [norm, head] reshards after the norm's backward, before the blocks'
            now["unsharded"] -= self.pb * (self.full_head + (self.head_grad if new_grads else 0))
            self._settle(now, first, last, _sharded(self.head_p if not self.lora else [], s), self.head_grads)
        for i in reversed(range(self.L)):
            moment = {"temporaries": self.backward_extra + self.dequant}
            if s.fsdp:
                # parameters, first gradient
                moment["unsharded"] = self.unit_block + (self.pb * self.w2 if new_grads else 0)
                # the next unit's all-gather: the block below, or (untied) the embedding
                moment["comm"] = self.prefetch if i > 0 else self._gather_of(self.pb * self.full_emb)
                if reduce:  # the previous unit's reduce-scatter input (fp32): the block above, or [norm, head]
                    moment["comm"] += 4 * (self.grad_block if i < self.L - 1 else self.head_grads)
            elif new_grads:
                moment["grads"] = 4 * self.w2
            ledger.moment(f"backward of layer {i} {tag}", **moment)
            now["activations"] -= self.saved - (self.first_relief if i == 0 else 0)
            if not s.fsdp:
                now["grads"] += 4 * self.train_shard_block if new_grads else 0
            else:
                self._settle(now, first, last, self.train_shard_block, self.grad_block)
        now["activations"] -= self.shared_mask + (self.packed_inputs if s.ac != "none" else 0)
        # embedding backward, then (FSDP) its unit reshards and reduce-scatters
        if not s.fsdp:
            if new_grads and not self.lora:
                now["grads"] += 4 * (
                    self.embedding_grad + self.shard_root - self.head - (self.head if not s.tied else 0)
                )
            ledger.moment(f"end of backward {tag}")
            return
        if self.emb_p:  # gathered again (prefetched during layer 0's backward), its gradient made
            block_rs = 4 * self.grad_block if reduce else 0  # layer 0's reduce-scatter input
            grad = self.pb * self.embedding_grad if new_grads else 0
            ledger.moment(f"embedding backward {tag}", unsharded=self.pb * self.full_emb + grad, comm=block_rs)
            self._settle(now, first, last, _sharded(self.emb_p if not self.lora else [], s), self.emb_grads)
            ledger.moment(f"end of backward {tag}", comm=4 * self.full_emb if reduce and not self.lora else 0)
        else:  # tied: the root unit reshards, its gradient (head's and embedding's) reduced
            now["unsharded"] -= self.pb * (self.full_whole + (self.head_grad if new_grads else 0))
            self._settle(now, first, last, _sharded(self.whole_p if not self.lora else [], s), self.whole_grads)
            ledger.moment(f"end of backward {tag}", comm=4 * self.whole_grads if reduce else 0)


def scoring_memory(cfg: TrainerCfg, plan: MemoryPlan) -> tuple[int, int]:
    """``eval.tasks`` during training, on rank 0's device: (what the trainer keeps there while lm-eval
    runs, the model lm-eval loads beside it), bytes.

    The trainer keeps its parameter shards and AdamW states (and DPO's reference copy's shards): the
    step's gradients are freed
    (``zero_grad(set_to_none=True)``), its activations are gone, and it empties the allocator's cache
    before scoring (``task_scores``). The harness, a second process on the same device, loads the
    whole exported model (LoRA merged) in the export's dtype: bf16 on a GPU, fp32 on CPU
    (``task_scores.score_step``). lm-eval's batches come on top; their size is the tasks' documents',
    which no config says."""
    per_weight = 2 if plan.layout.get("device") == "cuda" else 4
    kept = plan.reference
    return plan.params + plan.optimizer + kept, shape.num_params(cfg.model, exclude_embedding=False) * per_weight


def _walk_step(s: Setup) -> _Peak:
    """One optimizer step, event by event, as ``train.py`` runs it (see the module doc)."""
    return _StepWalk(s).run()
