"""Hardware facts the trainer needs: dense peak TFLOP/s by device and dtype (the MFU denominator).

Stdlib only. llmctl's cost estimator reads the same table for its MFU prior, so MFU logged by a
run and the throughput assumed before it ran share one source.
"""

from __future__ import annotations

import os
from typing import Optional

# (device-name substring, dense bf16 TFLOP/s, fp32 non-tensor-core TFLOP/s). First match wins,
# so more specific names come first ("H100 PCIe" before "H100", "L40S" before "L40" before "L4").
PEAK_TFLOPS: list[tuple[str, float, float]] = [
    ("GH200", 989.0, 67.0),
    ("H200", 989.0, 67.0),
    ("H100 PCIe", 756.0, 51.0),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.0, 67.0),  # SXM (reported as "NVIDIA H100 80GB HBM3"; SkyPilot: H100, RunPod: H100-SXM)
    ("H800", 989.0, 67.0),
    ("B200", 2250.0, 80.0),
    ("A100", 312.0, 19.5),
    ("A800", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 30.3),
    ("A10G", 125.0, 31.2),
    ("A10", 125.0, 31.2),
    ("RTX 4090", 165.0, 82.6),
    ("RTX 3090", 71.0, 35.6),
]


def cpu_cores() -> int:
    """Cores this process may run on: its affinity mask (a container's or a Slurm job's share),
    which ``os.cpu_count()`` (the whole host) overstates."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_threads(local_world: int) -> int:
    """Intra-op threads for one of ``local_world`` processes sharing this machine's CPUs.

    An explicit ``OMP_NUM_THREADS`` wins, as in any PyTorch program: concurrent sweep trials and a
    parallel test suite set it to split the cores, and two jobs that each took every core would thrash.
    Without it each process takes its share of the cores it may run on.
    """
    explicit = os.environ.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    return max(1, cpu_cores() // local_world)


def peak_for(name: str, dtype: str) -> Optional[float]:
    """Peak TFLOP/s of one device called ``name`` (a CUDA device name or a catalog name) in ``dtype``."""
    for key, bf16, fp32 in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return bf16 if dtype == "bf16" else fp32
    return None


# CUDA compute capability by device-name substring, matched like PEAK_TFLOPS after dropping case,
# spaces and dashes (so catalog "RTX6000-Ada" and device "NVIDIA RTX 6000 Ada" both match). FP8
# tensor cores (torch._scaled_mm) need >= 8.9: Ada, Hopper, Blackwell. First match wins.
COMPUTE_CAPABILITY: list[tuple[str, tuple[int, int]]] = [
    ("GB200", (10, 0)),
    ("B200", (10, 0)),
    ("B100", (10, 0)),
    ("GH200", (9, 0)),
    ("H200", (9, 0)),
    ("H100", (9, 0)),
    ("H800", (9, 0)),
    ("H20", (9, 0)),
    ("L40S", (8, 9)),
    ("L40", (8, 9)),
    ("L4", (8, 9)),
    ("RTX4090", (8, 9)),
    ("RTX6000Ada", (8, 9)),
    ("A100", (8, 0)),
    ("A800", (8, 0)),
    ("A10G", (8, 6)),
    ("A10", (8, 6)),
    ("A40", (8, 6)),
    ("A6000", (8, 6)),
    ("RTX3090", (8, 6)),
    ("T4", (7, 5)),
    ("V100", (7, 0)),
    ("P100", (6, 0)),
    ("K80", (3, 7)),
]
FP8_MIN_CAPABILITY = (8, 9)
FP8_EXAMPLES = "compute capability >= 8.9: H100, H200, B200, L40S, L4..."


def _squash(name: str) -> str:
    return "".join(c for c in name.lower() if c not in " -_")


def capability_for(name: str) -> Optional[tuple[int, int]]:
    """Compute capability of a device called ``name`` (CUDA or catalog name); None if unknown."""
    for key, cc in COMPUTE_CAPABILITY:
        if _squash(key) in _squash(name):
            return cc
    return None


def fp8_refusal(recipe: str, target: Optional[str], capability: Optional[tuple[int, int]]) -> Optional[str]:
    """Why ``train.fp8=recipe`` cannot run on ``target`` (None: CPU), or None when it can or when
    the capability is unknown (the trainer checks the real device when it starts)."""
    if recipe == "none":
        return None
    if target is None:
        return (
            f"train.fp8={recipe} needs an FP8 GPU ({FP8_EXAMPLES}); this run targets CPU (no CUDA device). "
            f"Fix: train.fp8=none"
        )
    if capability is not None and tuple(capability) < FP8_MIN_CAPABILITY:
        return (
            f"train.fp8={recipe} needs an FP8 GPU ({FP8_EXAMPLES}); this run targets {target} (compute "
            f"capability {capability[0]}.{capability[1]}). Fix: train.fp8=none, or an FP8 GPU "
            f"(e.g. infra.accelerators=H100:8)"
        )
    return None
