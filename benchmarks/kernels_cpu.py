"""Fused vs reference kernel path: training tokens/s on CPU, from one run.

Model: conf/model/smoke.yaml (4 x 128, vocab 4096); batch 16 x seq 128 (conf/train/default.yaml),
fp32, ONE intra-op thread (``KERNELS_CPU_THREADS`` to change). Why one: these 2 cores are shared,
and when another process holds a core, every 2-thread OpenMP region waits for the descheduled
thread: a 2048x352 elementwise mul measured 0.9 ms on 1 thread vs 12 ms on 2, a matmul 61 vs
7.5 GFLOP/s. With 2 threads the figure measures the neighbours' load, not the kernels.

One timed unit is a real training step, as ``workloads/pretrain/train.py`` runs it: forward +
loss, backward, grad-norm clip, fused AdamW step, zero_grad. Both models start from the same weights and see the same (random) batch.

Timing: warmup steps excluded (both paths); then ``ROUNDS`` rounds, each timing ``STEPS`` step(s)
of one path and then the other, alternating which goes first, so load from other processes on
these shared cores falls on both. tokens/s per path is the median over rounds; the ratio is the
median of the per-round ratios (paired, so a noisy round cancels out).

``model.compile`` is off on both paths: the fused path is eager PyTorch (SDPA, F.rms_norm,
complex-multiply RoPE, chunked fused linear-CE with CPU-sized chunks), so the figure needs no
Inductor build (~30 s per block here) and is what ``model.kernels=fused`` gives by default.

Run: ``python benchmarks/kernels_cpu.py``. Last line: ``kernels_cpu: <fused/reference>x``.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from workloads.pretrain.model import build_model  # noqa: E402
from workloads.pretrain.optim import build_optimizer  # noqa: E402
from workloads.pretrain.shape import num_params  # noqa: E402

BATCH, SEQ_LEN = 16, 128
WARMUP, ROUNDS, STEPS = 3, 15, 2
THREADS = int(os.environ.get("KERNELS_CPU_THREADS", "1"))


def model_cfg(kernels: str):
    from omegaconf import OmegaConf

    from workloads.pretrain.schema import ModelCfg

    cfg = OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(REPO / "conf/model/smoke.yaml"))
    cfg.kernels = kernels
    return cfg


def train_cfg():
    from omegaconf import OmegaConf

    from workloads.pretrain.schema import TrainCfg

    return OmegaConf.merge(OmegaConf.structured(TrainCfg), OmegaConf.load(REPO / "conf/train/default.yaml"))


class Path_:
    """One kernel path: its model, optimizer and a ``steps(n)`` that returns seconds taken."""

    def __init__(self, kernels: str, x: torch.Tensor, y: torch.Tensor):
        torch.manual_seed(0)
        self.name = kernels
        self.model = build_model(model_cfg(kernels))
        tc = train_cfg()
        self.opt = build_optimizer(self.model, tc)
        self.clip = float(tc.grad_clip) if tc.grad_clip else math.inf
        self.x, self.y = x, y
        self.tok_s: list[float] = []

    def step(self) -> float:
        loss = self.model(self.x, self.y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def timed(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        tok_s = n * BATCH * SEQ_LEN / (time.perf_counter() - t0)
        self.tok_s.append(tok_s)
        return tok_s


def main() -> int:
    torch.set_num_threads(THREADS)
    cfg = model_cfg("fused")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ_LEN + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref, fused = Path_("reference", x, y), Path_("fused", x, y)
    n_params = num_params(cfg)
    print(f"kernels_cpu | model smoke ({n_params / 1e6:.2f}M params, {cfg.n_layers}x{cfg.dim}, vocab {cfg.vocab_size}) "
          f"| batch {BATCH} x seq {SEQ_LEN} fp32 | torch {torch.__version__}, {torch.get_num_threads()} thread(s) "
          f"| compile off | {WARMUP} warmup + {ROUNDS} rounds x {STEPS} steps per path", flush=True)

    l_ref, l_fused = ref.step(), fused.step()  # first step: same weights, same batch -> same loss
    print(f"kernels_cpu | step-1 loss reference {l_ref:.6f} fused {l_fused:.6f}", flush=True)
    for _ in range(WARMUP - 1):
        ref.step(), fused.step()

    ratios = []
    for r in range(ROUNDS):
        order = (ref, fused) if r % 2 == 0 else (fused, ref)
        for p in order:
            p.timed(STEPS)
        ratios.append(fused.tok_s[-1] / ref.tok_s[-1])
        print(f"kernels_cpu | round {r + 1}: reference {ref.tok_s[-1]:,.0f} tok/s, fused {fused.tok_s[-1]:,.0f} "
              f"tok/s, ratio {ratios[-1]:.3f}", flush=True)

    med_ref, med_fused = statistics.median(ref.tok_s), statistics.median(fused.tok_s)
    print(f"reference: {med_ref:,.0f} tok/s (median)")
    print(f"fused:     {med_fused:,.0f} tok/s (median, eager, no compile)")
    print(f"kernels_cpu: {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
