"""LoRA adapters (Hu et al. 2021) on the trainer's Transformer (``model.lora.*``).

Each target linear (``model.lora.targets``: wq wk wv wo w1 w2 w3) keeps its frozen ``weight`` under
its own name and gains two children, ``lora_a`` (in -> rank) and ``lora_b`` (rank -> out), so
their FQNs are ``layers.N.attention.wq.lora_a.weight`` and ``...lora_b.weight``: checkpoints,
``init_from`` and TP plans still address the base by name. The forward is PEFT's:
``base(x) + lora_b(lora_a(dropout(x))) * alpha / rank``. Everything else (embedding, norms, LM
head, biases, the linears without adapters) is frozen; only adapters get gradients and optimizer
state.

Applied by ``parallelize`` after tensor parallelism and before AC, compile and FSDP, by swapping
the module's class for a LoRA subclass of it (as torchtitan's LoRA converter does): TP's input
and output hooks stay on the module, so the adapters see what the base sees. Under TP the
adapters are DTensors on the tp mesh laid out so no extra communication is needed: a colwise base
(weight Shard(0), input replicated) gets A replicated and B Shard(0), its output sharded like the
base's; a rowwise base (Shard(1), input sharded on features) gets A Shard(1), whose partial sums
B (replicated) carries into the base's own reduction.

Initialised as PEFT does (``init_weights.init_rule``): A ``kaiming_uniform_(a=sqrt(5))``, i.e.
U(-1/sqrt(in), 1/sqrt(in)), B zero, so step 0 computes exactly the base model.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from workloads.protocol.schema import LoraCfg

ADAPTERS = ("lora_a", "lora_b")


def is_adapter(fqn: str) -> bool:
    """Whether parameter ``fqn`` (any wrapper prefixes) belongs to an adapter: the trained part."""
    return any(part in ADAPTERS for part in fqn.split("."))


def lora_scaling(cfg: LoraCfg) -> float:
    """What the adapters' output is multiplied by: ``alpha / rank`` (PEFT's ``scaling``)."""
    return float(cfg.alpha) / int(cfg.rank)


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``base + scaling * b @ a``: the plain weight that computes what base and adapters compute
    together (``a``: [rank, in], ``b``: [out, rank]), in fp32, returned in ``base``'s dtype. For
    merged exports and for checking the adapters' effect."""
    merged = base.float() + scaling * (b.float() @ a.float())
    return merged.to(base.dtype)


class LoRAMixin:
    """The adapter forward, mixed in front of the base linear's class (``nn.Linear`` or a subclass
    of it; its own forward computes the base, NF4 included); ``add_adapters`` makes the combined class."""

    lora_a: nn.Linear
    lora_b: nn.Linear
    lora_dropout: nn.Module
    lora_scaling: float
    lora_enabled = True  # False inside ``adapters_off``: the base alone (DPO's reference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = super().forward(x)
        if not self.lora_enabled:
            return base
        return base + self.lora_b(self.lora_a(self.lora_dropout(x))) * self.lora_scaling


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The model computes its frozen base alone while inside: DPO's reference under LoRA, as PEFT's
    ``disable_adapter`` gives TRL, without a second copy of the weights."""
    adapted = [m for m in model.modules() if isinstance(m, LoRAMixin)]
    for m in adapted:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in adapted:
            del m.lora_enabled  # back to the class's True


_CLASSES: dict[type, type] = {}


def _lora_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"LoRA{base.__name__}", (LoRAMixin, base), {})
    return _CLASSES[base]


def _adapter_weight(rows: int, cols: int, device: torch.device, mesh, shard_dim: int | None) -> nn.Parameter:
    """An empty adapter matrix on ``device``, a DTensor on ``mesh`` (the base's TP mesh) when there
    is one (``shard_dim``: None replicated, else Shard(shard_dim)); dtype fp32 like the trainer's
    master weights whatever the base's storage (NF4 included)."""
    empty = torch.empty(rows, cols, device=device, dtype=torch.float32)
    if mesh is None:
        return nn.Parameter(empty)
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placement = Replicate() if shard_dim is None else Shard(shard_dim)
    return nn.Parameter(distribute_tensor(empty, mesh, [placement] * mesh.ndim, src_data_rank=None))


def add_adapters(linear: nn.Linear, cfg: LoraCfg) -> None:
    """Give ``linear`` its ``lora_a`` / ``lora_b`` (empty: ``init_weights`` or ``init_adapters``
    fills them) and the LoRA forward, in place. The layout follows the base weight's TP placements
    (a QLoRA base under TP keeps them beside its NF4 buffer: ``nf4.TensorParallelNF4Linear``)."""
    rank = int(cfg.rank)
    weight = linear.weight
    placements = getattr(linear, "nf4_placements", None) or getattr(weight, "placements", ())
    mesh = getattr(linear, "nf4_mesh", None) or getattr(weight, "device_mesh", None)
    rowwise = any(getattr(p, "dim", None) in (1, -1) for p in placements)  # Shard(1): features split
    colwise = any(getattr(p, "dim", None) == 0 for p in placements)
    a = nn.Linear(linear.in_features, rank, bias=False, device="meta")
    b = nn.Linear(rank, linear.out_features, bias=False, device="meta")
    a.weight = _adapter_weight(rank, linear.in_features, weight.device, mesh, 1 if rowwise else None)
    b.weight = _adapter_weight(linear.out_features, rank, weight.device, mesh, 0 if colwise else None)
    linear.__class__ = _lora_class(type(linear))
    linear.lora_a, linear.lora_b = a, b
    linear.lora_dropout = nn.Dropout(float(cfg.dropout)) if cfg.dropout else nn.Identity()
    linear.lora_scaling = lora_scaling(cfg)


def targets(model: nn.Module, cfg: LoraCfg) -> list[tuple[str, nn.Linear]]:
    """(FQN, module) of every linear that gets adapters: inside a block, named in ``cfg.targets``."""
    wanted = set(cfg.targets)
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("layers.") and name.rsplit(".", 1)[-1] in wanted
    ]


