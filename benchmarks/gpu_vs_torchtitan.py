"""llmctl's trainer vs torchtitan (``titan_sides.TORCHTITAN``) on one GPU, same shape, same step.

Shapes: (a) Llama-3.2-1B (conf/model/1b.yaml vs torchtitan's "1B"), batch ``GPU_BENCH_BATCH``
(default 2) x seq 4096; (b) Llama-3.1-8B width/heads/FFN/vocab (conf/model/8b.yaml vs "8B") cut
to ``GPU_BENCH_8B_LAYERS`` blocks (default 10, what fits 80 GB without activation
checkpointing), batch 1 x seq 4096. Sides are built in ``titan_sides`` (CPU-tested there).

Same step on both sides: bf16 compute over fp32 master weights, no activation checkpointing,
per-block ``torch.compile``, fwd + loss, bwd, grad-norm clip 1.0, fused AdamW, zero_grad, on the
same random batch. Precision (``GPU_BENCH_PRECISION``): ``fsdp`` (default; what torchtitan's
trainer does on one GPU: FSDP2 on a 1-rank mesh with a bf16/fp32 MixedPrecisionPolicy; llmctl's
side uses its own ``parallelize.apply_fsdp``) or ``autocast`` (bf16 autocast, what llmctl's
trainer does on one GPU) for both sides.

- llmctl: ``model.kernels=fused`` (SDPA flash attention, Liger's fused linear-CE when installed,
  else the chunked one) and per-block ``apply_compile``; ``GPU_BENCH_COMPILE_LOSS=1`` also
  compiles its LM head + CE function (off by default: not yet measured).
- torchtitan: its model config at the same depth, its attention ``GPU_BENCH_TT_ATTN`` (default
  ``flex``, torchtitan's default; also ``flex_flash``, ``varlen``, and ``sdpa`` = its
  ScaledDotProductAttention, cuDNN first), its per-block ``apply_compile`` (fullgraph), its
  ``ChunkedLossWrapper`` with the compiled CE, as its llama3 trainer configs with compile on.

Figures per side: tokens/s (median of ``ROUNDS`` windows of ``STEPS`` steps after ``WARMUP``
steps that include compilation), TFLOP/s and MFU from each side's own FLOPs/token count (6N +
12·L·H·Q·T; the two counts must agree, else the run stops) against the bf16 peak in
``workloads/pretrain/components/metrics.py``, and ``torch.cuda.max_memory_allocated`` in GiB over the
timed steps only (reset after warm-up, so build and compile buffers do not count). Sides run one after
the other, each freed before the next. A side that fails prints its error; the other still runs.

Needs a CUDA GPU and ``pip install -e ".[bench,gpu]"`` (torchtitan; Liger for llmctl's loss), or
on the offline GPU machine the wheels ``benchmarks/gpu_wheels.sh`` builds (``gpu_agenda.sh B``).
On torch < 2.13 both sides run ``autocast`` (``titan_sides.runnable_precision`` says why).
Without CUDA it prints why and exits 0.
Run: ``python benchmarks/gpu_vs_torchtitan.py``.
Last line: ``gpu_vs_torchtitan: <llmctl/torchtitan tokens/s on the 1B shape>x``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import titan_sides as ts
from gpu_timing import warm_up

sys.path.insert(0, str(ts.REPO))

SEQ_LEN = 4096
WARMUP, ROUNDS, STEPS = 4, 5, 5
LR = 3e-4
# set globally by torchtitan's apply_compile; restored so they do not leak into the next side
DYNAMO_FLAGS = {
    k: getattr(torch._dynamo.config, k)
    for k in ("capture_scalar_outputs", "skip_fwd_side_effects_in_bwd_under_checkpoint")
    if hasattr(torch._dynamo.config, k)
}


def settings() -> dict:
    """Environment knobs, checked before anything is built."""
    s = {
        "batch": _positive_int("GPU_BENCH_BATCH", "2"),
        "layers_8b": _positive_int("GPU_BENCH_8B_LAYERS", "10"),
        "precision": ts.runnable_precision(os.environ.get("GPU_BENCH_PRECISION", "fsdp")),
        "tt_attn": os.environ.get("GPU_BENCH_TT_ATTN", "flex"),
        "compile_loss": os.environ.get("GPU_BENCH_COMPILE_LOSS", "0") == "1",
        "shapes": os.environ.get("GPU_BENCH_SHAPES", "1b,8b").split(","),
    }
    ts.check_settings(s["precision"], s["tt_attn"])
    unknown = [n for n in s["shapes"] if n not in ts.SHAPES]
    if unknown:
        raise ValueError(f"GPU_BENCH_SHAPES: unknown {unknown}; use a comma list of {sorted(ts.SHAPES)}")
    return s


def _positive_int(key: str, default: str) -> int:
    raw = os.environ.get(key, default)
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{key} must be a positive integer, got {raw!r}")
    return int(raw)


def build(side: str, shape: str, batch: int, layers: int | None, s: dict, device) -> ts.Side:
    ours_name, flavor = ts.SHAPES[shape]
    torch.manual_seed(0)
    if side == "llmctl":
        return ts.ours_side(
            ts.ours_cfg(ours_name, layers), SEQ_LEN, device, precision=s["precision"], compile_loss=s["compile_loss"]
        )
    return ts.titan_side(
        ts.titan_config(flavor, layers, s["tt_attn"]), SEQ_LEN, batch, device, precision=s["precision"]
    )


def measure(side: ts.Side, device, x, y) -> dict:
    params = [p for p in side.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step():
        with side.autocast():
            loss = side.loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    warm_up(side.name, step, WARMUP, device, "gpu_vs_torchtitan")
    # The peak over the timed steps only: build, init and compile/autotune buffers are behind us.
    torch.cuda.synchronize(device)
    resident = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    rates = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(STEPS):
            loss = step()
        torch.cuda.synchronize(device)
        rates.append(STEPS * x.numel() / (time.perf_counter() - t0))
    return {
        "tok_s": statistics.median(rates),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "resident_gib": resident / 2**30,
        "loss": float(loss),
        "flops": side.flops_per_token,
    }


def run_shape(shape: str, s: dict, device, peak) -> dict:
    batch, layers = (s["batch"], None) if shape == "1b" else (1, s["layers_8b"])
    depth = "full depth" if layers is None else f"cut to {layers} layers"
    print(f"gpu_vs_torchtitan | shape {shape} ({depth}), batch {batch} x seq {SEQ_LEN}", flush=True)
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, 128256, (batch, SEQ_LEN + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    results = {}
    for name in ("llmctl", "torchtitan"):
        torch._dynamo.reset()  # no compiled graphs carried over from the side before
        for flag, value in DYNAMO_FLAGS.items():
            setattr(torch._dynamo.config, flag, value)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        try:
            side = build(name, shape, batch, layers, s, device)
            results[name] = measure(side, device, x, y)
        except ImportError as e:
            print(
                f"gpu_vs_torchtitan |   {name}: import failed ({type(e).__name__}: {e}); "
                f'install with: pip install -e ".[bench,gpu]"',
                flush=True,
            )
        except Exception as e:  # report and go on: the other side's figures are still useful
            traceback.print_exc()
            print(f"gpu_vs_torchtitan |   {name}: failed ({type(e).__name__}: {e})", flush=True)
        side = None
        gc.collect()
        torch.cuda.empty_cache()
    counts = {r["flops"] for r in results.values()}
    if len(counts) > 1:
        raise RuntimeError(f"FLOPs/token differ between sides ({results}): the shapes do not match")
    for name, r in results.items():
        tflops = r["tok_s"] * r["flops"] / 1e12
        mfu = f"{100 * tflops / peak:.1f}%" if peak else "n/a (unknown peak)"
        print(
            f"gpu_vs_torchtitan |   {shape} {name:>10}: {r['tok_s']:>9,.0f} tok/s | {tflops:6.1f} TFLOP/s | "
            f"MFU {mfu} | peak mem {r['peak_gib']:.1f} GiB over steps (resident {r['resident_gib']:.1f}) | "
            f"loss {r['loss']:.3f} | "
            f"{r['flops'] / 1e9:.2f} GFLOP/token",
            flush=True,
        )
    if len(results) == 2:
        print(
            f"gpu_vs_torchtitan |   {shape} llmctl/torchtitan: "
            f"{results['llmctl']['tok_s'] / results['torchtitan']['tok_s']:.2f}x",
            flush=True,
        )
    return results


def main() -> int:
    if not torch.cuda.is_available():
        print(
            "gpu_vs_torchtitan | no CUDA device available (torch.cuda.is_available() is False): "
            "this benchmark needs one GPU; nothing was measured"
        )
        print("gpu_vs_torchtitan: skipped (no CUDA device)")
        return 0
    s = settings()

    from workloads.pretrain.components.metrics import peak_tflops

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    peak = peak_tflops(device, "bf16")
    print(
        f"gpu_vs_torchtitan | {torch.cuda.get_device_name(device)} | torch {torch.__version__} | "
        f"{ts.TORCHTITAN} | precision {s['precision']} | torchtitan attention {s['tt_attn']} | "
        f"llmctl loss compiled: {s['compile_loss']} | peak {peak or 'unknown'} TFLOP/s bf16",
        flush=True,
    )
    results = {shape: run_shape(shape, s, device, peak) for shape in s["shapes"]}
    one_b = results.get("1b", {})
    if "llmctl" in one_b and "torchtitan" in one_b:
        print(f"gpu_vs_torchtitan: {one_b['llmctl']['tok_s'] / one_b['torchtitan']['tok_s']:.2f}x")
        return 0
    print("gpu_vs_torchtitan: failed (the 1b shape did not run on both sides)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
