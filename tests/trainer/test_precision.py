"""One bf16 recipe at every world size: FSDP2's bf16 parameters over fp32 shards, gradients reduced
in fp32, no autocast on top; one process gets it on a 1-rank mesh (``train.init_distributed``).

Built with the trainer's own ``init_distributed`` and ``init_sharded`` in this process (one gloo
rank, torn down after each test, so later tests may start their own process groups)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch


def build(cfg):
    from workloads.pretrain.train import init_distributed, init_sharded

    env = init_distributed(cfg)
    torch.manual_seed(0)
    return env, init_sharded(cfg, env)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_one_process_trains_on_fsdp_parameters_without_autocast(one_process, make_tiny_cfg, dtype):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from workloads.pretrain.parallel.parallelize import autocast_context

    cfg = make_tiny_cfg(**{"train.dtype": dtype})
    env, model = build(cfg)
    assert env.mesh is not None and env.mesh.size() == 1 and env.world_size == 1
    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.layers.values())
    assert autocast_context(model, cfg, "cpu") is nullcontext  # nothing stacked on FSDP's policy

    seen = {}
    attention = model.layers["0"].attention

    def record(module, args):
        x, cos, sin = args[:3]
        seen.update(x=x.dtype, cos=cos.dtype, sin=sin.dtype, weight=module.wq.weight.dtype)

    attention.register_forward_pre_hook(record)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32))
    model(tokens, tokens).backward()
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    # the residual stream and the gathered weights in the compute dtype; RoPE tables stay fp32
    assert seen == {"x": compute, "cos": torch.float32, "sin": torch.float32, "weight": compute}, seen
    for name, p in model.named_parameters():  # fp32 master shards and fp32 (reduced) gradients
        assert isinstance(p, DTensor) and p.dtype == torch.float32 and p.grad.dtype == torch.float32, name


def test_bf16_loss_is_close_to_fp32(one_process, make_tiny_cfg):
    """Same weights, same batch: the bf16 recipe's first loss within 1% of fp32's."""
    losses = {}
    tokens = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(1))
    for dtype in ("fp32", "bf16"):
        _, model = build(make_tiny_cfg(**{"train.dtype": dtype}))
        with torch.no_grad():
            losses[dtype] = model(tokens, tokens).item()
    assert abs(losses["bf16"] - losses["fp32"]) <= 0.01 * losses["fp32"], losses
