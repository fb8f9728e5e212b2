"""LoRA and QLoRA training speed of llmctl's trainer on one GPU: Llama-3.2-1B and Llama-3.1-8B shapes.

    python benchmarks/gpu_lora.py

Each contender is built by the trainer's own code (``train.init_sharded``: meta -> ``parallelize``,
which adds the adapters (NF4 base for QLoRA) and compiles each block -> materialise -> random
init; no checkpoint is read, speed does not depend on the values) from conf/model/llama3.2-1b.yaml or
llama3.1-8b.yaml with ``model.lora.rank=16, alpha=32`` on all seven linears of every block
(``model.lora.quantize_base=nf4`` for QLoRA), ``train.dtype=bf16``, ``model.compile=true``, and
runs the trainer's step: loss, backward, grad-norm clip 1.0 over the adapters, AdamW on the
adapters, zero_grad. Batch 1 x seq 4096 (``GPU_LORA_BATCH`` / ``GPU_LORA_SEQ``); shapes by
``GPU_LORA_SHAPES`` (default ``1b,8b``). One contender at a time (built, warmed up, timed,
freed): an 8B LoRA and an 8B QLoRA model do not comfortably share one card.

FLOPs per token, as PEFT's peers count LoRA (a frozen weight has no weight-gradient GEMM): 4N for
the frozen base and LM head, plus 6 per adapter parameter, plus attention's 12·L·H·Q·T; MFU of
the card's bf16 dense peak (``workloads/planner/hardware.py``). Memory: the peak the
CUDA allocator saw over the timed steps. The anchor: NeMo AutoModel's Llama 3 8B LoRA on one H100,
12,473 tokens/s (its published performance summary); the 8B LoRA line says where llmctl stands.

``GPU_LORA_SHAPES=tiny``: a 2-layer model on CPU (fp32, eager) with both contenders, a few seconds,
so ``tests/benchmarks/test_gpu_agenda.py`` runs the script through ``gpu_agenda.sh D`` on a machine
without CUDA; its figures mean nothing. The other shapes without CUDA print why and exit 0.

Last line: ``gpu_lora: <8B LoRA tokens/s> tok/s 8b lora (<x> NeMo AutoModel's 12,473)``, or the
first shape's figures when 8b is not among the shapes.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TAG = "gpu_lora"
NEMO_8B_LORA_TOK_S = 12473.0  # NeMo AutoModel, Llama 3 8B LoRA, one H100
RANK, ALPHA = 16, 32
BATCH = int(os.environ.get("GPU_LORA_BATCH", "1"))
SEQ = int(os.environ.get("GPU_LORA_SEQ", "4096"))
WARMUP, WINDOWS, STEPS = 3, 5, 4
MODEL_FILES = {"1b": "llama3.2-1b", "8b": "llama3.1-8b"}
# CPU-only check of the script: NF4 needs whole 64 x 256 groups in every linear
TINY = ["dim=256", "n_layers=2", "n_heads=4", "n_kv_heads=2", "hidden_dim=512", "vocab_size=512", "max_seq_len=256"]


def config(shape: str, qlora: bool, cuda: bool):
    from omegaconf import OmegaConf

    from workloads.protocol.schema import TrainerCfg

    cfg = OmegaConf.structured(TrainerCfg)
    if shape == "tiny":
        model = [f"model.{kv}" for kv in TINY] + ["model.name=tiny"]
    else:
        cfg.model = OmegaConf.merge(cfg.model, OmegaConf.load(REPO / f"conf/model/{MODEL_FILES[shape]}.yaml"))
        model = []
    seq, batch = (64, 2) if shape == "tiny" else (SEQ, BATCH)
    dotlist = model + [
        "model.kernels=fused",
        f"model.compile={str(cuda).lower()}",
        f"model.lora.rank={RANK}",
        f"model.lora.alpha={ALPHA}",
        f"model.lora.quantize_base={'nf4' if qlora else 'none'}",
        f"train.dtype={'bf16' if cuda else 'fp32'}",
        f"train.seq_len={seq}",
        f"train.batch_size={batch}",
        "train.lr=2e-4",
    ]
    return OmegaConf.to_object(OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist)))


def lora_flops_per_token(model_cfg, seq_len: int) -> int:
    """4N (frozen: forward and input-gradient GEMMs only) + 6 per adapter parameter + attention:
    ``shape.flops_per_token`` counts a LoRA config so itself."""
    from workloads.protocol.shape import flops_per_token

    assert model_cfg.lora.rank, "a LoRA config (model.lora.rank > 0)"
    return flops_per_token(model_cfg, seq_len)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(shape: str, qlora: bool, device: torch.device) -> dict[str, float]:
    """Build one contender as the trainer does, warm it up, time it; tokens/s (median window), peak GiB."""
    from workloads.pretrain.components.optim import build_optimizer
    from workloads.pretrain.parallel.parallelize import autocast_context
    from workloads.pretrain.train import init_distributed, init_sharded

    cuda = device.type == "cuda"
    cfg = config(shape, qlora, cuda)
    env = init_distributed(cfg)
    torch.manual_seed(0)
    model = init_sharded(cfg, env)
    autocast = autocast_context(model, cfg, device.type)
    opt = build_optimizer(model, cfg.train)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
    tokens = tokens.to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> torch.Tensor:
        with autocast():
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    name = f"{shape} {'qlora' if qlora else 'lora'}"
    t0 = time.perf_counter()
    warmup, windows, steps = (1, 2, 1) if shape == "tiny" else (WARMUP, WINDOWS, STEPS)
    for _ in range(warmup):
        loss = step()
    _sync(device)
    took = time.perf_counter() - t0
    print(f"{TAG} | {name}: warmup (incl. compile) {took:.1f}s, loss {float(loss.detach()):.3f}", flush=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    rates = []
    for _ in range(windows):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        rates.append(steps * x.numel() / (time.perf_counter() - t0))
    out = {
        "tok_s": statistics.median(rates),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan"),
        "trainable": float(sum(p.numel() for p in params)),
        "flops": float(lora_flops_per_token(cfg.model, cfg.train.seq_len)),
    }
    return out  # the model, its optimizer and the step closure go with this frame (main frees the cache)


def main() -> int:
    shapes = [s for s in os.environ.get("GPU_LORA_SHAPES", "1b,8b").split(",") if s]
    unknown = [s for s in shapes if s not in (*MODEL_FILES, "tiny")]
    if unknown:
        sys.exit(f"GPU_LORA_SHAPES: unknown shape(s) {unknown}; choose from {sorted(MODEL_FILES)} or tiny")
    cuda = torch.cuda.is_available()
    if not cuda and shapes != ["tiny"]:
        print(f"{TAG} | no CUDA device available: the 1B/8B figures need one GPU (GPU_LORA_SHAPES=tiny checks on CPU)")
        print(f"{TAG}: skipped (no CUDA device)")
        return 0
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    peak = None
    if cuda:
        from workloads.pretrain.components.metrics import peak_tflops

        torch.cuda.set_device(device)
        peak = peak_tflops(device, "bf16")
        print(f"{TAG} | {torch.cuda.get_device_name(device)} | torch {torch.__version__} | bf16 peak {peak} TFLOP/s")
    run = f"batch {BATCH} x seq {SEQ}, bf16, per-block compile" if cuda else "tiny: batch 2 x seq 64, fp32, CPU, eager"
    print(f"{TAG} | {run} | LoRA rank {RANK}, alpha {ALPHA}, all 7 linears", flush=True)
    results: dict[str, dict[str, float]] = {}
    for shape in shapes:
        for qlora in (False, True):
            name = f"{shape} {'qlora' if qlora else 'lora'}"
            try:
                r = results[name] = measure(shape, qlora, device)
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            except Exception as e:  # report and go on: the other contenders' figures are still useful
                traceback.print_exc()
                print(f"{TAG} | {name}: failed ({type(e).__name__}: {e})", flush=True)
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                continue
            tflops = r["tok_s"] * r["flops"] / 1e12
            mfu = f"{100 * tflops / peak:.1f}%" if peak else "n/a"
            print(
                f"{TAG} | {name}: {r['tok_s']:,.0f} tok/s | {tflops:.1f} TFLOP/s | MFU {mfu} | peak mem "
                f"{r['peak_gib']:.1f} GiB | {r['trainable']:,.0f} trainable | {r['flops'] / 1e9:.2f} GFLOP/token",
                flush=True,
            )
        pair = [results.get(f"{shape} lora"), results.get(f"{shape} qlora")]
        if all(pair):
            print(f"{TAG} | {shape}: qlora / lora {pair[1]['tok_s'] / pair[0]['tok_s']:.2f}x tokens/s", flush=True)
    if not results:
        print(f"{TAG}: failed (no contender ran)")
        return 1
    if "8b lora" in results:
        tok_s = results["8b lora"]["tok_s"]
        print(f"{TAG}: {tok_s:,.0f} tok/s 8b lora ({tok_s / NEMO_8B_LORA_TOK_S:.2f}x NeMo AutoModel's 12,473)")
    else:
        first = next(iter(results))
        print(f"{TAG}: {results[first]['tok_s']:,.0f} tok/s {first}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
