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

Under tensor parallelism the weight cannot be a DTensor of NF4 (DTensor's matmul rules run on the
inner tensors, which NF4 does not implement), so a TP target becomes ``TensorParallelNF4Linear``:
a plain NF4 buffer of what this rank multiplies by, and a forward that does locally what TP's
DTensor linear would, in TP's layouts. A colwise target (wq wk wv w1 w3, rows split) keeps its
rows of the whole tensor's quantization (the same row split FSDP uses: exact). A rowwise target
(wo w2, input columns split) keeps the whole NF4 weight and multiplies by its columns: NF4's
scale groups run along rows, so a column shard of the one-process quantization does not exist,
and quantizing the shard alone would compute another model at each TP degree. That costs 0.53
bytes per weight of wo and w2 on every TP rank (the memory plan counts it) and buys a QLoRA run
that computes the same at tp 1, 2 or 8, resumes across layouts and exports one merge.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from workloads.protocol.quiet_loggers import quiet_loggers
from workloads.protocol.shape import NF4_BLOCK, NF4_SCALER_BLOCK

INSTALL = "pip install 'llmctl-train[qlora]' (torchao)"


def _torchao():
    """torchao's NF4 module (its path moved in 0.14: ``torchao.dtypes.nf4tensor`` before). Its import
    logs a warning for each CUDA extension this machine cannot load (MX-FP8, Hopper CUTLASS: kernels NF4
    does not use) and torch one per enum torchao registers: said while importing, they are held back."""
    try:
        with quiet_loggers(("torchao", "torch.utils._pytree"), logging.ERROR):
            from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        try:
            from torchao.dtypes import nf4tensor as nf4_tensor  # type: ignore[no-redef]
        except ImportError as exc:
            from workloads.protocol.validate import ConfigError

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
    base is outside the checkpoint's state (it is re-read from ``init_from``). A weight TP has
    made a DTensor becomes ``TensorParallelNF4Linear``'s buffer (``validate`` keeps FSDP from
    sharding it: ``parallel.dp_shard=1`` with TP)."""
    weight = linear.weight
    if hasattr(weight, "device_mesh"):
        TensorParallelNF4Linear.convert(linear, dtype)
        return
    quantized = to_nf4(weight, dtype)
    if shard:
        linear.weight = nn.Parameter(quantized, requires_grad=False)
    else:
        _set_buffer(linear, quantized)


def _set_buffer(linear: nn.Linear, quantized: torch.Tensor) -> None:
    """``linear.weight`` as a non-persistent buffer holding ``quantized``."""
    del linear._parameters["weight"]
    linear.register_buffer("weight", quantized, persistent=False)


def _own_copy(part: torch.Tensor) -> torch.Tensor:
    """An NF4 row split (a view into the whole tensor's storage) copied into storage of its own, so
    the whole tensor can be freed. torchao's ``clone`` re-quantizes the piece, changing its scale
    statistics; copying the inner tensors keeps the values exact."""
    names, meta = part.__tensor_flatten__()
    return type(part).__tensor_unflatten__({k: getattr(part, k).clone() for k in names}, meta, None, None)


class _ColumnsOfNF4(torch.autograd.Function):
    """``x @ W[:, start:stop].T`` for an NF4 ``W``, saving only ``W`` (dequantized again in
    backward, as torchao's ``linear_nf4`` does for a whole weight): no full-precision copy of the
    frozen weight lives from forward to backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        ctx.weight, ctx.columns = weight, (start, stop)
        return torch.nn.functional.linear(x, weight.get_original_weight()[:, start:stop])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, stop = ctx.columns
        return grad @ ctx.weight.get_original_weight()[:, start:stop], None, None, None


class TensorParallelNF4Linear(nn.Linear):
    """A TP-sharded QLoRA target (module docstring): ``weight`` a plain NF4 buffer (colwise: this
    rank's rows; rowwise: the whole weight, of which this rank multiplies ``nf4_columns``), the
    forward in TP's layouts: a Replicate input gives a Shard(-1) output (colwise), a Shard(-1)
    input a Partial output (rowwise), which TP's own hooks then redistribute. ``nf4_shape``: the
    whole weight's shape; ``nf4_placements``: TP's placements of the weight it replaces (LoRA lays
    its adapters out by them, ``lora.add_adapters``)."""

    nf4_mesh: object
    nf4_placements: tuple
    nf4_shape: torch.Size
    nf4_columns: tuple[int, int] | None

    @classmethod
    def convert(cls, linear: nn.Linear, dtype: torch.dtype) -> None:
        """Swap ``linear``'s DTensor weight (TP's Shard(0) or Shard(1) on a 1-D tp mesh) for an NF4
        buffer of the layout above (values on meta until ``fill``)."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        weight = linear.weight
        mesh, placements = weight.device_mesh, tuple(weight.placements)
        rowwise = any(getattr(p, "dim", None) in (1, -1) for p in placements)
        shape, offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
        stored = tuple(weight.shape) if rowwise else tuple(shape)
        _set_buffer(linear, to_nf4(torch.empty(stored, device=weight.device), dtype))
        linear.__class__ = cls
        linear.nf4_mesh, linear.nf4_placements, linear.nf4_shape = mesh, placements, weight.shape
        linear.nf4_columns = (offset[1], offset[1] + shape[1]) if rowwise else None

    def local_part(self, quantized: torch.Tensor) -> torch.Tensor:
        """This rank's stored part of ``quantized`` (the whole weight in NF4): all of it (rowwise),
        or its rows in storage of their own (colwise)."""
        if self.nf4_columns is not None:
            return quantized
        rows = self.weight.shape[0]
        return _own_copy(quantized.split(rows)[self.nf4_mesh.get_local_rank()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Shard

        if self.nf4_columns is None:  # the input's gradient is this rank's share of the whole
            local = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x
            out, placement = torch.nn.functional.linear(local, self.weight), Shard(x.ndim - 1)
        else:
            local = x.to_local() if isinstance(x, DTensor) else x
            out, placement = _ColumnsOfNF4.apply(local, self.weight, *self.nf4_columns), Partial()
        # the whole output's shape follows: TP splits rows evenly (``validate``)
        result = DTensor.from_local(out, self.nf4_mesh, [placement], run_check=False)
        return result if self.bias is None else result + self.bias


def full_shape(linear: nn.Linear) -> torch.Size:
    """The whole weight's shape of an NF4 linear (whatever this rank stores of it)."""
    return getattr(linear, "nf4_shape", None) or linear.weight.shape


def linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(FQN, module) of every linear whose weight is stored in NF4."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and is_nf4(m.weight)]


def device(linear: nn.Linear) -> torch.device:
    """Where ``linear``'s (NF4) weight lives."""
    return getattr(linear.weight, "_local_tensor", linear.weight).device


@torch.no_grad()
def fill(linear: nn.Linear, full: torch.Tensor) -> None:
    """Quantize ``full`` (the whole weight, any float dtype) into ``linear``'s NF4 weight, keeping
    this rank's rows where FSDP or (colwise) TP shards it.

    A sharded parameter is replaced (``load_state_dict(assign=True)``): FSDP2 registers a hook
    there that re-reads a replaced parameter, which in-place copies cannot do for NF4's unsharded
    parts (its scale mean and lookup table stay on meta after ``to_empty``)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    weight = linear.weight
    quantized = to_nf4(full.to(device(linear)), weight.dtype)
    if isinstance(linear, TensorParallelNF4Linear):
        quantized = linear.local_part(quantized)
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
