"""What one token costs the hardware: the model's FLOPs, what activation recompute adds, and what
FP8 takes off, in bf16-equivalent FLOPs (the time a token takes x the FLOP/s the device sustains).

    model      = 6·N + 12·L·H·Q·T              MFU's numerator; recompute and FP8 do not change it
    hardware   = model + recompute(ac)         full: each block's forward again, but w2 (protocol.shape)
    effective  = (hardware - fp8) + fp8 / s    fp8: the FLOPs of the linears train.fp8 converts
    x (1 + SELECTIVE_AC_TIME)                  ac=selective or full: the ops between matmuls again
    + reference                                dpo: the reference's forward, 2·N + 4·L·H·Q·T

Under ``train.objective=dpo`` a token is one of the 2 x batch_size sequences a step runs (a chosen
and a rejected answer per pair), and each also runs through the reference's forward, without
gradients (``shape.reference_flops_per_token``): the FLOPs a token counts (``counted``) are the
policy's plus the reference's, 8/6 of an lm token's without LoRA. Nothing is recomputed in that
forward, so the selective-AC prior does not scale it (FP8 does not run with DPO).

The throughput prior (``estimate.MFU_PRIOR`` of the dense bf16 peak) and a transferred run's FLOP/s
divide ``effective``, so an ``ac=full`` plan takes longer than ``ac=none`` and an FP8 plan less
than bf16, while MFU (model FLOPs over peak) is what the trainer logs either way. A run measured
with the same shape key (which holds ``ac`` and the FP8 recipe) needs none of this: its tokens/s
already paid for both. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from workloads.protocol.config import ConfigLike, typed
from workloads.protocol.shape import (
    flops_per_token,
    forward_flops_per_token,
    fp8_flops_per_token,
    fp8_linear_params,
    recompute_flops_per_token,
    reference_flops_per_token,
)

# FP8's speed-up on the linears it converts: a stated prior, not a measurement (no GPU run yet:
# docs/benchmarks.md#gpu_fp8 owes it). FP8 tensor cores have twice the dense bf16 peak on every
# FP8 GPU (Hopper, Ada, Blackwell); torchao's dynamic scaling (amax reductions, casts) takes part
# of that back, more for rowwise's per-row scales than for tensorwise's one per tensor. The derating
# is chosen so Llama-3.1-8B at seq 8192 comes out near torchao's published end-to-end speed-up for
# 8B on 8 H100s (docs/cost.md); benchmarks/gpu_fp8.py's figure replaces it once measured.
FP8_PEAK_RATIO = 2.0
FP8_DERATE = {"tensorwise": 0.70, "rowwise": 0.65}
FP8_PRIOR_SOURCE = "until benchmarks/gpu_fp8.py measures it: docs/benchmarks.md#gpu_fp8"
# Selective AC re-runs the ops between matmuls (norms, RoPE, SiLU, residual adds) in backward:
# no matmul FLOPs, but memory-bound time. A stated prior (docs/cost.md), as a share of step time.
SELECTIVE_AC_TIME = 0.03


@dataclass(frozen=True)
class Work:
    """FLOPs per token of one config, and what its recompute and FP8 recipe are assumed to cost."""

    model: int  # 6N + 12LHQT (LoRA: 4N + 6 x adapter params + 12LHQT)
    forward: int  # of those, one forward's: a validation token (2N + 4LHQT, LoRA + 2 x adapter params)
    recompute: int  # hardware FLOPs activation recompute adds
    fp8_flops: int  # hardware FLOPs in FP8 linears (0 without train.fp8)
    fp8_forward: int  # of those, the forward's (a validation pass)
    fp8_speedup: float  # on those FLOPs (1.0 without train.fp8)
    selective: float  # share of step time re-running the ops between matmuls adds (0 with ac=none)
    ac: str
    fp8: str
    reference: int = 0  # train.objective=dpo: the reference's forward per token (2N + 4LHQT); lm: 0
    objective: str = "lm"

    @property
    def hardware(self) -> int:
        return self.model + self.recompute

    @property
    def counted(self) -> int:
        """FLOPs one training token counts: the model's, and under DPO the reference's forward (what
        the estimate multiplies by its tokens and tags a run with: ``llmctl.flops_per_token``)."""
        return self.model + self.reference

    @property
    def effective(self) -> float:
        """bf16-equivalent FLOPs of one training token (DPO: its reference forward included)."""
        policy = (self.hardware - self.fp8_flops + self.fp8_flops / self.fp8_speedup) * (1 + self.selective)
        return policy + self.reference

    @property
    def effective_forward(self) -> float:
        """bf16-equivalent FLOPs of one validation token: a forward, nothing recomputed (DPO: the
        policy's and the reference's, as its validation compares them)."""
        return self.forward - self.fp8_forward + self.fp8_forward / self.fp8_speedup + self.reference

    def assumed(self) -> list[tuple[str, str]]:
        """(label, text) lines: what the estimate assumes for recompute and FP8, and on what evidence."""
        if self.ac == "none" and self.fp8 == "none":
            return [("assumes", "no activation recompute (parallel.ac=none), no FP8 (train.fp8=none)")]
        lines = []
        if self.ac == "full":
            lines.append(
                (
                    "recompute",
                    f"parallel.ac=full: each block's forward again in backward, +{self.recompute / 1e6:,.2f}"
                    f" MFLOP/token of hardware FLOPs (x{self.hardware / self.model:.3f}; MFU stays on model FLOPs)"
                    f" and +{self.selective:.0%} step time for its norms, RoPE, SiLU and adds (a stated prior)",
                )
            )
        elif self.ac == "selective":
            lines.append(
                (
                    "recompute",
                    f"parallel.ac=selective: no matmuls again, +{self.selective:.0%} step time for its norms, RoPE,"
                    " SiLU and adds (a stated prior)",
                )
            )
        if self.fp8 != "none":
            lines.append(
                (
                    "fp8",
                    f"train.fp8={self.fp8}: the block linears ({self.fp8_flops / self.hardware:.0%} of the FLOPs) at"
                    f" {self.fp8_speedup:.2f}x bf16 speed, a stated prior (FP8/bf16 peak {FP8_PEAK_RATIO:g}x derated"
                    f" to {FP8_DERATE[self.fp8]:.0%}; {FP8_PRIOR_SOURCE})",
                )
            )
        lines.append(("work", f"{self.effective / 1e6:,.2f} bf16-equivalent MFLOP/token (what the throughput divides)"))
        return lines


def work_per_token(
    cfg: ConfigLike, ac: Optional[str] = None, fp8: Optional[str] = None, objective: Optional[str] = None
) -> Work:
    """The work per token of ``cfg`` (or of its shape with another ``ac`` / FP8 recipe / objective: a
    transferred run's, whose shape key says which)."""
    tc = typed(cfg)
    m, seq = tc.model, int(tc.train.seq_len)
    ac = ac if ac is not None else tc.parallel.ac.value
    fp8 = fp8 if fp8 is not None else tc.train.fp8.value
    objective = objective if objective is not None else tc.train.objective.value
    recompute = recompute_flops_per_token(m, seq, ac)
    fp8 = fp8 if fp8 in FP8_DERATE else "none"
    fp8_params = fp8_linear_params(m) if fp8 != "none" else 0
    return Work(
        model=flops_per_token(m, seq),
        forward=forward_flops_per_token(m, seq),
        recompute=recompute,
        fp8_flops=fp8_flops_per_token(m, ac) if fp8 != "none" else 0,
        fp8_forward=2 * fp8_params,
        fp8_speedup=FP8_PEAK_RATIO * FP8_DERATE[fp8] if fp8 != "none" else 1.0,
        # full recompute re-runs the ops between the matmuls too, as selective does
        selective=SELECTIVE_AC_TIME if ac in ("selective", "full") else 0.0,
        ac=ac,
        fp8=fp8,
        reference=reference_flops_per_token(m, seq) if objective == "dpo" else 0,
        objective=objective,
    )


DPO_SUFFIX = "-dpo"  # a shape key's tail under train.objective=dpo (``estimate.shape_key``)


def objective_of(shape: str) -> str:
    """``dpo`` for a DPO run's ``llmctl.shape`` tag (``...-tp1-acnone-dpo``), else ``lm``."""
    return "dpo" if shape.endswith(DPO_SUFFIX) else "lm"


def regime(shape: str) -> tuple[str, str]:
    """(ac, FP8 recipe) from a run's ``llmctl.shape`` tag (``...-bf16+fp8rowwise-fused-tp1-acfull``)."""
    shape = shape.removesuffix(DPO_SUFFIX)
    ac = shape.rsplit("-ac", 1)[-1] if "-ac" in shape else "none"
    fp8 = shape.split("+fp8", 1)[1].split("-", 1)[0] if "+fp8" in shape else "none"
    return ac, fp8
