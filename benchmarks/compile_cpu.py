"""What ``model.compile=true`` costs before it pays: the first training step (forward + backward)
of a 2-layer smoke model (conf/model/smoke.yaml shape, batch 16 x seq 128, fp32, fused kernels,
1 thread) eager and with ``apply_compile`` (per-block ``torch.compile``, the trainer's), then the
fastest of 5 more steps of each. Decides ``model.compile``'s default (docs/config.md): compile
time is paid at every start and resume, so a default must earn it back on the device it runs on.
"""

from __future__ import annotations

import os
import time

# a cold start, as on a fresh node: Inductor's on-disk caches would hide most of the compile time
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch

from workloads.pretrain.model.transformer import apply_compile, build_model
from workloads.protocol.schema import ModelCfg

STEPS = 6


def step_times(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        model(x, y).backward()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = ModelCfg(n_layers=2)
    x, y = (torch.randint(0, cfg.vocab_size, (16, 128)) for _ in range(2))
    eager = step_times(build_model(cfg), x, y)
    compiled_model = build_model(cfg)
    apply_compile(compiled_model)
    compiled = step_times(compiled_model, x, y)
    print(f"eager: first step {eager[0]:.2f} s, then {min(eager[1:]):.3f} s/step")
    print(f"compiled: first step {compiled[0]:.2f} s, then {min(compiled[1:]):.3f} s/step (torch {torch.__version__})")
    print(f"compile_cpu: {compiled[0] - eager[0]:.1f} s")


if __name__ == "__main__":
    main()
