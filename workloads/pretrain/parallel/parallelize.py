"""How the Transformer is distributed: mesh degrees, then FP8 -> TP -> AC -> compile -> FSDP2.

``ParallelDims`` validates ``parallel.*`` against the world size (``validate``, the same rules
llmctl applies when it composes the config) before any process-group work, then builds a named DeviceMesh
``("dp_replicate", "dp_shard", "tp")``. ``parallelize`` applies each technique with one small
function, in the order written there. Reading ``parallelize`` tells you how the model runs.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workloads.pretrain.model.transformer import Transformer, apply_compile
from workloads.protocol.schema import GradSync, TrainerCfg

# The first torch release whose compiled tensor-parallel blocks break in backward. 2.11 trains
# correctly; 2.13 and 2.14 fail (tp alone: DTensor's Redistribute backward receives a plain Tensor,
# "'Tensor' object has no attribute '_local_tensor'") or, worse, train on wrong gradients with FSDP
# on the dp dimension (dp2 x tp2, or a 1-rank dp: the first loss matches, the gradient norm does
# not). 2.12 was not tried and is refused with them. A standalone reproduction is in issue #31.
TP_COMPILE_BROKEN_FROM = (2, 12)


def check_tp_compile(cfg: TrainerCfg, version: str | None = None) -> None:
    """Refuse ``parallel.tp > 1`` with ``model.compile`` on a torch where that is broken
    (``TP_COMPILE_BROKEN_FROM``), before any process-group work: a config error naming both keys
    and the fix, not a crash in the first backward or a silently wrong gradient."""
    from workloads.protocol.validate import ConfigError

    version = version or torch.__version__
    major, minor = (int(part) for part in version.split(".")[:2])
    if cfg.parallel.tp > 1 and cfg.model.compile and (major, minor) >= TP_COMPILE_BROKEN_FROM:
        raise ConfigError(
            f"Bad value for 'model.compile': torch.compile with tensor parallelism (parallel.tp={cfg.parallel.tp}) "
            f"fails in backward or computes wrong gradients on torch {version}. Fix: model.compile=false, "
            "or parallel.tp=1 (FSDP shards any size)"
        )


@dataclass(frozen=True)
class ParallelDims:
    """Concrete mesh degrees; ``dp_replicate * dp_shard * tp == world_size``."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: TrainerCfg, world_size: int) -> "ParallelDims":
        """Validate the layout for ``world_size`` processes (raises ``validate.ConfigError`` with the fix).

        Static rules first (tp divides the head counts, the batch splits over dp), then the ones
        that need the world size, so a bad tp reads as a head-count problem, not a process count.
        """
        from workloads.protocol.validate import check_static_layout, resolve_layout

        check_static_layout(cfg)
        layout = resolve_layout(cfg, world_size)
        check_tp_compile(cfg)
        return cls(layout["dp_replicate"], layout["dp_shard"], layout["tp"], world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    def dp_rank(self, rank: int) -> int:
        """Mesh is row-major over (dp_replicate, dp_shard, tp): tp ranks are adjacent."""
        return rank // self.tp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
        )


