"""FP8 (torchao float8, ``train.fp8``) vs bf16 in llmctl's trainer on one GPU: Llama-3.2-1B shape, seq 4096.

Each contender is built by the trainer's own code (``train.init_sharded``: meta -> ``parallelize``,
which converts to Float8Linear and compiles each block -> materialise -> init) from
conf/model/1b.yaml with ``model.kernels=fused``, ``model.compile=true``, ``train.dtype=bf16`` and
``train.fp8`` = none | tensorwise | rowwise, and runs the trainer's step: FSDP2 bf16 parameters on a 1-rank mesh, loss,
backward, grad-norm clip 1.0, the trainer's AdamW, the FP8 post-step hook, zero_grad.

Two models at a time (bf16 stays, each FP8 recipe is built, measured and freed in turn), so three
1B models with AdamW state never share the device: after ``WARMUP`` steps each (compilation
included), ``ROUNDS`` windows of ``STEPS`` steps alternate between bf16 and the FP8 recipe
(``gpu_timing.alternate``); tokens/s is the median over windows, the ratio is against the bf16
windows of the same alternation. TFLOP/s and MFU use FLOPs/token = 6N + 12·L·H·Q·T and the
**bf16** dense peak (workloads/planner/hardware.py), as torchtitan reports FP8 MFU, so FP8's MFU
can be read as "fraction of the bf16 roofline". Memory, in GiB: what the contender keeps resident
(weights, AdamW state) plus the most one timed step adds (the peak is reset after warm-up, so build
and compile buffers do not count).

Needs a GPU with FP8 tensor cores (compute capability >= 8.9) and ``pip install 'llmctl-train[fp8]'``.
Without CUDA it prints why and exits 0. ``GPU_BENCH_BATCH`` changes the batch (default 2).

Run: ``python benchmarks/gpu_fp8.py``. Last line: ``gpu_fp8: <best FP8 / bf16 tokens/s>x``.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SEQ_LEN = 4096
BATCH = int(os.environ.get("GPU_BENCH_BATCH", "2"))
WARMUP, ROUNDS, STEPS = 4, 6, 5
TAG = "gpu_fp8"


def config(recipe: str):
    from omegaconf import OmegaConf

    from workloads.protocol.schema import TrainerCfg

    cfg = OmegaConf.structured(TrainerCfg)
    cfg.model = OmegaConf.merge(cfg.model, OmegaConf.load(REPO / "conf/model/1b.yaml"))
    merged = OmegaConf.merge(
        cfg,
        OmegaConf.from_dotlist(
            [
                "model.kernels=fused",
                "model.compile=true",
                "train.dtype=bf16",
                f"train.fp8={recipe}",
                f"train.seq_len={SEQ_LEN}",
                f"train.batch_size={BATCH}",
                "train.lr=3e-4",
            ]
        ),
    )
    return OmegaConf.to_object(merged)  # the trainer's typed config, as config.load returns it


class Contender:
    """One model + optimizer built and stepped the way the trainer does it."""

    def __init__(self, recipe: str, device: torch.device, x: torch.Tensor, y: torch.Tensor):
        from workloads.pretrain.components.optim import build_optimizer
        from workloads.pretrain.parallel import fp8
        from workloads.pretrain.parallel.parallelize import autocast_context
        from workloads.pretrain.train import init_distributed, init_sharded

        self.recipe, self.cfg = recipe, config(recipe)
        fp8.check_device(recipe, device)  # the trainer's refusal: no FP8 tensor cores, or no torchao
        before = torch.cuda.memory_allocated(device)
        env = init_distributed(self.cfg)  # the trainer's 1-rank group and mesh: its FSDP bf16 recipe
        torch.manual_seed(0)
        self.model = init_sharded(self.cfg, env)
        self.autocast = autocast_context(self.model, self.cfg, device.type)  # none under FSDP, as in train.py
        self.fsdp_fp8 = env.dims.dp_enabled
        self.opt = build_optimizer(self.model, self.cfg.train)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.x, self.y, self.device, self.fp8 = x, y, device, fp8
        self.converted = sum(type(m).__name__ == "Float8Linear" for m in self.model.modules())
        warm = __import__("gpu_timing").warm_up(recipe, self.step, WARMUP, device, TAG)
        self.resident_gib = (torch.cuda.memory_allocated(device) - before) / 2**30
        self.warm_loss = warm

    def step(self) -> torch.Tensor:
        with self.autocast():
            loss = self.model(self.x, self.y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.fp8.after_optimizer_step(self.model, self.recipe, fsdp=self.fsdp_fp8)
        self.opt.zero_grad(set_to_none=True)
        return loss

    def free(self) -> None:
        del self.model, self.opt, self.params
        gc.collect()
        torch.cuda.empty_cache()


def main() -> int:
    if not torch.cuda.is_available():
        print(
            f"{TAG} | no CUDA device available (torch.cuda.is_available() is False): this benchmark needs one "
            "FP8 GPU (H100, H200, L40S, L4...); nothing was measured"
        )
        print(f"{TAG}: skipped (no CUDA device)")
        return 0
    from gpu_timing import alternate

    from workloads.pretrain.components.metrics import peak_tflops
    from workloads.protocol.shape import flops_per_token

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops(device, "bf16")
    flops = flops_per_token(config("none").model, SEQ_LEN)
    print(
        f"{TAG} | {name} (cc {'.'.join(map(str, torch.cuda.get_device_capability(device)))}) | torch "
        f"{torch.__version__} | Llama-3.2-1B shape, batch {BATCH} x seq {SEQ_LEN}, FSDP bf16 params, per-block "
        f"compile | FLOPs/token {flops / 1e9:.2f} G | bf16 peak {peak or 'unknown'} TFLOP/s",
        flush=True,
    )
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, 128256, (BATCH, SEQ_LEN + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    bf16 = Contender("none", device, x, y)
    results, bf16_windows, ratios = {}, [], {}
    for recipe in ("tensorwise", "rowwise"):
        try:
            other = Contender(recipe, device, x, y)
        except Exception as e:  # report and go on: the other recipe's figures are still useful
            traceback.print_exc()
            print(f"{TAG} | {recipe}: failed ({type(e).__name__}: {e})", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            continue
        pair = alternate({"bf16": bf16.step, recipe: other.step}, BATCH * SEQ_LEN, ROUNDS, STEPS, device)
        bf16_windows += pair["bf16"]["windows"]
        results.setdefault("bf16", {**pair["bf16"], "resident_gib": bf16.resident_gib, "linears": bf16.converted})
        results["bf16"]["step_peak_gib"] = max(results["bf16"]["step_peak_gib"], pair["bf16"]["step_peak_gib"])
        results[recipe] = {**pair[recipe], "resident_gib": other.resident_gib, "linears": other.converted}
        ratios[recipe] = pair[recipe]["tok_s"] / pair["bf16"]["tok_s"]
        other.free()
    if "bf16" in results:
        import statistics

        results["bf16"]["tok_s"] = statistics.median(bf16_windows)
    for side, r in results.items():
        tflops = r["tok_s"] * flops / 1e12
        mfu = f"{100 * tflops / peak:.1f}%" if peak else "n/a (unknown peak)"
        vs = f" | {ratios[side]:.2f}x bf16 (same alternation)" if side in ratios else ""
        print(
            f"{side:>10}: {r['tok_s']:,.0f} tok/s | {tflops:.1f} TFLOP/s | MFU {mfu} (of bf16 peak) | peak mem "
            f"{r['resident_gib'] + r['step_peak_gib']:.1f} GiB (resident {r['resident_gib']:.1f} + step "
            f"{r['step_peak_gib']:.1f}, timed steps only) | {r['linears']} Float8Linear{vs}"
        )
    if not ratios:
        print(f"{TAG}: failed (no FP8 recipe ran)")
        return 1
    best = max(ratios, key=ratios.get)
    print(f"{TAG} | best FP8 recipe: {best} (done-when: >= 1.3x bf16)")
    print(f"{TAG}: {ratios[best]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
