"""Run under torchrun: build the trainer's model the trainer's way (``train.init_sharded``) and
report this rank's resident-memory high-water mark during the build, with the sizes it is held to.

Usage: torchrun --nproc_per_node=N init_memory_worker.py OUT_DIR key=value...
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(out_dir: str, overrides: list[str]) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    from workloads.pretrain.train import init_distributed, init_sharded
    from workloads.protocol.config import load

    cfg = load(None, overrides)
    env = init_distributed(cfg)
    small = load(None, [*overrides, "model.n_layers=1", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=4"])
    init_sharded(small, env)  # the first build imports and sets up code: not what is measured
    torch.manual_seed(0)
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    model = init_sharded(cfg, env)
    peak = _status("VmHWM")
    params = dict(model.named_parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in params.values())
    full = sum(p.numel() * 4 for p in params.values())
    layer = sum(p.numel() * 4 for n, p in params.items() if ".layers.0." in f".{n}" or n.startswith("layers.0."))
    largest = max(p.numel() * 4 for p in params.values())
    checksum = float(
        sum(
            float((p.full_tensor() if isinstance(p, DTensor) else p).detach().double().square().sum())
            for p in params.values()
        )
    )
    rank = int(os.environ.get("RANK", "0"))
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "before": before,
                "peak": peak,
                "local": local,
                "full": full,
                "layer": layer,
                "largest": largest,
                "checksum": checksum,
            }
        )
    )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
