"""llmctl's fused kernel path vs plain PyTorch and Hugging Face's Llama: training tokens/s on CPU.

Three contenders, same weights, same random batch, fp32, full training step (forward + loss,
backward, grad-norm clip 1.0, fused AdamW step, zero_grad), eager (no ``torch.compile``):

- ``fused``: ``workloads.pretrain.model.transformer`` with ``model.kernels=fused`` (SDPA, ``F.rms_norm``,
  complex RoPE, chunked fused linear-CE), what ``llmctl launch`` runs by default;
- ``plain``: ``benchmarks/plain_llama.py``, the same model written with stock PyTorch ops (SDPA
  with ``is_causal``, ``F.rms_norm``, complex RoPE, ``F.cross_entropy`` on full fp32 logits);
- ``hf``: transformers' ``LlamaForCausalLM`` (``attn_implementation="sdpa"``) with the weights
  converted by ``workloads.pretrain.checkpoint.hf_export`` and its own causal-LM loss.

Shapes (``KERNELS_CPU_SHAPES``, default both): ``smoke`` (conf/model/smoke.yaml, batch 16 x seq 128)
and ``125m`` (conf/model/125m.yaml: 12 x 768, vocab 32000; batch 8 x seq 256). Before timing, the
first step's losses must agree within 1e-4 (else exit 1: the contenders would not compute the same thing).

ONE intra-op thread (``KERNELS_CPU_THREADS`` to change): these 2 cores are shared, and when another
process holds a core every 2-thread OpenMP region waits for the descheduled thread (a matmul then
runs several times slower: docs/benchmarks.md), so a 2-thread figure measures the neighbours' load.

Timing: warmup steps excluded; then rounds, each timing every contender for a window of steps,
the order rotating from round to round, so load from other processes falls on all of them. A
contender's tokens/s is its median over rounds; a ratio is the median of the per-round ratios.

Run: ``python benchmarks/kernels_cpu.py`` (about 7 minutes on the 2-core CI machine, most of it 125m).
Last line: ``kernels_cpu: <fused/plain at smoke>x smoke, <fused/plain at 125m>x 125m (fused / plain)``.
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
sys.path.insert(0, str(REPO / "benchmarks"))

import plain_llama  # noqa: E402

from workloads.pretrain.components.optim import build_optimizer  # noqa: E402
from workloads.pretrain.model.transformer import build_model  # noqa: E402
from workloads.protocol.shape import num_params  # noqa: E402

THREADS = int(os.environ.get("KERNELS_CPU_THREADS", "1"))
# shape -> (batch, seq, warmup steps, rounds, steps per window)
SHAPES = {"smoke": (16, 128, 3, 15, 2), "125m": (8, 256, 1, 5, 1)}
CONTENDERS = ("fused", "plain", "hf")


def model_cfg(shape: str):
    from omegaconf import OmegaConf

    from workloads.protocol.schema import ModelCfg

    cfg = OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(REPO / f"conf/model/{shape}.yaml"))
    cfg.kernels = "fused"
    return OmegaConf.to_object(cfg)


def train_cfg():
    from omegaconf import OmegaConf

    from workloads.protocol.schema import TrainCfg

    return OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(TrainCfg), OmegaConf.load(REPO / "conf/train/default.yaml"))
    )


def build_contenders(cfg) -> dict[str, tuple[torch.nn.Module, object]]:
    """name -> (model, loss_fn(x, y)), all holding the fused model's initial weights."""
    torch.manual_seed(0)
    fused = build_model(cfg)
    state = fused.state_dict()
    plain = plain_llama.from_model_cfg(cfg)
    plain.load_state_dict(state)

    from transformers import LlamaConfig, LlamaForCausalLM

    from workloads.pretrain.checkpoint.hf_export import hf_config, to_hf_state_dict

    hf = LlamaForCausalLM(LlamaConfig(**hf_config(cfg), attn_implementation="sdpa"))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(state, cfg), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_embeddings else set()):
        sys.exit(f"kernels_cpu: HF weights do not line up (missing {missing}, unexpected {unexpected})")
    return {
        "fused": (fused, lambda x, y: fused(x, y)),
        "plain": (plain, lambda x, y: plain(x, y)),
        "hf": (hf, lambda x, y: hf(input_ids=x, labels=y, shift_labels=y).loss),  # HF's own loss, unshifted
    }


