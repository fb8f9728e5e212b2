"""llmctl's LoRA against PEFT on transformers' Llama, and QLoRA's cost over LoRA: training tokens/s on CPU.

    python benchmarks/lora_cpu.py

Three contenders, the same base weights, the same adapters' initial values, the same random batch,
fp32, eager, a full LoRA training step (forward + loss, backward, grad-norm clip 1.0, the trainer's
fused AdamW over the adapters only, zero_grad):

- ``llmctl``: the trainer's model (``model.kernels=fused``) with ``model.lora.rank=16, alpha=32`` on
  every linear of every block (``workloads/pretrain/model/lora.py``), what ``llmctl launch`` runs;
- ``peft``: transformers' ``LlamaForCausalLM`` (``attn_implementation="sdpa"``, weights converted
  by ``hf_export.to_hf_state_dict``) under ``peft.get_peft_model`` with the same rank, alpha and
  targets, its own causal-LM loss; llmctl's A matrices copied in (B is zero on both sides);
- ``qlora``: ``llmctl`` with ``model.lora.quantize_base=nf4`` (torchao's NF4 base, computed in fp32
  here): what the 4-bit base costs in speed where it saves memory.

Shape: a small Llama 3 (GQA 8 query / 4 kv heads, dim 512, 8 layers, FFN 1536, vocab 16384,
untied head), batch 4 x seq 256. Before timing, llmctl's and PEFT's first losses must agree within
1e-4 (else exit 1: they would not compute the same thing); QLoRA's differs by the quantization.

ONE intra-op thread (``LORA_CPU_THREADS`` to change): the cores are shared, and a 2-thread figure
measures the neighbours' load (kernels_cpu in docs/benchmarks.md). Timing as kernels_cpu: warmup
steps excluded, then rounds timing every contender for a window of steps in an order rotating
from round to round; a contender's tokens/s is its median over rounds, a ratio the median of the
per-round ratios.

Knobs (the test runs a tiny shape; its figures mean nothing): ``LORA_CPU_DIM``, ``LORA_CPU_LAYERS``,
``LORA_CPU_VOCAB``, ``LORA_CPU_BATCH``, ``LORA_CPU_SEQ``, ``LORA_CPU_ROUNDS``, ``LORA_CPU_STEPS``
(per window), ``LORA_CPU_WARMUP``, ``LORA_CPU_RANK``.

Last line: ``lora_cpu_llmctl_over_peft: <llmctl / peft tokens/s>x``.
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


def _knob(name: str, default: int) -> int:
    return int(os.environ.get(f"LORA_CPU_{name}", default))


THREADS = _knob("THREADS", 1)
DIM, LAYERS, VOCAB = _knob("DIM", 512), _knob("LAYERS", 8), _knob("VOCAB", 16384)
BATCH, SEQ = _knob("BATCH", 4), _knob("SEQ", 256)
WARMUP, ROUNDS, STEPS = _knob("WARMUP", 2), _knob("ROUNDS", 7), _knob("STEPS", 1)
RANK = _knob("RANK", 16)
ALPHA = 2.0 * RANK
CONTENDERS = ("llmctl", "peft", "qlora")
# the model's linear -> transformers' module name (PEFT's target_modules)
HF_NAMES = {
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "w1": "gate_proj",
    "w2": "down_proj",
    "w3": "up_proj",
}


def model_cfg():
    from workloads.protocol.schema import ModelCfg

    heads = max(DIM // 64, 2)
    return ModelCfg(
        name="lora-cpu",
        dim=DIM,
        n_layers=LAYERS,
        n_heads=heads,
        n_kv_heads=heads // 2,
        vocab_size=VOCAB,
        hidden_dim=3 * DIM,
        rope_theta=500000.0,
        max_seq_len=max(SEQ, 256),
        tie_embeddings=False,
    )


def lora_cfg(quantize: bool):
    from workloads.protocol.schema import LoraCfg, QuantizeBase

    return LoraCfg(rank=RANK, alpha=ALPHA, quantize_base=QuantizeBase.nf4 if quantize else QuantizeBase.none)


def train_cfg():
    from omegaconf import OmegaConf

    from workloads.protocol.schema import TrainCfg

    return OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(TrainCfg), OmegaConf.load(REPO / "conf/train/default.yaml"))
    )


def build_contenders(cfg) -> dict[str, tuple[torch.nn.Module, object]]:
    """name -> (model, loss_fn(x, y)), all on the same base weights and initial adapters."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from workloads.pretrain.checkpoint.hf_export import hf_config, to_hf_state_dict
    from workloads.pretrain.model import lora
    from workloads.pretrain.model.transformer import build_model

    torch.manual_seed(0)
    base = build_model(cfg)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    ours = base
    lora.apply(ours, lora_cfg(quantize=False))
    quant = build_model(cfg)
    quant.load_state_dict(state)
    lora.apply(quant, lora_cfg(quantize=True), compute_dtype=torch.float32)
    adapters = {n: p.detach() for n, p in ours.named_parameters() if lora.is_adapter(n)}
    with torch.no_grad():
        for name, p in quant.named_parameters():
            if lora.is_adapter(name):
                p.copy_(adapters[name])

    hf = LlamaForCausalLM(LlamaConfig(**hf_config(cfg), attn_implementation="sdpa"))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(state, cfg), strict=False)
    if missing or unexpected:
        sys.exit(f"lora_cpu: HF weights do not line up (missing {missing}, unexpected {unexpected})")
    spec = lora_cfg(quantize=False)
    theirs = peft.get_peft_model(
        hf,
        peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=[HF_NAMES[t] for t in spec.targets], bias="none"
        ),
    )
    with torch.no_grad():  # llmctl's A (B is zero on both sides; A's columns are the inputs, unpermuted)
        for name, value in adapters.items():
            if ".lora_a." in name:
                _, n, _, linear, _, _ = name.split(".")
                block = "self_attn" if linear in ("wq", "wk", "wv", "wo") else "mlp"
                module = theirs.base_model.model.model.layers[int(n)].get_submodule(f"{block}.{HF_NAMES[linear]}")
                module.lora_A["default"].weight.copy_(value)
    ours_n = lora.trainable_parameters(ours)
    theirs_n = theirs.get_nb_trainable_parameters()[0]
    if ours_n != theirs_n:
        sys.exit(f"lora_cpu: trainable parameters differ: llmctl {ours_n:,}, PEFT {theirs_n:,}")
    return {
        "llmctl": (ours, lambda x, y: ours(x, y)),
        "peft": (theirs, lambda x, y: theirs(input_ids=x, labels=y, shift_labels=y).loss),  # HF's loss, unshifted
        "qlora": (quant, lambda x, y: quant(x, y)),
    }


