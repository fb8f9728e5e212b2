"""``train.objective=dpo``: the step's loss, the reference, validation and TRL's metrics.

Each micro-batch of pairs (``data.preference.PairBatch``) is run twice: through the reference
without gradients, then through the policy; ``model.preference.pair_losses`` compares the two.
The reference is the policy's own frozen base with the LoRA adapters off (no second copy, as
TRL does with PEFT), or, when every weight trains, a frozen copy of the starting weights built
and sharded like the policy and held in the compute dtype (``Reference``). Like the LM loss, a
micro-batch's share is its pairs' summed loss over the global batch's count of pairs, so the
shares of all ranks and micro-batches add up to the mean over the global batch.

Metrics, with TRL's names: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
``rewards/margins``, ``logps/chosen``, ``logps/rejected``, means over the interval's pairs on all
data-parallel ranks; validation logs ``val/loss`` (the DPO loss) and the same under ``val/``.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist

from workloads.pretrain.model.preference import PairLosses, pair_losses, sequence_logps
from workloads.protocol.schema import DpoCfg

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


class Reference:
    """The reference's sequence log-probabilities: ``copy`` if given, else ``policy`` with its
    LoRA adapters off."""

    def __init__(self, policy: torch.nn.Module, copy: torch.nn.Module | None = None):
        self.policy, self.copy = policy, copy

    @property
    def kind(self) -> str:
        return "frozen copy of the starting weights" if self.copy is not None else "the base with adapters off"

    @torch.no_grad()
    def logps(self, batch: Any) -> torch.Tensor:
        if self.copy is not None:
            logps = sequence_logps(self.copy, batch)[0]
            _reshard(self.copy)
            return logps
        from workloads.pretrain.model.lora import adapters_off

        with adapters_off(self.policy):
            return sequence_logps(self.policy, batch)[0]


def _reshard(model: torch.nn.Module) -> None:
    """Free what FSDP left gathered after a forward: the [norm, head] unit (tied: the root) does not
    reshard after its forward, since a backward usually follows; none ever follows the copy's."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class PairStats:
    """Sums over pairs of the loss and of each metric in ``METRICS``, and the pairs counted."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(len(METRICS) + 2, device=device)  # + loss, pairs

    def add(self, pl: PairLosses, logps: torch.Tensor) -> None:
        chosen, rejected = logps.detach().float().chunk(2)
        margins = pl.chosen_rewards - pl.rejected_rewards
        self.sums += torch.stack(
            [
                pl.chosen_rewards.sum(),
                pl.rejected_rewards.sum(),
                (margins > 0).float().sum(),
                margins.sum(),
                chosen.sum(),
                rejected.sum(),
                pl.losses.detach().sum(),
                torch.tensor(float(len(margins)), device=self.sums.device),
            ]
        )

    def means(self, dp_world: bool, tp: int, prefix: str = "") -> dict[str, float]:
        """Each metric's mean over the pairs counted on every data-parallel rank (``tp`` ranks hold
        equal values); resets the sums."""
        sums = self.sums.clone()
        if dp_world:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            sums /= tp
        self.sums.zero_()
        values = (sums[:-1] / sums[-1].clamp(min=1)).tolist()
        out = {f"{prefix}{name}": v for name, v in zip(METRICS, values)}
        if prefix:
            out[f"{prefix}loss"] = values[-1]
        return out


class DpoObjective:
    """The DPO step's loss over pair micro-batches and its validation pass."""

    def __init__(self, opts: DpoCfg, reference: Reference, device: torch.device):
        self.opts, self.reference = opts, reference
        self.stats = PairStats(device)

    def describe(self) -> str:
        extra = f", label_smoothing {self.opts.label_smoothing}" if self.opts.loss == "robust" else ""
        head = f"pretrain | objective dpo: {self.opts.loss.value} loss, beta {self.opts.beta}{extra}"
        return f"{head} | reference {self.reference.kind}"

    def losses(self, model: torch.nn.Module, batch: Any) -> tuple[PairLosses, torch.Tensor]:
        ref = self.reference.logps(batch)
        logps, counts = sequence_logps(model, batch)
        return pair_losses(logps, ref, counts, self.opts), logps

    def step_loss(self, model: torch.nn.Module, batch: Any, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(what to backpropagate, this rank's share of the reported loss), as the LM's ``step_loss``."""
        pl, logps = self.losses(model, batch)
        self.stats.add(pl, logps)
        share = pl.losses.sum() / batch.global_targets
        return share * dp_size, share.detach()

    def interval_metrics(self, dp_world: bool, tp: int) -> dict[str, float]:
        return self.stats.means(dp_world, tp)

    @torch.no_grad()
    def evaluate(
        self,
        model: torch.nn.Module,
        batches: list,
        autocast: Callable[[], ContextManager],
        loss_context: Callable[[], ContextManager],
        dp_world: bool,
        tp: int,
        micro_batch_size: int | None = None,
    ) -> dict[str, float]:
        """``val/loss`` (the DPO loss) and ``val/<metric>`` over the fixed validation pairs."""
        model.eval()
        stats = PairStats(self.stats.sums.device)
        with loss_context():
            for b in (micro for batch in batches for micro in batch.split(micro_batch_size)):
                with autocast():
                    pl, logps = self.losses(model, b)
                stats.add(pl, logps)
        model.train()
        return stats.means(dp_world, tp, prefix="val/")
