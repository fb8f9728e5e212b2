"""Budget guard: stop training, after a checkpoint, before the run's spend passes ``--max-cost``.

The controller (``llmctl launch --max-cost``) hands the price over in the environment:

    LLMCTL_MAX_COST_USD     the limit for the whole run
    LLMCTL_PRICE_PER_HOUR   $/h of the whole job (all nodes)
    LLMCTL_BILLING_START    epoch seconds when this attempt's billing started
    LLMCTL_SPENT_USD        spend of earlier attempts (a resumed run), default 0

After every step each rank projects the spend at the end of the *next* step plus a reserve for the
final validation pass and checkpoint (one more step time, at least ``RESERVE_S``): if that passes the limit, the step is
treated as the last one (logged, validated, checkpointed) and the loop ends. One process decides
alone, with no tensor. Several decide from their own clocks, so the decision is all-reduced (MAX),
only on the steps the ranks agree on (``preempt.agreement_due``: every ``AGREE_EVERY`` steps and
at checkpoints) and projected that many steps ahead: all stop at the same step or none does.
Rank 0 then tags the MLflow run ``llmctl.budget_stop`` (JSON) and the workload exits 0 — torchrun
turns any non-zero worker exit into 1, so the controller reads the tag, closes the run FINISHED with
``llmctl.status = stopped: budget $X reached at step N`` and exits with its own code (4).
Inert (no collective, no clock) unless both a limit and a non-zero price are set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from workloads.pretrain.components.preempt import AGREE_EVERY, scope
from workloads.protocol.run_contract import ENV_BILLING_START, ENV_MAX_COST, ENV_PRICE, ENV_SPENT, TAG_BUDGET_STOP

RESERVE_S = 5.0  # at least this long is kept for the last validation pass and the checkpoint save


class BudgetGuard:
    def __init__(self, max_cost: Optional[float], usd_per_hour: float, billing_start: float, spent_before: float = 0.0):
        self.max_cost, self.usd_per_hour = max_cost, usd_per_hour
        self.billing_start, self.spent_before = billing_start, spent_before
        self._last = time.time()
        self._step_s = 0.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "BudgetGuard":
        def num(key: str, default: Optional[float]) -> Optional[float]:
            raw = environ.get(key, "")
            return float(raw) if raw.strip() else default

        return cls(
            num(ENV_MAX_COST, None),
            num(ENV_PRICE, 0.0) or 0.0,
            num(ENV_BILLING_START, time.time()) or time.time(),
            num(ENV_SPENT, 0.0) or 0.0,
        )

    @property
    def active(self) -> bool:
        return self.max_cost is not None and self.usd_per_hour > 0

    def spent(self, now: Optional[float] = None) -> float:
        now = time.time() if now is None else now
        return self.spent_before + self.usd_per_hour * max(0.0, now - self.billing_start) / 3600.0

    def over(self, now: float, step_s: float, steps_ahead: int = 1) -> bool:
        """Would the spend pass the limit by the end of the next ``steps_ahead`` steps plus the reserve?"""
        assert self.max_cost is not None
        return self.spent(now + steps_ahead * step_s + max(step_s, RESERVE_S)) > self.max_cost

    def should_stop(self, device: torch.device, due: bool = True) -> bool:
        """Call once per step on every rank; returns the same answer everywhere. ``due``: this step
        is one the ranks agree on (``preempt.agreement_due``); with one process every step is."""
        if not self.active:
            return False
        now = time.time()
        self._step_s, self._last = now - self._last, now
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.over(now, self._step_s)
        if not due:
            return False
        # the next agreement may be AGREE_EVERY steps away: stop now if the spend would pass by then
        stop = torch.tensor([1.0 if self.over(now, self._step_s, AGREE_EVERY) else 0.0], device=device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        return bool(stop.item())

    def record_stop(self, step: int, is_main: bool, checkpoint: bool) -> None:
        """Rank 0: say so, and tag the MLflow run for the controller (best-effort)."""
        if not is_main:
            return
        info = {
            "step": step,
            "spent_usd": round(self.spent(), 6),
            "max_cost_usd": self.max_cost,
            "usd_per_hour": self.usd_per_hour,
            "checkpoint": checkpoint,
        }
        print(
            f"budget | stopping after step {step}: spent ${info['spent_usd']:.4f} of ${self.max_cost:.4f}"
            f" at ${self.usd_per_hour:.2f}/h; {'checkpoint saved' if checkpoint else 'no checkpoint.dir'}",
            flush=True,
        )
        run_id = os.environ.get("MLFLOW_RUN_ID")
        if not run_id:
            return
        try:
            from mlflow.tracking import MlflowClient

            MlflowClient().set_tag(run_id, TAG_BUDGET_STOP, json.dumps({**info, **scope()}))
        except Exception as e:  # the controller then sees a plain FINISHED run; the log still says why
            print(
                f"warning: could not tag the run with the budget stop ({type(e).__name__}: {e})",
                file=sys.stderr,
                flush=True,
            )
