"""QLoRA's frozen base in 4-bit NF4 (``model.lora.quantize_base=nf4``): torchao's ``NF4Tensor``.

NF4 (Dettmers et al. 2023) stores each weight as one of 16 normal-distribution quantiles, 64
weights sharing an absmax scale, the scales themselves quantized to 8 bits in groups of 256
("double quantization"): about 0.53 bytes per weight instead of 2 (bf16) or 4 (fp32). Only the
target linears' weights are stored so; embedding, norms and LM head stay as they are (frozen too).

Why torchao and not bitsandbytes: torchao's ``NF4Tensor`` is a tensor subclass in plain PyTorch
that runs on CPU and CUDA alike and implements FSDP2's all-gather extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), so FSDP shards and gathers the 4-bit bytes
themselves, and a 1-process CPU test exercises the same path as an 8-GPU job. bitsandbytes'
``Linear4bit`` is a CUDA kernel library with its own module and parameter classes: no CPU path
for the trainer's tests and no FSDP2 integration (its FSDP story is FSDP1's flat parameters).

The matmul dequantizes the weight to the input's dtype and multiplies (``linear_nf4``: F.linear
on an NF4 weight dispatches there); the tensor's own dtype is the compute dtype (bf16 on CUDA),
so dequantization writes bf16 directly. The tensor is quantized whole, then split by FSDP along
dim 0: every shard then carries the whole tensor's scale statistics (the double quantization's
mean), which FSDP's all-gather reassembles into exactly the tensor quantized in one process.
Hence the layout is fixed before the values exist: ``placeholder`` makes an NF4 tensor of the
right shape on meta for ``fully_shard``, and ``fill`` quantizes the real weights into it.
"""

from __future__ import annotations

import torch
from torch import nn

from workloads.pretrain.contract.shape import NF4_BLOCK, NF4_SCALER_BLOCK

INSTALL = "pip install 'llmctl[qlora]' (torchao)"


def _torchao():
    """torchao's NF4 module (its path moved in 0.14: ``torchao.dtypes.nf4tensor`` before)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        try:
            from torchao.dtypes import nf4tensor as nf4_tensor  # type: ignore[no-redef]
        except ImportError as exc:
            from workloads.pretrain.contract.validate import ConfigError

            raise ConfigError(
                f"Bad value for 'model.lora.quantize_base': nf4 needs torchao, which is not importable ({exc})."
                f" Fix: {INSTALL}, or model.lora.quantize_base=none"
            ) from None
    return nf4_tensor


def to_nf4(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (2-D, on any device, meta included) quantized to an NF4Tensor of ``dtype``."""
    return _torchao().to_nf4(weight.detach().to(dtype).contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK)


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a DTensor's local part) is stored in NF4."""
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == "NF4Tensor"


def placeholder(linear: nn.Linear, dtype: torch.dtype, shard: bool) -> None:
    """Store ``linear``'s frozen weight as NF4 of ``dtype`` (on meta: the layout only; on a real
    device: its values quantized).

    ``shard`` (FSDP shards over more than one rank): a frozen parameter, which FSDP splits and
    gathers as 4-bit bytes. Else a non-persistent buffer, which FSDP leaves alone: torch's FSDP2
    skips the all-gather extension on a 1-rank shard group (it copies only the first of NF4's
    three inner tensors and then fails), and one rank has nothing to shard anyway. Either way the
    base is outside the checkpoint's state (it is re-read from ``init_from``). Plain weights only:
    under tensor parallelism the weight is a DTensor, and NF4 inside one is refused (``validate``)."""
    weight = linear.weight
    if hasattr(weight, "device_mesh"):
        raise NotImplementedError("NF4 base weights under tensor parallelism (refused by validate)")
    quantized = to_nf4(weight, dtype)
    if shard:
        linear.weight = nn.Parameter(quantized, requires_grad=False)
    else:
        del linear._parameters["weight"]
        linear.register_buffer("weight", quantized, persistent=False)


def linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(FQN, module) of every linear whose weight is stored in NF4."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and is_nf4(m.weight)]


def device(linear: nn.Linear) -> torch.device:
    """Where ``linear``'s (NF4) weight lives."""
    return getattr(linear.weight, "_local_tensor", linear.weight).device


@torch.no_grad()
def fill(linear: nn.Linear, full: torch.Tensor) -> None:
    """Quantize ``full`` (the whole weight, any float dtype) into ``linear``'s NF4 weight, keeping
    this rank's rows where FSDP shards it.

    A sharded parameter is replaced (``load_state_dict(assign=True)``): FSDP2 registers a hook
    there that re-reads a replaced parameter, which in-place copies cannot do for NF4's unsharded
    parts (its scale mean and lookup table stay on meta after ``to_empty``)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    weight = linear.weight
    quantized = to_nf4(full.to(device(linear)), weight.dtype)
    if "weight" in linear._buffers:
        linear.weight = quantized
        return
    if isinstance(weight, DTensor):  # FSDP's Shard(0) over the dp mesh (even: ``validate``)
        shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        rows = shape[0]
        part = quantized.split(rows)[offset[0] // rows] if rows < weight.shape[0] else quantized
        quantized = DTensor.from_local(
            part, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape, stride=weight.stride()
        )
    linear.load_state_dict({"weight": nn.Parameter(quantized, requires_grad=False)}, strict=False, assign=True)


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """An NF4 weight (or a DTensor of one) back in its dtype: what the matmul multiplies by."""
    full = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
    return full.get_original_weight()
