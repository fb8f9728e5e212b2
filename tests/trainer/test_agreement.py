"""The per-step flags (preemption, budget) cost no host sync: one process reads them without any
tensor, several compare them only on steps every rank agrees on. A ``meta`` device proves the
first: any tensor built there fails at ``.item()``."""

from __future__ import annotations

import time

import pytest
import torch

from workloads.pretrain.components.budget import BudgetGuard
from workloads.pretrain.components.preempt import AGREE_EVERY, Preemption, agreement_due

NO_HOST = torch.device("meta")


def test_one_process_reads_the_flag_without_a_tensor() -> None:
    p = Preemption()
    assert p.check(NO_HOST, grace_s=20.0, save_s=1.0) is None  # no signal: carry on
    p.signal_at, p.signame = time.monotonic(), "SIGTERM"
    assert p.check(NO_HOST, grace_s=20.0, save_s=1.0) is True  # time for the emergency save
    assert p.check(NO_HOST, grace_s=0.0, save_s=1.0) is False  # stop, unsaved
    assert p.check(NO_HOST, grace_s=20.0, save_s=1.0, due=False) is True  # one process: every step is due


def test_one_process_budget_decides_without_a_tensor() -> None:
    now = time.time()
    over = BudgetGuard(max_cost=1.0, usd_per_hour=3600.0, billing_start=now - 2.0)  # $2 spent already
    assert over.should_stop(NO_HOST) is True
    under = BudgetGuard(max_cost=1000.0, usd_per_hour=1.0, billing_start=now)
    assert under.should_stop(NO_HOST) is False
    assert BudgetGuard(None, 0.0, now).should_stop(NO_HOST) is False  # inert without a limit


@pytest.mark.parametrize("world", [2, 8])
def test_several_processes_agree_every_k_steps_and_at_checkpoints(world: int) -> None:
    due = [s for s in range(1, 31) if agreement_due(s, checkpoint_every=0, world_size=world)]
    assert due == [AGREE_EVERY * k for k in range(1, 30 // AGREE_EVERY + 1)]
    with_ckpt = {s for s in range(1, 31) if agreement_due(s, checkpoint_every=3, world_size=world)}
    assert {3, 6, 9, 10, 12}.issubset(with_ckpt) and 1 not in with_ckpt and 11 not in with_ckpt
    assert all(agreement_due(s, 0, 1) for s in range(1, 31))  # one process: nothing to agree on
