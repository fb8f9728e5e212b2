"""Initial weights that do not depend on the layout, materialised one parameter at a time.

Each parameter is drawn from its own generator, seeded by (run seed, parameter name), so its
values are the same whether it lives whole in one process or sharded by FSDP, TP or both: every
rank draws the full parameter, keeps the slice it owns (``compute_local_shape_and_global_offset``,
which covers Shard, Replicate and FSDP-over-TP's strided shards) and frees the rest before the
next parameter. Peak memory per rank is its shards plus the largest single parameter (one layer's
worth, or the embedding), never the model. Costs every rank a full draw of every parameter
(slow on CPU for the largest models; use ``model.init_from`` or a checkpoint for those).

DTensor's own random ops would shard the draw, but they need CUDA (``OffsetBasedRNGTracker``)
and in-place init on a CPU ``Shard(0)`` DTensor repeats the same values on every shard
(tried on torch's CPU DTensor).
"""

from __future__ import annotations

import math
import zlib
from typing import Callable

import torch

# wrapper modules put these in parameter names; the seed must not depend on them
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(fqn: str) -> str:
    for w in _WRAPPERS:
        fqn = fqn.replace(w, "")
    return fqn


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed per (run seed, parameter name)."""
    return ((int(seed) & 0xFFFFFFFF) << 31 ^ zlib.crc32(name.encode())) & (2**63 - 1)


def init_rule(name: str, n_layers: int, shape: tuple[int, ...] = ()) -> tuple[str, float]:
    """How a Llama-style parameter starts: N(0, 0.02); residual-branch outputs (wo, w2) scaled by
    1/sqrt(2 L) (GPT-2); norms at 1; biases at 0. LoRA's adapters (``lora.py``) as PEFT starts
    them: A uniform in +-1/sqrt(in) (``kaiming_uniform_(a=sqrt(5))``, ``shape`` [rank, in]), B at 0."""
    if name.endswith("lora_b.weight"):
        return "zeros", 0.0
    if name.endswith("lora_a.weight"):
        return "uniform", 1.0 / math.sqrt(shape[-1])
    if name.endswith(".bias"):
        return "zeros", 0.0
    if name.endswith("norm.weight"):
        return "ones", 0.0
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        return "normal", 0.02 / math.sqrt(2 * n_layers)
    return "normal", 0.02


@torch.no_grad()
def init_parameters(
    model: torch.nn.Module, seed: int, n_layers: int, only: Callable[[str], bool] | None = None
) -> None:
    """Initialise every parameter of ``model`` (plain or DTensor) by ``init_rule``, layout-independently.

    ``only``: those whose name it accepts (LoRA's adapters after a checkpoint's base is loaded).
    A QLoRA base stored in NF4 (``nf4.py``, a parameter or a buffer) is drawn whole, then quantized."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from workloads.pretrain.model import nf4

    for fqn, param in model.named_parameters():  # a tied weight once
        name = canonical_name(fqn)
        if (only is not None and not only(name)) or nf4.is_nf4(param):
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        kind, std = init_rule(name, n_layers, tuple(param.shape))
        if kind in ("ones", "zeros"):
            local.fill_(1.0 if kind == "ones" else 0.0)
            continue
        full = initial_value(name, tuple(param.shape), seed, n_layers, local.device)
        if isinstance(param, DTensor):
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            full = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        local.copy_(full)
        del full
    for fqn, linear in nf4.linears(model):
        name = canonical_name(f"{fqn}.weight")
        if only is None or only(name):
            nf4.fill(linear, initial_value(name, tuple(nf4.full_shape(linear)), seed, n_layers, nf4.device(linear)))


def initial_value(name: str, shape: tuple[int, ...], seed: int, n_layers: int, device: torch.device) -> torch.Tensor:
    """The whole of parameter ``name`` as ``init_rule`` draws it from its (seed, name) generator, fp32."""
    kind, std = init_rule(name, n_layers, shape)
    if kind in ("ones", "zeros"):
        return torch.full(shape, 1.0 if kind == "ones" else 0.0, device=device)
    gen = torch.Generator(device=device).manual_seed(param_seed(seed, name))
    full = torch.empty(shape, dtype=torch.float32, device=device)
    if kind == "uniform":
        return full.uniform_(-std, std, generator=gen)
    return full.normal_(0.0, std, generator=gen)
