"""Selective AC's save list (``parallelize.sac_save_ops``): torch's own compute-intensive ops plus the
kernels that list lacks, so no GPU attention or FP8 kernel is recomputed in the backward.

The list is checked by name because a CPU never runs the CUDA kernels: on an H100 with torch 2.11's
cuDNN, SDPA runs ``_scaled_dot_product_cudnn_attention``, and a compiled FP8 matmul is
``_scaled_mm`` with ``aten.max`` for its scales; a list without them recomputes attention (or the
FP8 matmuls) in every block's backward, silently."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from workloads.pretrain.parallel.parallelize import sac_policy, sac_save_ops

aten = torch.ops.aten


@pytest.mark.parametrize(
    "op",
    [
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._flash_attention_forward.default,
        aten._efficient_attention_forward.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    ],
    ids=lambda op: str(op).split(".")[1],
)
def test_every_sdpa_kernel_is_saved(op) -> None:
    assert op in sac_save_ops()
    assert sac_policy(None, op) == CheckpointPolicy.MUST_SAVE


@pytest.mark.parametrize("op", [aten._scaled_mm.default, aten.max.default, aten.mm.default], ids=str)
def test_fp8_and_plain_matmuls_are_saved(op) -> None:
    """``_scaled_mm`` is the compiled FP8 matmul, ``aten.max`` its amax (a whole-tensor reduction)."""
    assert op in sac_save_ops()


def test_the_list_contains_torchs_compute_intensive_ops() -> None:
    """Built from ``get_default_op_list`` (as torchtitan builds its list), so a kernel torch adds
    there is saved without an edit here."""
    from torch._functorch.partitioners import get_default_op_list

    assert {op.default for op in get_default_op_list().compute_intensive_ops} <= sac_save_ops()


def test_tp_collectives_are_saved_and_cheap_ops_recomputed() -> None:
    assert torch.ops._c10d_functional.reduce_scatter_tensor.default in sac_save_ops()
    assert torch.ops._c10d_functional.all_gather_into_tensor.default in sac_save_ops()
    for op in (aten.add.Tensor, aten.mul.Tensor, aten.silu.default, aten.rsqrt.default):
        assert sac_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op