def apply(model: nn.Module, cfg: LoraCfg, compute_dtype: torch.dtype = torch.float32, shard_base: bool = False) -> None:
    """Freeze every parameter, then add adapters to the target linears (``add_adapters``). With
    ``model.lora.quantize_base=nf4`` the targets' frozen weights become NF4 of ``compute_dtype``,
    sharded by FSDP when ``shard_base`` (``nf4.placeholder``); the rest of the frozen base is held
    in ``compute_dtype`` (``hold_frozen_in``). Call on the meta-built model after TP, before FSDP; on
    a materialised model the adapters are initialised here too (seed 0)."""
    from workloads.pretrain.model import nf4

    for param in model.parameters():
        param.requires_grad_(False)
    found = targets(model, cfg)
    if cfg.quantize_base == "nf4":
        for _, linear in found:
            nf4.placeholder(linear, compute_dtype, shard_base)
    hold_frozen_in(model, compute_dtype)
    for _, linear in found:
        add_adapters(linear, cfg)
    if found and found[0][1].lora_a.weight.device.type != "meta":
        init_adapters(model, seed=0)


@torch.no_grad()
def hold_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every frozen parameter that is not NF4 in ``dtype`` (the compute dtype), in place.

    Why: a weight that never changes needs no fp32 master. FSDP2 gathers bf16 copies of fp32 shards
    for bf16 compute, so a frozen base held in bf16 computes with exactly the values it did, in
    half the memory (PEFT, torchtune and NeMo hold a frozen base in bf16 likewise); FSDP2 asks only
    the parameters that train to share one dtype. The adapters, added after, keep fp32 masters. A
    weight tied to another (tied embeddings) stays one parameter. Nothing to do for fp32 compute."""
    from workloads.pretrain.model import nf4

    held: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.requires_grad or param.dtype == dtype or nf4.is_nf4(param):
                continue
            if id(param) not in held:
                held[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
            module._parameters[name] = held[id(param)]


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's initial adapters (A uniform in +-1/sqrt(in), B zero), each from its (seed, name)
    generator like every other parameter (``init_weights.init_parameters``): the same values at
    any layout. For a model whose base was loaded rather than initialised (``model.init_from``)."""
    from workloads.pretrain.model.init_weights import init_parameters

    init_parameters(model, seed, n_layers=1, only=is_adapter)


def trainable_parameters(model: nn.Module) -> int:
    """Parameters that train (global sizes): the adapters' with LoRA, every one without."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def describe(model: nn.Module, cfg: LoraCfg) -> str:
    """The run header's LoRA line: rank, scaling, targets and what trains of how much."""
    from workloads.pretrain.model import nf4

    trainable = trainable_parameters(model)
    total = sum(p.numel() for p in model.parameters() if not nf4.is_nf4(p))
    total += sum(nf4.full_shape(m).numel() for _, m in nf4.linears(model))  # NF4 buffers and parameters
    base = " in NF4 (QLoRA)" if cfg.quantize_base == "nf4" else ""
    return (
        f"pretrain | lora rank {cfg.rank}, alpha {cfg.alpha:g} (x{lora_scaling(cfg):g}), dropout {cfg.dropout:g} on"
        f" {','.join(cfg.targets)}: {trainable:,} trainable of {total:,} params ({trainable / total:.2%}),"
        f" frozen base{base}"
    )
