"""A world of many ranks inside one process: torch's fake process group (collectives are no-ops,
this process plays rank 0). What lets a dry run and the memory oracle build the real model,
parallelised for a target world size, on any machine."""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def fake_process_group(world_size: int):
    """A fake process group of ``world_size`` ranks, this process rank 0, for the duration; one
    rank too, since the trainer builds a (1-rank) mesh for one process as well."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("tracked_peak needs its own fake process group: call it from a process that has none")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
