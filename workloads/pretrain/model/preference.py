"""Direct Preference Optimization's loss (``train.objective=dpo``), as TRL's ``DPOTrainer`` computes it.

A batch holds each pair as two sequences, the chosen answers' rows first and the rejected ones'
after (TRL's concatenated forward): ``sequence_logps`` sums each row's log-probabilities over its
answer tokens (the targets that are not ``IGNORE_INDEX``), ``pair_losses`` turns the policy's and
the reference's sums into one loss per pair with TRL's formulas for ``loss_type`` ``sigmoid``,
``ipo`` and ``robust`` (``tests/trainer/test_dpo_trl.py`` holds them to TRL's own on the same
weights). The rewards TRL logs are ``beta`` times the log-ratios.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workloads.pretrain.model.losses import IGNORE_INDEX
from workloads.protocol.schema import DpoCfg


def sequence_logps(model: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each row's targets summed over the row [rows], targets per row [rows]).

    ``batch``: a ``sampler.Batch`` of pair rows. The model's per-token losses are minus the
    log-probabilities; under tensor parallelism they are a replicated DTensor, made plain here."""
    from torch.distributed.tensor import DTensor

    token_losses = model(batch.inputs, batch.targets, **batch.model_kwargs(), reduction="none")
    if isinstance(token_losses, DTensor):
        token_losses = token_losses.full_tensor()
    counts = (batch.targets != IGNORE_INDEX).sum(dim=1)
    return -token_losses.view(batch.targets.shape).sum(dim=1), counts


@dataclass
class PairLosses:
    """Per pair: the loss, and the rewards TRL logs (``beta`` x log-ratio to the reference), detached."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def pair_losses(logps: torch.Tensor, ref_logps: torch.Tensor, counts: torch.Tensor, opts: DpoCfg) -> PairLosses:
    """TRL's per-pair DPO losses from the policy's and the reference's sequence log-probabilities.

    All three arguments are per row, chosen rows first: ``logps`` carries the gradient,
    ``ref_logps`` none, ``counts`` (answer tokens per row) is read by ``ipo`` only, which compares
    per-token averages (TRL's length normalisation)."""
    chosen, rejected = logps.float().chunk(2)
    ref_chosen, ref_rejected = ref_logps.float().chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    beta = float(opts.beta)
    delta = chosen_ratio - rejected_ratio
    if opts.loss == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif opts.loss == "ipo":
        n_chosen, n_rejected = counts.float().clamp(min=1.0).chunk(2)
        losses = (chosen_ratio / n_chosen - rejected_ratio / n_rejected - 1 / (2 * beta)) ** 2
    elif opts.loss == "robust":
        eps = float(opts.label_smoothing)
        losses = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    else:  # the schema's enum admits nothing else
        raise ValueError(f"train.dpo.loss={opts.loss!r}")
    return PairLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
