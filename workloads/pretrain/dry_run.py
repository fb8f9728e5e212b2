"""A full-size dry run on any machine: the real model, parallelised for the target world size, on
``meta`` with torch's fake process group (collectives are no-ops, this process plays rank 0).

What it proves before anyone pays: the layout is valid for the model (TP divides the heads, the
mesh builds, FSDP2 shards every parameter) and how many parameters and bytes each rank holds.
No weights are materialised: 70B at world 64 takes about a second and a few hundred MB.
``llmctl plan --dry-run`` runs ``python -m workloads.pretrain.dry_run --world-size N --config
run.yaml`` (a process of its own: llmctl imports only the protocol and the planner) and prints its JSON
beside the memory plan.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import Any, Optional, Sequence


def sharded_params(cfg: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """Parameters per rank of ``cfg``'s model at ``world_size`` processes, built the trainer's way
    (``Transformer`` on meta -> ``parallelize``: TP -> AC -> FSDP2). ``cfg``: the trainer's typed
    config, or a plain mapping of sections (``config.typed``, schema defaults for what is missing)."""
    import torch
    from torch.distributed.tensor import DTensor

    from workloads.pretrain.model.transformer import Transformer
    from workloads.pretrain.parallel.fake_world import fake_process_group
    from workloads.pretrain.parallel.parallelize import ParallelDims, parallelize
    from workloads.protocol.config import typed

    t0 = time.perf_counter()
    cfg = typed(cfg)
    dims = ParallelDims.from_config(cfg, world_size)
    with fake_process_group(world_size):
        mesh = dims.build_mesh("cpu")  # 1-rank for one process, as the trainer builds it
        with torch.device("meta"):
            model = Transformer(cfg.model)
        model = parallelize(model, dims, mesh, cfg)
        params = list(model.parameters())
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
        total = sum(p.numel() for p in params)
        wq = model.layers["0"].attention.wq.weight
        placements = [str(p) for p in wq.placements] if isinstance(wq, DTensor) else []
    return {
        "world_size": world_size,
        "layout": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp},
        "params_total": total,
        "params_per_rank": local,
        "param_bytes_per_rank": 4 * local,
        "wq_placements": placements,
        "seconds": time.perf_counter() - t0,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    from workloads.protocol.config import parse_args
    from workloads.protocol.validate import ConfigError

    parser = argparse.ArgumentParser(prog="python -m workloads.pretrain.dry_run", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, required=True, help="processes the job will run")
    try:
        args, cfg = parse_args(parser, argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(sharded_params(cfg, args.world_size)))
    return 0


if __name__ == "__main__":
    from workloads.protocol.process_exit import exit_process

    exit_process(main())
