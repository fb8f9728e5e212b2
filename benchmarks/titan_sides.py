"""The two sides of ``gpu_vs_torchtitan``: a model, its loss and its FLOPs count, for one shape.

Split from the benchmark so ``tests/benchmarks/test_torchtitan_side.py`` builds torchtitan's side on CPU
through this same code: a change in torchtitan's API then fails CI, not the GPU session.

torchtitan (``TORCHTITAN``, read from its 0.3.0 source): ``model_registry(flavor, attn_backend)``
gives a ``ModelSpec`` whose ``.model`` config ``.build()``s a ``Llama3Model``; RoPE's cache length
is ``layers[i].attention.rope.max_seq_len`` (its trainer shrinks it to ``training.seq_len``);
``forward(tokens, positions=None, attention_masks=None)``; masks come from
``get_attention_masks(positions)`` (flex / varlen only). Its llama3 trainer configs use
``ChunkedLossWrapper`` (8 chunks of lm_head + CE, ``model._skip_lm_head``) around
``CrossEntropyLoss``, whose CE ``torch.compile``s when ``compile.components`` has "loss";
compile is per block, ``fullgraph=True`` (``distributed.compile.apply_compile``); on one GPU it
still calls ``apply_fsdp_to_decoder`` on a 1-rank mesh for its bf16 ``MixedPrecisionPolicy``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

TORCHTITAN = "torchtitan==0.3.0"  # pyproject's `bench` extra must say the same (tests check)
# What its model, loss, compile and FSDP modules import beyond torch, at the versions its 0.3.0
# metadata names or the newest (tyro, docstring-parser) when it names none. triton: imported at
# module level by its MoE expert-parallel kernels, which llama3's decoder imports; CUDA torch
# wheels bring it, CPU ones do not. The CPU test installs these beside it with --no-deps.
TORCHTITAN_IMPORTS = ("spmd_types==0.2.3", "tyro==1.0.17", "docstring-parser==0.18.0", "triton==3.9.0")
REPO = Path(__file__).resolve().parents[1]
# Benchmark shapes: (our conf/model name, torchtitan flavor). Depth is cut the same on both.
SHAPES = {"1b": ("1b", "1B"), "8b": ("8b", "8B")}
PRECISIONS = ("fsdp", "autocast", "fp32")
TT_ATTENTION = ("flex", "flex_flash", "varlen", "sdpa")
# torchtitan 0.3.0 is written against torch 2.13: older torch (the GPU machine's 2.11) lacks
# ``torch.distributed.fsdp.DataParallelMeshDims``, which it imports, and its FSDP side then fails.
TITAN_TORCH = (2, 13)


@dataclass
class Side:
    """One trainer's model and step pieces. ``loss(x, y)`` returns a scalar ready for backward."""

    name: str
    model: torch.nn.Module
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    flops_per_token: int
    autocast: Callable[[], Any]


def one_rank_mesh(device: torch.device):
    """A 1-rank device mesh (starting a 1-rank process group if none), for FSDP's bf16 policy."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))


def torch_predates_titan(version: str | None = None) -> bool:
    """Whether ``version`` (default: this torch) is older than the torch torchtitan 0.3.0 is written for."""
    from torch.torch_version import TorchVersion

    return TorchVersion(version or torch.__version__) < TITAN_TORCH


def titan_import_shim() -> None:
    """Let torchtitan 0.3.0 import on torch < 2.13: a stand-in ``DataParallelMeshDims`` (only its
    import is needed: the 1-device sides never construct one). Without it the import chain
    ``torchtitan.models.llama3 -> parallelize -> distributed/fsdp.py`` fails before any model is built."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        return

    class DataParallelMeshDims:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError(f"{TORCHTITAN} needs torch >= 2.13 for this, not {torch.__version__}")

    fsdp.DataParallelMeshDims = DataParallelMeshDims


def runnable_precision(precision: str, version: str | None = None) -> str:
    """``precision``, or ``autocast`` in place of ``fsdp`` on torch < 2.13, with a line saying why:
    there torchtitan's FSDP side dies in backward ("The tensor has a non-zero number of elements,
    but its data is not allocated yet") while its autocast side trains, and both sides must run the
    same recipe for the comparison to mean anything."""
    if precision == "fsdp" and torch_predates_titan(version):
        print(
            f"precision: autocast instead of fsdp on both sides: torch {version or torch.__version__} < "
            f"{'.'.join(map(str, TITAN_TORCH))}, where {TORCHTITAN}'s FSDP side fails in backward",
            flush=True,
        )
        return "autocast"
    return precision


def _autocast(device: torch.device, precision: str) -> Callable[[], Any]:
    if precision == "autocast":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def check_settings(precision: str, attn: str | None = None) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r} (GPU_BENCH_PRECISION)")
    if attn is not None and attn not in TT_ATTENTION:
        raise ValueError(f"torchtitan attention must be one of {TT_ATTENTION}, got {attn!r} (GPU_BENCH_TT_ATTN)")


