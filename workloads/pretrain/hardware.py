"""Hardware facts the trainer needs: dense peak TFLOP/s by device and dtype (the MFU denominator).

Stdlib only. llmctl's cost estimator reads the same table for its MFU prior, so MFU logged by a
run and the throughput assumed before it ran share one source.
"""

from __future__ import annotations

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


def peak_for(name: str, dtype: str) -> Optional[float]:
    """Peak TFLOP/s of one device called ``name`` (a CUDA device name or a catalog name) in ``dtype``."""
    for key, bf16, fp32 in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return bf16 if dtype == "bf16" else fp32
    return None
