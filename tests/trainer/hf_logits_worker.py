"""Run under torchrun by test_hf_init.py: for each checkpoint, load it through ``model.init_from``
into this layout (the trainer's own code path), then write the full logits and the loss of one
batch (rank 0) for the test to compare with transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from workloads.pretrain.parallel.parallelize import local_loss, loss_context
from workloads.pretrain.train import init_distributed, load_pretrained
from workloads.protocol.config import load


def main(batch: str, jobs: str, overrides: list[str]) -> None:
    x, y = torch.load(batch)
    env = None
    for job in json.loads(Path(jobs).read_text()):
        cfg = load(None, overrides + [f"model.init_from={job['init_from']}"])
        env = init_distributed(cfg)
        model = load_pretrained(cfg, env)
        with torch.no_grad(), loss_context(env.dims)():
            logits = model(x)
            loss = local_loss(model(x, y))
        if hasattr(logits, "full_tensor"):  # TP: vocab-sharded
            logits = logits.full_tensor()
        if env.is_main:
            torch.save({"logits": logits, "loss": loss}, job["out"])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
