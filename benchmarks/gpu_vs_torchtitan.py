"""llmctl's trainer vs torchtitan 0.3.0 on one GPU: Llama-3.2-1B shape, seq 4096, bf16.

Both sides run the same loop on the same random batch: bf16 autocast over fp32 weights (what
torchtitan's trainer does on one GPU, and what ``train.dtype=bf16`` does here), forward + loss,
backward, grad-norm clip 1.0, fused AdamW, zero_grad; blocks compiled one by one
(``torch.compile`` per TransformerBlock, as both trainers do), no activation checkpointing.

- llmctl: ``workloads.pretrain.model`` with conf/model/1b.yaml, ``model.kernels=fused`` (SDPA,
  chunked fused linear-CE, or Liger's when installed) and ``apply_compile``.
- torchtitan: ``torchtitan.models.llama3.model_registry("1B")`` (same shape: 16 x 2048, 32/8
  heads, FFN 8192, tied embeddings, vocab 128256), its default FlexAttention with a causal
  block mask, full-logit cross-entropy in fp32.

Figures per side: tokens/s (median of ``ROUNDS`` timed windows of ``STEPS`` steps, after
``WARMUP`` steps that include compilation), TFLOP/s and MFU with FLOPs/token = 6N + 12·L·H·Q·T
(N excludes the input embedding; the same count for both sides, same shape) against the peak in
``workloads/pretrain/metrics.py``, and peak allocated memory. Sides run one after the other,
each model freed before the next (two 1B models with AdamW state would not both fit comfortably).

Needs a CUDA GPU and ``pip install torchtitan==0.3.0`` (its import errors are reported, and the
llmctl side still runs). Without CUDA it prints why and exits 0.

Run: ``python benchmarks/gpu_vs_torchtitan.py``.
Last line: ``gpu_vs_torchtitan: <llmctl/torchtitan tokens/s>x`` (or ``... skipped (...)``).
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
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEQ_LEN = 4096
BATCH = int(os.environ.get("GPU_BENCH_BATCH", "2"))
WARMUP, ROUNDS, STEPS = 4, 5, 5
LR = 3e-4


def ours_model(device):
    from omegaconf import OmegaConf

    from workloads.pretrain.schema import ModelCfg
    from workloads.pretrain.model import apply_compile, build_model
    from workloads.pretrain.shape import flops_per_token

    cfg = OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(REPO / "conf/model/1b.yaml"))
    cfg.kernels = "fused"
    torch.manual_seed(0)
    model = build_model(cfg, device)
    flops = flops_per_token(cfg, SEQ_LEN)
    apply_compile(model)

    def loss_fn(x, y):
        return model(x, y)

    return model, loss_fn, flops


def torchtitan_model(device):
    import dataclasses

    from torchtitan.models.llama3 import model_registry

    spec = model_registry("1B")  # default attn_backend: FlexAttention, as torchtitan trains it
    cfg = spec.model
    for layer in cfg.layers:  # size the RoPE cache to the sequence, as its trainer does
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ_LEN)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=device)
    for block in model.layers.values():  # torchtitan.distributed.compile.apply_compile does this
        block.compile(fullgraph=True)
    positions = torch.arange(SEQ_LEN, device=device).expand(BATCH, SEQ_LEN)
    masks = model.get_attention_masks(positions=positions)

    def loss_fn(x, y):
        logits = model(x, attention_masks=masks)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    return model, loss_fn, None


def measure(name, build, device, x, y) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    model, loss_fn, flops = build(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for _ in range(WARMUP):
        loss = step()
    first_loss = float(loss)
    torch.cuda.synchronize(device)
    print(f"gpu_vs_torchtitan | {name}: warmup (incl. compile) {time.perf_counter() - t0:.1f}s, "
          f"loss {first_loss:.3f}", flush=True)
    rates = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(STEPS):
            loss = step()
        torch.cuda.synchronize(device)
        rates.append(STEPS * BATCH * SEQ_LEN / (time.perf_counter() - t0))
    out = {"tok_s": statistics.median(rates), "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9,
           "loss": float(loss), "flops": flops}
    del model, loss_fn, opt, params
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_vs_torchtitan | no CUDA device available (torch.cuda.is_available() is False): "
              "this benchmark needs one GPU; nothing was measured")
        print("gpu_vs_torchtitan: skipped (no CUDA device)")
        return 0

    from workloads.pretrain.metrics import peak_tflops

    device = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = True
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops(device, "bf16")
    print(f"gpu_vs_torchtitan | {name} | torch {torch.__version__} | Llama-3.2-1B shape, batch {BATCH} x seq "
          f"{SEQ_LEN}, bf16 autocast, per-block compile | peak {peak or 'unknown'} TFLOP/s bf16", flush=True)
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, 128256, (BATCH, SEQ_LEN + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    results = {}
    for side, build in (("llmctl", ours_model), ("torchtitan", torchtitan_model)):
        try:
            results[side] = measure(side, build, device, x, y)
        except ImportError as e:
            print(f"gpu_vs_torchtitan | {side}: import failed ({type(e).__name__}: {e}); "
                  f"install with: pip install torchtitan==0.3.0", flush=True)
        except Exception as e:  # report and go on: the other side's figures are still useful
            traceback.print_exc()
            print(f"gpu_vs_torchtitan | {side}: failed ({type(e).__name__}: {e})", flush=True)
            gc.collect()
            torch.cuda.empty_cache()

    flops = results.get("llmctl", {}).get("flops")
    if flops is None:  # llmctl side failed: count from a meta-built model (no memory)
        from omegaconf import OmegaConf

        from workloads.pretrain.schema import ModelCfg
        from workloads.pretrain.shape import flops_per_token

        cfg = OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(REPO / "conf/model/1b.yaml"))
        flops = flops_per_token(cfg, SEQ_LEN)
    print(f"gpu_vs_torchtitan | FLOPs/token {flops / 1e9:.2f} GFLOP (6N + 12*L*H*Q*T, same for both sides)")
    for side, r in results.items():
        tflops = r["tok_s"] * flops / 1e12
        mfu = f"{100 * tflops / peak:.1f}%" if peak else "n/a (unknown peak)"
        print(f"{side:>10}: {r['tok_s']:,.0f} tok/s | {tflops:.1f} TFLOP/s | MFU {mfu} | "
              f"peak mem {r['peak_gb']:.1f} GB | loss {r['loss']:.3f}")
    if "llmctl" in results and "torchtitan" in results:
        print(f"gpu_vs_torchtitan: {results['llmctl']['tok_s'] / results['torchtitan']['tok_s']:.2f}x")
        return 0
    missing = ", ".join(s for s in ("llmctl", "torchtitan") if s not in results)
    print(f"gpu_vs_torchtitan: failed ({missing} did not run)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