def parallelize(
    model: Transformer, dims: ParallelDims, mesh: DeviceMesh | None, cfg: TrainerCfg, frozen: bool = False
) -> Transformer:
    """Apply the configured parallelisms in place, in this fixed order:

    0. FP8 (``train.fp8``) swaps eligible linears for torchao's Float8Linear before anything
       wraps, compiles or shards them (``fp8.py``; refused with TP by ``validate``).
    1. TP first: it swaps parameters for tp-sharded DTensors, which everything after must see.
       LoRA (``model.lora.rank``) then freezes the model and gives the target linears adapters
       laid out on the tp mesh beside their TP-sharded weights, keeping TP's hooks on the module
       (``lora.py``); with ``quantize_base=nf4`` their weights become NF4 placeholders, which
       FSDP shards as 4-bit bytes, or under TP NF4 buffers in TP's layout (``nf4.py``), and the rest
       of the frozen base is held in the compute dtype (``lora.hold_frozen_in``).
    2. AC wraps whole blocks, so it comes after TP (and LoRA) have rewritten the modules inside them.
    3. compile each (checkpointed) block: the graph then contains the recomputation and TP's
       DTensor ops, but not FSDP's hooks, which stay in eager and overlap communication.
    4. FSDP2 last: it shards whatever parameters exist (on the dp mesh; 2-D with TP) and
       registers its all-gather / reduce-scatter hooks around the final modules. Always, when
       there is a mesh: with one data-parallel rank it shards nothing, but it is the bf16 recipe
       (``apply_fsdp``), so one process and many compute alike. (TP with compile is refused on the
       torch releases where it breaks: ``check_tp_compile``.)

    ``frozen`` (DPO's reference copy): after TP every parameter is frozen and held in the compute
    dtype (``lora.hold_frozen_in``), and there is no LoRA or AC (nothing runs backward through it).
    """
    from workloads.pretrain.parallel import fp8

    if fp8.recipe(cfg) != "none":
        fp8.convert(model, fp8.recipe(cfg), fsdp=dims.dp_enabled)
    if dims.tp_enabled:
        apply_tp(model, mesh["tp"])
    if frozen:
        from workloads.pretrain.model import lora

        model.requires_grad_(False)
        lora.hold_frozen_in(model, compute_dtype(cfg, mesh.device_type if mesh is not None else "cpu"))
    elif cfg.model.lora.rank:
        from workloads.pretrain.model import lora

        dtype = compute_dtype(cfg, mesh.device_type if mesh is not None else "cpu")
        lora.apply(model, cfg.model.lora, dtype, shard_base=mesh is not None and dims.dp_shard > 1)
    if cfg.parallel.ac != "none" and not frozen:
        apply_ac(model, cfg.parallel.ac.value)
    if cfg.model.compile:
        apply_compile(model)
    if mesh is not None:  # the trainer always has one: a 1-rank mesh for one process (``build_mesh``)
        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
        apply_fsdp(model, dp_mesh, param_dtype=compute_dtype(cfg, mesh.device_type))
    return model


def compute_dtype(cfg: TrainerCfg, device_type: str) -> torch.dtype:
    """``train.dtype`` resolved for ``device_type`` (``auto``: bf16 on CUDA, fp32 on CPU)."""
    return torch.bfloat16 if cfg.train.dtype.on(device_type) == "bf16" else torch.float32


def autocast_context(model: torch.nn.Module, cfg: TrainerCfg, device_type: str) -> Callable[[], ContextManager]:
    """The forward's autocast: none for a model FSDP wraps (the trainer's, at any world size).

    The one bf16 recipe is FSDP2's: bf16 parameters gathered per block, an fp32 master copy in the
    shards, gradients reduced in fp32 (``apply_fsdp``). Autocast on top would only add a cast per
    matmul of what is already bf16. It remains for a model built without a mesh (benchmarks that
    build one process's model without a process group): bf16 autocast over its fp32 weights.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) or compute_dtype(cfg, device_type) != torch.bfloat16:
        return nullcontext
    return lambda: torch.autocast(device_type, dtype=torch.bfloat16)


def loss_context(dims: ParallelDims) -> Callable[[], ContextManager]:
    """Context for forward *and* backward: TP's vocab-sharded logits need ``loss_parallel``."""
    if dims.tp_enabled:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel
    return nullcontext


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP with sequence parallelism (Korthikanti et al.) and a vocab-parallel loss.

    The residual stream between blocks stays sharded on the sequence dim (Shard(1)); norms run on
    their sequence shard; attention / FFN inputs are all-gathered (PrepareModuleInput), q/k/v and
    w1/w3 split heads / hidden units (Colwise), wo and w2 reduce-scatter back to Shard(1)
    (Rowwise). The LM head is Colwise with vocab-sharded logits (Shard(-1)) kept as a DTensor,
    and the model computes the loss on those logits under ``loss_parallel`` (see
    ``Transformer.vocab_parallel_loss``): the chunked fused CE needs the whole output weight,
    so TP trades it for logits that are 1/tp of the vocab per rank.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                # forward(x, cos, sin, mask): gather x over the sequence; RoPE tables and mask are plain tensors
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
    model.tie_weights()  # embedding (Rowwise) and head (Colwise) both shard the vocab dim: re-share
    model.vocab_parallel_loss = True