def ours_cfg(name: str, n_layers: int | None = None, **overrides: Any):
    """conf/model/<name>.yaml as a structured ``ModelCfg``, optionally cut to ``n_layers``."""
    from omegaconf import OmegaConf

    from workloads.protocol.schema import ModelCfg

    cfg = OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(REPO / f"conf/model/{name}.yaml"))
    if n_layers is not None:
        cfg.n_layers = n_layers
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def ours_side(
    cfg: Any,
    seq_len: int,
    device: torch.device,
    *,
    precision: str = "fsdp",
    compile_model: bool = True,
    compile_loss: bool = False,
) -> Side:
    """llmctl: ``model.kernels=fused`` (SDPA, fused linear-CE), per-block ``apply_compile``, and for
    ``fsdp`` the trainer's own ``parallelize.apply_fsdp`` (bf16 params, fp32 reduce) on 1 rank."""
    from workloads.pretrain.model.transformer import apply_compile, build_model
    from workloads.protocol.shape import flops_per_token

    check_settings(precision)
    cfg.kernels = "fused"
    cfg.max_seq_len = max(int(cfg.max_seq_len), seq_len)
    model = build_model(cfg, device)
    if compile_model:
        apply_compile(model)
    if precision == "fsdp":
        from workloads.pretrain.parallel.parallelize import apply_fsdp

        apply_fsdp(model, one_rank_mesh(device), param_dtype=torch.bfloat16)
    if compile_loss:  # the LM head + CE that forward() calls, compiled as torchtitan compiles its CE
        import workloads.pretrain.model.transformer as ours

        if not hasattr(ours.fused_lm_loss, "_torchdynamo_orig_callable"):  # once per process
            ours.fused_lm_loss = torch.compile(ours.fused_lm_loss)
    return Side("llmctl", model, lambda x, y: model(x, y), flops_per_token(cfg, seq_len), _autocast(device, precision))


def titan_config(flavor: str, n_layers: int | None = None, attn: str = "flex"):
    """torchtitan's ``model_registry(flavor)`` model config, cut to ``n_layers`` blocks.

    ``attn='sdpa'``: torchtitan's own ``ScaledDotProductAttention`` (causal, cuDNN > flash
    priority) in every block; its registry refuses "sdpa" for LMs only because packed documents
    need masks, and this benchmark has none.
    """
    titan_import_shim()
    from torchtitan.models.llama3 import model_registry

    check_settings("fsdp", attn)
    spec = model_registry(flavor, attn_backend="flex" if attn == "sdpa" else attn)
    cfg = spec.model
    if n_layers is not None:
        cfg.layers = cfg.layers[:n_layers]
    if attn == "sdpa":
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def titan_flops(cfg: Any, seq_len: int, model: torch.nn.Module | None = None) -> int:
    """torchtitan's own FLOPs/token for MFU (``get_nparams_and_flops``), from a meta-built model."""
    if model is None:
        with torch.device("meta"):
            model = cfg.build()
    return int(cfg.get_nparams_and_flops(model, seq_len)[1])


def titan_side(
    cfg: Any,
    seq_len: int,
    batch: int,
    device: torch.device,
    *,
    precision: str = "fsdp",
    compile_model: bool = True,
    compile_loss: bool = True,
) -> Side:
    """torchtitan as its trainer sets it up for one device: RoPE cache cut to ``seq_len``, meta
    build, per-block compile, FSDP2 bf16 policy, chunked lm_head + (compiled) CE."""
    titan_import_shim()
    from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    check_settings(precision)
    for layer in cfg.layers:  # what Decoder.Config.update_from_config does for training.seq_len
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
    with torch.device("meta"):
        model = cfg.build()
    flops = titan_flops(cfg, seq_len, model)
    compile_cfg = CompileConfig(
        enable=compile_model or compile_loss,
        components=[c for c, on in (("model", compile_model), ("loss", compile_loss)) if on],
    )
    if compile_model:
        apply_compile(
            model,
            compile_config=compile_cfg,
            parallel_dims=ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1),
        )
    if precision == "fsdp":
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

        apply_fsdp_to_decoder(
            model, one_rank_mesh(device), param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False
        )
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=None)
    model.train()

    inner = cfg.layers[0].attention.inner_attention
    masks = None
    if isinstance(inner, (FlexAttention.Config, VarlenAttention.Config)):
        # one document per row, so the block-causal mask is the causal mask; forward then gets
        # positions=None and RoPE reads its cache directly (identical to positions = arange).
        positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
        masks = model.get_attention_masks(positions=positions)
    loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=cfg.vocab_size)).build(
        compile_config=compile_cfg
    )
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        valid = (y != IGNORE_INDEX).sum()
        return loss_fn(model(x, attention_masks=masks), y, valid)[0]

    return Side("torchtitan", model, loss, flops, _autocast(device, precision))