class Contender:
    """One model with its optimizer over the trainable parameters; ``timed(n)`` runs n steps and
    records tokens/s."""

    def __init__(self, name: str, model: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor):
        from workloads.pretrain.components.optim import build_optimizer

        tc = train_cfg()
        self.name, self.model, self.loss_fn, self.x, self.y = name, model, loss_fn, x, y
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = build_optimizer(model, tc)
        self.clip = float(tc.grad_clip) if tc.grad_clip else math.inf
        self.tok_s: list[float] = []

    def step(self) -> float:
        loss = self.loss_fn(self.x, self.y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def timed(self, n: int) -> None:
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        self.tok_s.append(n * self.x.numel() / (time.perf_counter() - t0))


def main() -> int:
    from workloads.protocol.shape import num_params

    torch.set_num_threads(THREADS)
    cfg = model_cfg()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    cs = [Contender(name, m, f, x, y) for name, (m, f) in build_contenders(cfg).items()]
    trainable = sum(p.numel() for p in cs[0].params)
    print(
        f"lora_cpu | torch {torch.__version__}, {torch.get_num_threads()} thread(s), eager |"
        f" {num_params(cfg) / 1e6:.1f}M params ({cfg.n_layers} x {cfg.dim}, {cfg.n_heads}/{cfg.n_kv_heads} heads,"
        f" FFN {cfg.hidden_dim}, vocab {cfg.vocab_size}) | LoRA rank {RANK}, alpha {ALPHA:g}, all 7 linears:"
        f" {trainable:,} trainable | batch {BATCH} x seq {SEQ} fp32 | {WARMUP} warmup"
        f" + {ROUNDS} rounds x {STEPS} step(s) per contender",
        flush=True,
    )
    first = {c.name: c.step() for c in cs}
    print("lora_cpu | step-1 loss " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()), flush=True)
    if abs(first["llmctl"] - first["peft"]) > 1e-4:
        sys.exit(f"lora_cpu: llmctl's and PEFT's first losses differ: {first}")
    for _ in range(WARMUP - 1):
        for c in cs:
            c.step()

    by = {c.name: c for c in cs}
    ratios: dict[str, list[float]] = {"llmctl/peft": [], "qlora/llmctl": []}
    for r in range(ROUNDS):
        for c in cs[r % len(cs) :] + cs[: r % len(cs)]:
            c.timed(STEPS)
        ratios["llmctl/peft"].append(by["llmctl"].tok_s[-1] / by["peft"].tok_s[-1])
        ratios["qlora/llmctl"].append(by["qlora"].tok_s[-1] / by["llmctl"].tok_s[-1])
        shown = ", ".join(f"{c.name} {c.tok_s[-1]:,.0f}" for c in cs)
        print(f"lora_cpu | round {r + 1}: {shown} tok/s", flush=True)
    med = {c.name: statistics.median(c.tok_s) for c in cs}
    ratio = {k: statistics.median(v) for k, v in ratios.items()}
    print(
        "lora_cpu | "
        + ", ".join(f"{n} {v:,.0f} tok/s" for n, v in med.items())
        + f" (medians) | llmctl/peft {ratio['llmctl/peft']:.2f}x, qlora/llmctl {ratio['qlora/llmctl']:.2f}x",
        flush=True,
    )
    print(f"lora_cpu_llmctl_over_peft: {ratio['llmctl/peft']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
