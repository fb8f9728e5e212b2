"""AdamW with decoupled weight decay on matrices only; the LR schedule lives in ``schedule.py``."""

from __future__ import annotations

import torch

from workloads.planner.schedule import lr_factor  # noqa: F401 - the trainer's import
from workloads.protocol.schema import TrainCfg


def build_optimizer(model: torch.nn.Module, train_cfg: TrainCfg) -> torch.optim.AdamW:
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
