"""The LR schedule as a pure function of the step (stdlib only: the controller uses it at resume).

Warmup (linear to 1 over ``train.warmup_steps``), then one of:

- ``cosine`` / ``linear``: decay to ``train.min_lr_ratio`` at the horizon, then stay there;
- ``wsd`` (warmup-stable-decay): 1 until the last ``train.decay_fraction`` of the post-warmup
  steps, then linear decay to the floor at the horizon; extends cleanly while still stable;
- ``constant``: 1.

The horizon is ``train.schedule_steps``, or ``train.steps`` when that is unset. A resume that
changes ``train.steps`` keeps the run's horizon unless the new schedule agrees with the old one up
to the resume step (``extension``), so the learning rate never jumps (docs/resume.md). Every
function reads a ``schema.TrainCfg`` (``config.typed(cfg).train`` for a plain mapping).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from workloads.protocol.schema import TrainCfg


def horizon(train: TrainCfg) -> int:
    """The step the decay ends at."""
    return int(train.schedule_steps) if train.schedule_steps else int(train.steps)


def lr_factor(step: int, train: TrainCfg) -> float:
    """Multiplier of ``train.lr`` for optimizer step ``step`` (1-based). Resuming needs no state."""
    warmup, total, floor = int(train.warmup_steps), horizon(train), float(train.min_lr_ratio)
    schedule = train.schedule
    if step <= warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    if schedule == "wsd":
        start = warmup + (1.0 - float(train.decay_fraction)) * (total - warmup)
        if step <= start:
            return 1.0
        return 1.0 - (1.0 - floor) * min(1.0, (step - start) / max(1e-9, total - start))
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    if schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown train.schedule {schedule!r}")


def agrees(old: TrainCfg, new: TrainCfg, upto: int) -> bool:
    """Whether two train configs give the same LR at every step up to ``upto``."""
    return all(abs(lr_factor(s, old) - lr_factor(s, new)) <= 1e-12 for s in range(1, upto + 1))


def extension(old: TrainCfg, new: TrainCfg, from_step: int) -> tuple[Optional[int], str]:
    """At a resume from ``from_step``: the ``train.schedule_steps`` to pin (None: leave the new
    config as it is) and a line for the user (empty when nothing about the schedule changed)."""
    old_h, new_h = horizon(old), horizon(new)
    if old_h == new_h:
        return None, ""
    lr = float(new.lr)
    if agrees(old, new, from_step):
        return None, (
            f"the LR schedule now ends at step {new_h} (was {old_h}); it agrees with the old one up to"
            f" step {from_step}, so the learning rate continues without a jump"
        )
    if new.schedule_steps:  # the user asked for the new horizon by name: do it, and say what it costs
        before, after = lr * lr_factor(from_step, old), lr * lr_factor(from_step + 1, new)
        return None, (
            f"train.schedule_steps={new_h}: the LR schedule is re-planned; the learning rate jumps from"
            f" {before:.2e} (step {from_step}) to {after:.2e} (step {from_step + 1})"
        )
    pinned = dataclasses.replace(new, schedule_steps=old_h)
    steps = int(new.steps)
    if steps < old_h:  # fewer steps: the run now ends before its decay does
        end, floor = lr * lr_factor(steps, pinned), lr * float(new.min_lr_ratio)
        return old_h, (
            f"train.steps {old_h} -> {steps}: the LR schedule keeps its horizon of {old_h} steps, so the learning"
            f" rate does not jump; the run now ends at step {steps}, before its decay does (learning rate"
            f" {end:.2e} there, not the floor {floor:.2e}). To finish the decay at step {steps}, add"
            f" train.schedule_steps={steps} (the learning rate then jumps at the resume)"
        )
    tail = f"{lr * lr_factor(max(new_h, old_h), pinned):.2e}"
    return old_h, (
        f"train.steps {old_h} -> {int(new.steps)}: the LR schedule keeps its horizon of {old_h}"
        f" steps, so the learning rate does not jump (after step {old_h} it stays at {tail}). To re-plan"
        f" the decay over the new length, add train.schedule_steps={int(new.steps)} (the learning rate"
        f" then jumps at the resume); schedule=wsd extends cleanly while still in its stable phase"
    )
