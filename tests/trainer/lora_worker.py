"""Run under torchrun by test_lora.py (and in its own process for the 1-process reference): for
each job, load a Hugging Face checkpoint with LoRA / QLoRA through ``model.init_from`` into this
layout (the trainer's own code path), give every B a nonzero value (so the adapters matter), run
one forward and backward of one batch and write the loss and the adapters' full gradients (rank 0)."""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist


def set_b(model: torch.nn.Module, scale: float = 0.05) -> None:
    """Every ``lora_b`` to values drawn from its own name (the same at any layout): each rank
    keeps its slice of the whole matrix."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from workloads.pretrain.model.init_weights import canonical_name

    with torch.no_grad():
        for fqn, param in model.named_parameters():
            name = canonical_name(fqn)
            if not name.endswith("lora_b.weight"):
                continue
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = torch.randn(param.shape, generator=gen) * scale
            if isinstance(param, DTensor):
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
                param.to_local().copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
            else:
                param.copy_(full)


def loss_and_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dims) -> dict:
    """One forward and backward: the mean loss and {adapter name: full gradient} (every rank
    takes part in gathering them; non-adapters must have no gradient)."""
    from workloads.pretrain.model.init_weights import canonical_name
    from workloads.pretrain.model.lora import is_adapter
    from workloads.pretrain.parallel.parallelize import local_loss, loss_context

    with loss_context(dims)():
        loss = local_loss(model(x, y))
        loss.backward()
    grads = {}
    for fqn, param in model.named_parameters():
        name = canonical_name(fqn)
        if not is_adapter(name):
            assert param.grad is None and not param.requires_grad, name
            continue
        grad = param.grad
        grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return {"loss": loss.detach(), "grads": grads}


def run_job(overrides: list[str], x: torch.Tensor, y: torch.Tensor) -> dict:
    from workloads.pretrain.train import init_distributed, load_pretrained
    from workloads.protocol.config import load

    cfg = load(None, overrides)
    env = init_distributed(cfg)
    model = load_pretrained(cfg, env)
    set_b(model)
    return loss_and_grads(model, x, y, env.dims)


def main(batch: str, jobs: str, overrides: list[str]) -> None:
    x, y = torch.load(batch)
    for job in json.loads(Path(jobs).read_text()):
        out = run_job(overrides + job["overrides"], x, y)
        if dist.get_rank() == 0:
            torch.save(out, job["out"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
