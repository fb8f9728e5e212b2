"""What a job runs on, as a plain value, and what this machine has (without importing torch).

Backends describe their hardware with ``Hardware`` when they plan; the cost estimate prices it and
tags runs with it (``llmctl.accelerator``), and never asks a backend. Peak FLOP/s per device are
the trainer's facts (``workloads.planner.hardware``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

from workloads.planner.hardware import cpu_cores


@dataclass(frozen=True)
class Hardware:
    """``accelerator`` is the tag value ("cpu", "H100:8": per node)."""

    accelerator: str
    gpu: Optional[str]  # catalog or device name; None on CPU
    gpus_per_node: int
    nodes: int
    cores_per_node: int = 1

    @property
    def devices(self) -> int:
        """Priced devices: GPUs, or one per CPU node."""
        return self.nodes * (self.gpus_per_node or 1)


def local_gpu_count() -> int:
    """GPUs torchrun would see here: ``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def local_gpu_name() -> Optional[str]:
    """``nvidia-smi``'s name of GPU 0 (e.g. "NVIDIA H100 80GB HBM3")."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()
    return first[0].strip() if first else None


def this_machine() -> Hardware:
    """Every local GPU, else this machine's CPU cores."""
    gpus = local_gpu_count()
    if gpus:
        name = local_gpu_name() or "GPU"
        return Hardware(f"{name}:{gpus}", name, gpus, 1)
    return Hardware("cpu", None, 0, 1, cpu_cores())
