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


def init_rule(name: str, n_layers: int) -> tuple[str, float]:
    """How a Llama-style parameter starts: N(0, 0.02); residual-branch outputs (wo, w2) scaled by
    1/sqrt(2 L) (GPT-2); norms at 1; biases at 0."""
    if name.endswith(".bias"):
        return "zeros", 0.0
    if name.endswith("norm.weight"):
        return "ones", 0.0
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        return "normal", 0.02 / math.sqrt(2 * n_layers)
    return "normal", 0.02


@torch.no_grad()
def init_parameters(model: torch.nn.Module, seed: int, n_layers: int) -> None:
    """Initialise every parameter of ``model`` (plain or DTensor) by ``init_rule``, layout-independently."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for fqn, param in model.named_parameters():  # a tied weight once
        name = canonical_name(fqn)
        local = param.to_local() if isinstance(param, DTensor) else param
        kind, std = init_rule(name, n_layers)
        if kind != "normal":
            local.fill_(1.0 if kind == "ones" else 0.0)
            continue
        gen = torch.Generator(device=local.device).manual_seed(param_seed(seed, name))
        full = torch.empty(param.shape, dtype=torch.float32, device=local.device).normal_(0.0, std, generator=gen)
        if isinstance(param, DTensor):
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            full = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        local.copy_(full)
        del full
