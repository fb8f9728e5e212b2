"""A plan over several providers (``infra.candidates``): each candidate priced, fitted and estimated.

The backend says what each candidate is (its ``infra`` keys, hardware and catalog offers) and which
one SkyPilot tries first; here every candidate gets the memory plan and the cost estimate the
run's own plan gets, on its own device and price, so ``plan`` prints them side by side and
``launch`` holds the memory plan and ``--max-cost`` against every one: the run may land on any.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from llmctl.config.candidates import label
from llmctl.config.workload import is_command
from llmctl.plan.devices import Hardware


@dataclass
class Candidate:
    """One provider this run may land on."""

    index: int
    infra: dict[str, Any]  # its written-out keys (``llmctl.config.candidates.RESOURCE_KEYS``)
    hardware: Hardware
    offers: dict[bool, list[Any]]  # catalog offers by mode (False: on-demand, True: spot), cheapest first
    where: str  # SkyPilot's infra string
    memory: Any = None  # llmctl.plan.memory_fit.MemoryFit
    estimate: Any = None  # llmctl.cost.estimate.Estimate

    @property
    def label(self) -> str:
        return label(self.infra)

    @property
    def hourly(self) -> Optional[float]:
        """The cheapest catalog offer's $/h for all nodes, in the candidate's mode (None: no catalog)."""
        found = self.offers.get(bool(self.infra.get("use_spot")), [])
        return found[0].total_hour if found else None


def plan_for(plan: Any, cand: Candidate) -> Any:
    """``plan`` as it would run on ``cand``: its infra keys, hardware and offers (a copy)."""
    infra = {**plan.cfg["infra"], **cand.infra, "candidates": []}
    return replace(plan, cfg={**plan.cfg, "infra": infra}, hardware=cand.hardware, offers=cand.offers)


def fill(plan: Any, check_memory: Any, estimate: Any) -> None:
    """Each candidate's memory plan (``check_memory(plan)``) and estimate (``estimate(plan)``), the
    first-tried one's first: its ``parallel.grad_sync`` choice is what the trainer gets, and the
    others are held against the same. The plan's own memory and estimate are the first-tried one's."""
    first = plan.candidates[plan.first_candidate]
    ordered = [first, *(c for c in plan.candidates if c is not first)]
    for cand in ordered:
        view = plan_for(plan, cand)
        if not is_command(plan.cfg):  # a user's program: its memory is its own
            try:
                cand.memory = check_memory(view)
            except Exception as exc:
                plan.notes.append(f"no memory plan for candidate {cand.index} ({cand.label}): {exc}")
        if cand is first:
            plan.set_values("parallel", grad_sync=view.cfg["parallel"]["grad_sync"])
            plan.memory = cand.memory
        try:
            cand.estimate = estimate(view)
        except Exception as exc:
            plan.notes.append(f"no cost estimate for candidate {cand.index} ({cand.label}): {exc}")
    plan.estimate = first.estimate


def misfits(plan: Any) -> list[str]:
    """Each candidate the memory plan says cannot hold the job, in one line."""
    return [
        f"infra.candidates[{c.index}] ({c.label}) would run out of memory: {c.memory.verdict()}"
        for c in getattr(plan, "candidates", [])
        if c.memory is not None and c.memory.fits is False
    ]


def lines(plan: Any) -> list[str]:
    """The candidates table ``plan`` prints: price, memory fit and estimated total of each."""
    if not getattr(plan, "candidates", None):
        return []
    how = (
        "SkyPilot tries them in this order (resources.ordered)"
        if plan.pick == "ordered"
        else "SkyPilot's optimizer takes the cheapest per hour (resources.any_of)"
    )
    out = [f"# candidates (infra.pick={plan.pick}: {how})"]
    out.append(f"{'#':>2}  {'candidate':<34} {'$/h total':>10}  {'memory':<22} {'estimated total':>15}")
    for c in plan.candidates:
        hourly = "-" if c.hourly is None else f"{c.hourly:,.2f}"
        fit = "unknown" if c.memory is None or c.memory.fits is None else "fits" if c.memory.fits else "DOES NOT FIT"
        if c.memory is not None and c.memory.usable:
            fit += f" ({c.memory.plan.total / 2**30:.1f}/{c.memory.usable / 2**30:.1f} GiB)"
        est = c.estimate
        total = "-" if est is None else f"${est.total_usd:,.2f}" if est.priced else "unpriced"
        first = "  <- tried first" if c.index == plan.first_candidate else ""
        out.append(f"{c.index:>2}  {c.label:<34} {hourly:>10}  {fit:<22} {total:>15}{first}")
    return out


def billed_estimate(plan: Any) -> Any:
    """The estimate an attempt is priced by before SkyPilot says where it landed: the dearest
    candidate's (an unpriced one wins: its dollars are unknown), so the budget guard on the nodes
    stops early rather than late; ``plan.estimate`` without candidates."""
    ests = [c.estimate for c in getattr(plan, "candidates", []) if c.estimate is not None]
    if not ests:
        return plan.estimate
    unpriced = [e for e in ests if not e.priced]
    return unpriced[0] if unpriced else max(ests, key=lambda e: e.price.usd_per_hour)


def price_table(plan: Any) -> list[dict[str, Any]]:
    """What each candidate costs per hour (all nodes), by region where the catalog prices it, else the
    estimate's price (``infra.price_per_gpu_hour``; None: unpriced): recorded on the run at launch,
    so the ledger bills each attempt at the candidate that served it (``ledger.price_served``)."""
    table = []
    for c in getattr(plan, "candidates", []):
        regions: dict[str, float] = {}
        for offer in c.offers.get(bool(c.infra.get("use_spot")), []):  # cheapest first
            regions.setdefault(offer.region, offer.total_hour)
        est = c.estimate
        table.append(
            {
                "label": c.label,
                "provider": c.infra.get("provider"),
                "region": c.infra.get("region"),
                "zone": c.infra.get("zone"),
                "spot": bool(c.infra.get("use_spot")),
                "regions": regions,
                "usd_per_hour": est.price.usd_per_hour if est is not None and est.priced else None,
            }
        )
    return table


MAX_TAG = 8000  # MLflow's longest tag value


def candidate_prices(plan: Any) -> str:
    """``price_table`` as the run's tag: JSON, by region while it fits in a tag, else each
    candidate's cheapest price alone."""
    import json

    table = price_table(plan)
    text = json.dumps(table, separators=(",", ":"))
    if len(text) > MAX_TAG:
        text = json.dumps([{**c, "regions": {}} for c in table], separators=(",", ":"))
    return text