class Contender:
    """One model with its optimizer; ``timed(n)`` runs n training steps and records tokens/s."""

    def __init__(self, name: str, model: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor):
        tc = train_cfg()
        self.name, self.model, self.loss_fn, self.x, self.y = name, model, loss_fn, x, y
        self.opt = build_optimizer(model, tc)
        self.clip = float(tc.grad_clip) if tc.grad_clip else math.inf
        self.tok_s: list[float] = []

    def step(self) -> float:
        loss = self.loss_fn(self.x, self.y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def timed(self, n: int) -> None:
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        self.tok_s.append(n * self.x.numel() / (time.perf_counter() - t0))


def run_shape(shape: str) -> dict[str, float]:
    """Median tokens/s of each contender and the median paired ratios fused/plain, fused/hf."""
    batch, seq, warmup, rounds, steps = SHAPES[shape]
    cfg = model_cfg(shape)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    cs = [Contender(name, m, f, x, y) for name, (m, f) in build_contenders(cfg).items()]
    print(
        f"kernels_cpu | {shape}: {num_params(cfg) / 1e6:.1f}M params ({cfg.n_layers} x {cfg.dim}, vocab "
        f"{cfg.vocab_size}) | batch {batch} x seq {seq} fp32 | {warmup} warmup + {rounds} rounds x {steps} "
        f"step(s) per contender",
        flush=True,
    )

    first = {c.name: c.step() for c in cs}  # same weights, same batch: the same loss
    print(f"kernels_cpu | {shape}: step-1 loss " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()), flush=True)
    if max(first.values()) - min(first.values()) > 1e-4:
        sys.exit(f"kernels_cpu: {shape}: the contenders' first losses differ: {first}")
    for _ in range(warmup - 1):
        for c in cs:
            c.step()

    by = {c.name: c for c in cs}
    ratios: dict[str, list[float]] = {"plain": [], "hf": []}
    for r in range(rounds):
        for c in cs[r % len(cs) :] + cs[: r % len(cs)]:
            c.timed(steps)
        for base in ratios:
            ratios[base].append(by["fused"].tok_s[-1] / by[base].tok_s[-1])
        print(
            f"kernels_cpu | {shape} round {r + 1}: " + ", ".join(f"{c.name} {c.tok_s[-1]:,.0f}" for c in cs) + " tok/s",
            flush=True,
        )
    out = {f"{c.name}_tok_s": statistics.median(c.tok_s) for c in cs}
    out.update({f"fused/{base}": statistics.median(v) for base, v in ratios.items()})
    print(
        f"kernels_cpu | {shape}: "
        + ", ".join(f"{c.name} {out[c.name + '_tok_s']:,.0f} tok/s" for c in cs)
        + f" (medians) | fused/plain {out['fused/plain']:.2f}x, fused/hf {out['fused/hf']:.2f}x",
        flush=True,
    )
    return out


def main() -> int:
    torch.set_num_threads(THREADS)
    shapes = [s for s in os.environ.get("KERNELS_CPU_SHAPES", ",".join(SHAPES)).split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        sys.exit(f"KERNELS_CPU_SHAPES: unknown shape(s) {unknown}; choose from {sorted(SHAPES)}")
    print(f"kernels_cpu | torch {torch.__version__}, {torch.get_num_threads()} thread(s), eager", flush=True)
    results = {s: run_shape(s) for s in shapes}
    print("kernels_cpu: " + ", ".join(f"{r['fused/plain']:.2f}x {s}" for s, r in results.items()) + " (fused / plain)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
