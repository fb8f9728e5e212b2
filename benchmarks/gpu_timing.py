"""Timing training steps on one GPU, shared by the GPU benchmarks: warm up, then alternate the
contenders window by window (so clock, thermal and neighbour drift hits each alike) and keep the
median tokens/s of each, plus the transient memory a step adds on top of what stays resident.

Used by benchmarks/gpu_fp8.py (``warm_up`` and ``alternate``) and benchmarks/gpu_vs_torchtitan.py
(``warm_up``; its sides run one after the other, since two 1B models with AdamW state do not both
fit beside each other comfortably, and it reports each side's whole peak over its timed steps).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def warm_up(name: str, step: Callable[[], torch.Tensor], steps: int, device: torch.device, tag: str) -> float:
    """``steps`` untimed steps (compilation included); returns the last loss."""
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize(device)
    print(f"{tag} | {name}: warmup (incl. compile) {time.perf_counter() - t0:.1f}s, loss {float(loss):.3f}", flush=True)
    return float(loss)


def alternate(
    steps_by_name: dict[str, Callable[[], torch.Tensor]],
    tokens_per_step: int,
    rounds: int,
    steps: int,
    device: torch.device,
) -> dict[str, dict[str, float]]:
    """``rounds`` windows of ``steps`` steps per contender, taken in turn (ABAB...).

    Per contender: ``tok_s`` (median over windows), ``windows`` (all of them) and ``step_peak_gib``
    (the most a step allocated above what was allocated when its window began, in GiB)."""
    rates: dict[str, list[float]] = {n: [] for n in steps_by_name}
    peaks: dict[str, float] = {n: 0.0 for n in steps_by_name}
    for _ in range(rounds):
        for name, step in steps_by_name.items():
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize(device)
            rates[name].append(steps * tokens_per_step / (time.perf_counter() - t0))
            peaks[name] = max(peaks[name], (torch.cuda.max_memory_allocated(device) - base) / 2**30)
    return {n: {"tok_s": statistics.median(r), "windows": r, "step_peak_gib": peaks[n]} for n, r in rates.items()}
