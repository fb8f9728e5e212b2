"""A plain torchrun DDP training loop (gloo on CPU), as users write them: no llmctl import. Logs its
loss with ``mlflow.log_metric`` from rank 0 into the active run (``MLFLOW_RUN_ID``), and checks the
ranks really are one process group (the gradients are averaged: the replicas stay equal).

    torchrun --nproc_per_node 2 ddp.py [--steps 5]
"""

from __future__ import annotations

import argparse
import os

import mlflow
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(rank)  # each rank its own data
for step in range(1, args.steps + 1):
    x = torch.randn(16, 8, generator=gen)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        mlflow.log_metric("ddp/loss", loss.item(), step=step)
weights = model.module.weight.detach().clone()
gathered = [torch.zeros_like(weights) for _ in range(world)]
dist.all_gather(gathered, weights)
if rank == 0:
    same = all(torch.equal(gathered[0], w) for w in gathered)
    attempt = os.environ.get("LLMCTL_ATTEMPT")
    print(f"program | {world} ranks, replicas equal: {same}, LLMCTL_ATTEMPT={attempt}", flush=True)
dist.destroy_process_group()
