"""AdamW with decoupled weight decay on matrices only, and the warmup + decay LR schedule."""

from __future__ import annotations

import math
from typing import Any

import torch


def build_optimizer(model: torch.nn.Module, train_cfg: Any) -> torch.optim.AdamW:
    """Decay weights of matmuls/embeddings (>= 2-D); never norms' gains or biases (1-D).

    ``fused=True`` (one kernel for all params) where the backend supports it, else foreach.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": float(train_cfg.weight_decay)},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=float(train_cfg.lr), betas=(float(train_cfg.beta1), float(train_cfg.beta2)), eps=1e-8)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def lr_factor(step: int, train_cfg: Any) -> float:
    """Multiplier of ``train.lr`` for optimizer step ``step`` (1-based).

    Linear warmup to 1 over ``warmup_steps``, then cosine / linear decay to ``min_lr_ratio`` at the
    last step, or constant. A pure function of the step, so resuming needs no scheduler state.
    """
    warmup, total, floor = int(train_cfg.warmup_steps), int(train_cfg.steps), float(train_cfg.min_lr_ratio)
    schedule = getattr(train_cfg.schedule, "value", train_cfg.schedule)
    if step <= warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    if schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown train.schedule {schedule!r}")
