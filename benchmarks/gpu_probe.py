"""What the GPU machine is, before anything is measured on it: one ``key: value`` per line.

    python benchmarks/gpu_probe.py

The first step of ``gpu_agenda.sh A``, so that every later figure can be read against the card,
the software and the kernels that produced it:

- versions of Python, torch (its CUDA and cuDNN), triton and the packages the agenda carries as
  wheels (omegaconf, liger-kernel, torchao, torchtitan) or expects there (pytest, xdist,
  transformers), read from package metadata (no import);
- whether what the trainer and the benchmarks import does import: omegaconf, Liger's fused
  linear-CE, ``torchao.float8``, ``torchtitan.models.llama3`` (through ``titan_sides``' shim for
  torch < 2.13);
- with CUDA: the card, its compute capability, multiprocessors and free/total memory
  (``mem_get_info``); the SDPA kernel torch picks (``torch._fused_sdp_choice``) for each attention
  shape the agenda runs, since on torch 2.11 with cuDNN > 9.15 on Hopper that is cuDNN rather than
  flash, which decides what selective AC must save; and the bf16 matmul ceiling (8192^3, CUDA
  events), the roof that MFU figures are read against.

Every probe catches its own failure and prints it, so one broken package never hides the rest.
Without CUDA the device probes are skipped and the rest runs. Last line:
``gpu_probe: <card> | bf16 matmul <X> TFLOP/s | SDPA 1b causal <backend>`` (or ``no CUDA``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import subprocess
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

PACKAGES = (
    "torch",
    "triton",
    "omegaconf",
    "antlr4-python3-runtime",
    "liger-kernel",
    "torchao",
    "torchtitan",
    "transformers",
    "pytest",
    "pytest-xdist",
)
# What must import for each agenda step: (label, module, attribute or None).
IMPORTS = (
    ("omegaconf", "omegaconf", "OmegaConf"),
    ("liger_flce", "liger_kernel.transformers.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyLoss"),
    ("torchao_float8", "torchao.float8", "convert_to_float8_training"),
    ("torchtitan_llama3", "torchtitan.models.llama3", "model_registry"),
)
# Attention shapes of the agenda: (label, dtype, head_dim, heads, kv_heads, seq, masked).
SDPA_SHAPES = (
    ("1b causal", "bf16", 64, 32, 32, 4096, False),
    ("1b causal gqa", "bf16", 64, 32, 8, 4096, False),
    ("8b causal", "bf16", 128, 32, 32, 4096, False),
    ("1b additive mask", "bf16", 64, 32, 32, 4096, True),
    ("gpu test fp32 causal", "fp32", 32, 8, 8, 512, False),
)


def say(key: str, value: object) -> None:
    print(f"{key}: {value}", flush=True)


def probe(key: str, fn) -> object:
    """``fn()``'s value printed under ``key``; its error (type and message) instead if it fails."""
    try:
        value = fn()
    except Exception as e:  # report and go on: the next probe is still worth having
        value = None
        say(key, f"FAILED {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        if not isinstance(e, ImportError):
            traceback.print_exc(limit=3)
        return None
    say(key, value)
    return value


def versions() -> None:
    say("python", f"{platform.python_version()} ({sys.executable})")
    for name in PACKAGES:
        probe(f"version {name}", lambda n=name: importlib.metadata.version(n))


def imports() -> None:
    import titan_sides

    titan_sides.titan_import_shim()  # a no-op on torch >= 2.13

    def load(module: str, attr: str | None) -> str:
        mod = importlib.import_module(module)
        if attr is not None:
            getattr(mod, attr)
        return f"ok ({getattr(mod, '__file__', '?')})"

    for label, module, attr in IMPORTS:
        probe(f"import {label}", lambda m=module, a=attr: load(m, a))


def sdpa_backend(torch, dtype: str, head_dim: int, heads: int, kv_heads: int, seq: int, masked: bool) -> str:
    from torch.nn.attention import SDPBackend

    names = {int(v): k for k, v in SDPBackend.__members__.items()}
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    q = torch.randn(1, heads, seq, head_dim, device="cuda", dtype=dt)
    k = torch.randn(1, kv_heads, seq, head_dim, device="cuda", dtype=dt)
    mask = torch.zeros(1, 1, seq, seq, device="cuda", dtype=dt) if masked else None
    gqa = kv_heads != heads
    choice = torch._fused_sdp_choice(q, k, k, attn_mask=mask, is_causal=not masked, enable_gqa=gqa)
    return names.get(int(choice), str(choice))


def matmul_tflops(torch, n: int = 8192, warmup: int = 3, reps: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(warmup):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return round(2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12, 1)


def nvidia_smi() -> str:
    fields = "name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.limit"
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return (out.stdout or out.stderr).strip()


def main() -> int:
    versions()
    import torch

    say("torch cuda", torch.version.cuda)
    probe("cudnn", lambda: torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    imports()
    cuda = torch.cuda.is_available()
    say("cuda available", cuda)
    if not cuda:
        print("gpu_probe: no CUDA (versions and imports only)")
        return 0
    probe("nvidia-smi", nvidia_smi)
    props = torch.cuda.get_device_properties(0)
    say("device", f"{props.name} | cc {props.major}.{props.minor} | {props.multi_processor_count} SMs")
    free, total = torch.cuda.mem_get_info()
    say("memory free/total GiB", f"{free / 2**30:.2f} / {total / 2**30:.2f}")
    backends = {}
    for label, *shape in SDPA_SHAPES:
        backends[label] = probe(f"sdpa {label}", lambda s=shape: sdpa_backend(torch, *s))
    tflops = probe("bf16 matmul 8192^3 TFLOP/s", lambda: matmul_tflops(torch))
    torch.cuda.empty_cache()
    print(f"gpu_probe: {props.name} | bf16 matmul {tflops} TFLOP/s | SDPA 1b causal {backends.get('1b causal')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