@functools.cache
def sac_save_ops() -> frozenset:
    """The ops whose outputs selective AC keeps; it recomputes the rest (norms, RoPE, SiLU, adds).
    Built on first use: torch's op list imports its compiler stack, which a run without selective AC
    never needs.

    Built as torchtitan builds its list: torch's own compute-intensive ops (what the min-cut
    partitioner never recomputes: mm, addmm, bmm, the SDPA flash / efficient ops, ``_scaled_mm``
    for FP8 ...), so a kernel torch adds there is saved without an edit here, plus what that list
    lacks: the cuDNN SDPA op (what SDPA picks on Hopper with a recent cuDNN), the flash / efficient
    kernels' own forward ops, CPU's flash op, ``aten.max`` (FP8's amax, a reduction over a whole
    weight or activation) and TP's collectives (saved so the backward does not communicate twice).
    Names this torch does not have are skipped."""
    try:
        from torch._functorch.partitioners import get_default_op_list

        ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    except (ImportError, AttributeError):  # private API: fall back to the named ops below
        ops = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    names = (
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._flash_attention_forward",
        "aten._efficient_attention_forward",
        "aten._scaled_mm",
        "aten.max",
        "_c10d_functional.reduce_scatter_tensor",
        "_c10d_functional.all_gather_into_tensor",
    )
    for name in names:
        namespace, op = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, "default"):
            ops.add(packet.default)
    return frozenset(ops)


def sac_policy(ctx, op, *args, **kwargs):
    """Selective AC's decision for one op: keep its output (``sac_save_ops``) or recompute it."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in sac_save_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(sac_policy)


def apply_ac(model: Transformer, mode: str) -> None:
    """Activation checkpointing per block: ``full`` recomputes the whole block in backward;
    ``selective`` is per-op SAC (``sac_save_ops``): saves matmul/attention/collective outputs only.

    The wrapper adds ``_checkpoint_wrapped_module`` to module paths; DCP's state-dict helpers
    strip it, so checkpoints are interchangeable across AC modes.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode not in ("full", "selective"):
        raise ValueError(f"parallel.ac must be none, selective or full, got {mode!r}")
    kwargs = {"context_fn": _sac_context} if mode == "selective" else {}
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, param_dtype: torch.dtype) -> None:
    """FSDP2: the embedding, one unit per block, the final norm with the LM head, then the root.

    Three units instead of one root holding embedding, norm and head: the root unit is gathered
    first and stays gathered until the end of its backward, so a root that held the embedding and
    the head kept both whole for the whole step (about 4 GB of bf16 per GPU for 70B at tp 1). The
    embedding is gathered for its forward and its backward only; [norm, head] is gathered when the
    norm runs and kept through the loss (``reshard_after_forward=False``: its backward comes next,
    so resharding would only gather it again). The loss goes through the head's own call
    (``LMHead``), so FSDP sees it run. Tied embeddings share one matrix: they stay in the root.

    A 2-D ``dp_mesh`` (dp_replicate, dp_shard) gives HSDP; a 1-rank one (one process) shards
    nothing but keeps the recipe. ``param_dtype`` bf16 is the trainer's mixed precision: each
    unit gathers bf16 copies of its fp32 shards, so the residual stream, the matmuls and the
    saved activations are bf16, the optimizer updates fp32, and gradients are reduced in fp32.
    The blocks do not cast their inputs (``cast_forward_inputs=False``): the residual stream is
    already bf16 from the bf16 embedding, and the RoPE cos/sin tables stay fp32 (in bf16, angles
    at long positions would lose their low bits).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    block_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    if not model.tie_embeddings:
        fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=block_mp)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=block_mp)
    if not model.tie_embeddings:
        fully_shard([model.norm, model.output], mesh=dp_mesh, mp_policy=block_mp, reshard_after_forward=False)
    fully_shard(
        model, mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    )


def gradient_sync_due(index: int, count: int, grad_sync: GradSync) -> bool:
    """Whether micro-batch ``index`` of ``count`` reduces its gradients: every one with
    ``parallel.grad_sync=micro_batch`` (they stay sharded), else only the last (``step``, and
    ``auto`` when llmctl did not resolve it: one reduction per step, full gradients kept between)."""
    return index == count - 1 or grad_sync == "micro_batch"


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """FSDP2: reduce-scatter gradients in this backward, or keep accumulating them unsharded
    (``gradient_sync_due`` says which)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)  # recurses into every block's unit


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor loss (TP's loss_parallel) as a plain tensor; others unchanged."""
    from torch.distributed.tensor import DTensor

    return loss.full_tensor() if isinstance(loss, DTensor) else loss
