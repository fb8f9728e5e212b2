"""How the Transformer is distributed: mesh degrees, then FP8 -> TP -> AC -> compile -> FSDP2.

``ParallelDims`` validates ``parallel.*`` against the world size (``validate``, the same rules
llmctl applies when it composes the config) before any process-group work, then builds a named DeviceMesh
``("dp_replicate", "dp_shard", "tp")``. ``parallelize`` applies each technique with one small
function, in the order written there. Reading ``parallelize`` tells you how the model runs.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workloads.pretrain.contract.schema import GradSync, TrainerCfg
from workloads.pretrain.model.transformer import Transformer, apply_compile


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
        from workloads.pretrain.contract.validate import check_static_layout, resolve_layout

        check_static_layout(cfg)
        layout = resolve_layout(cfg, world_size)
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


def parallelize(model: Transformer, dims: ParallelDims, mesh: DeviceMesh | None, cfg: TrainerCfg) -> Transformer:
    """Apply the configured parallelisms in place, in this fixed order:

    0. FP8 (``train.fp8``) swaps eligible linears for torchao's Float8Linear before anything
       wraps, compiles or shards them (``fp8.py``; refused with TP by ``validate``).
    1. TP first: it swaps parameters for tp-sharded DTensors, which everything after must see.
    2. AC wraps whole blocks, so it comes after TP has rewritten the modules inside them.
    3. compile each (checkpointed) block: the graph then contains the recomputation and TP's
       DTensor ops, but not FSDP's hooks, which stay in eager and overlap communication.
    4. FSDP2 last: it shards whatever parameters exist (on the dp mesh; 2-D with TP) and
       registers its all-gather / reduce-scatter hooks around the final modules.
    """
    from workloads.pretrain.parallel import fp8

    if fp8.recipe(cfg) != "none":
        fp8.convert(model, fp8.recipe(cfg), fsdp=dims.dp_enabled)
    if dims.tp_enabled:
        apply_tp(model, mesh["tp"])
    if cfg.parallel.ac != "none":
        apply_ac(model, cfg.parallel.ac.value)
    if cfg.model.compile:
        apply_compile(model)
    if dims.dp_enabled:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
        bf16 = cfg.train.dtype == "bf16" and mesh.device_type == "cuda"
        apply_fsdp(model, dp_mesh, param_dtype=torch.bfloat16 if bf16 else torch.float32)
    return model


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


# Selective AC keeps these ops' outputs and recomputes the rest (norms, RoPE, SiLU, adds): the
# matmuls and attention are where the FLOPs are; the TP collectives are saved so the backward
# does not communicate twice. Everything else is cheap elementwise work on large activations.
_SAC_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}


def _sac_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in _SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(model: Transformer, mode: str) -> None:
    """Activation checkpointing per block: ``full`` recomputes the whole block in backward;
    ``selective`` is per-op SAC (``_SAC_SAVE``): saves matmul/attention/collective outputs only.

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
    """FSDP2: one unit per block, and the root (embedding, final norm, LM head) as the last.

    A 2-D ``dp_mesh`` (dp_replicate, dp_shard) gives HSDP. Gradients are reduced in fp32
    whatever the compute dtype. ``output`` must stay in the root unit: the fused loss reads
    ``output.weight`` without calling the module, so a separate unit would never gather it.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


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
