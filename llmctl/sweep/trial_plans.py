"""A sweep's plan: every trial expanded, composed, validated and planned before anything exists.

``make_sweep_plan`` refuses the whole sweep if any trial is invalid; ``SweepPlan.describe`` is what
``llmctl plan -m`` prints; ``check_budget`` refuses a sweep whose estimated total passes
``--max-cost`` and ``trial_budgets`` splits it into each trial's in-run limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from llmctl.errors import ConfigError
from llmctl.plan.devices import local_gpu_count
from llmctl.sweep import table
from llmctl.tracking.mlflow_run import redact
from workloads.planner.hardware import cpu_cores


def default_max_parallel() -> int:
    """Local: one trial per GPU, else half the CPU cores (at least 1)."""
    return local_gpu_count() or max(1, cpu_cores() // 2)


def gpu_slots(max_parallel: int) -> list[Optional[str]]:
    """``CUDA_VISIBLE_DEVICES`` per concurrent local trial: the GPUs split evenly, else no limit."""
    gpus = local_gpu_count()
    if not gpus or max_parallel > gpus:
        return [None] * max_parallel
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(gpus)]
    per = gpus // max_parallel
    return [",".join(ids[i * per : (i + 1) * per]) for i in range(max_parallel)]


def estimate_cost(plan: Any) -> Optional[float]:
    """Estimated USD for one trial's plan (``planner.make_plan`` fills the estimate); None if unknown.

    ``plan -m`` shows it per trial and in total; ``--max-cost`` refuses sweeps whose total is above
    the limit, and refuses it when a trial has no estimate or runs on unpriced infra (None here).
    """
    est = getattr(plan, "estimate", None)
    return None if est is None or not est.priced else float(est.total_usd)


@dataclass
class Trial:
    index: int
    overrides: list[str]
    plan: Any  # llmctl.plan.job_plan.Plan
    composed: dict[str, Any]  # the composed config, before the backend's planning
    cost: Optional[float] = None

    @property
    def unpriced(self) -> bool:
        """Its infra has no price (Slurm, local GPUs without infra.price_per_gpu_hour): not $0."""
        return self.plan.estimate is not None and not self.plan.estimate.priced


@dataclass
class SweepPlan:
    overrides: list[str]
    trials: list[Trial]
    max_parallel: int
    config_dir: Optional[str] = None
    notes: list[str] = field(default_factory=list)
    search: Optional[dict[str, Any]] = None  # --search random|tpe: sampler, seed, n_trials, prune, space

    @property
    def n_trials(self) -> int:
        return int(self.search["n_trials"]) if self.search else len(self.trials)

    @property
    def total_cost(self) -> Optional[float]:
        """A search's total: its costliest checked trial times --trials (the sampled ones lie between)."""
        total = table.total_cost([t.cost for t in self.trials])
        if self.search and total is not None:
            return max(float(t.cost or 0.0) for t in self.trials) * self.n_trials
        return total

    def varying(self) -> list[str]:
        return table.varying([t.overrides for t in self.trials])

    def trial_budgets(self, max_cost: Optional[float]) -> list[Optional[float]]:
        """Each trial's share of ``--max-cost`` for its in-run guard, in proportion to its estimate
        (equal shares when the estimates are all $0): together they never pass the sweep's limit."""
        if max_cost is None or self.total_cost is None:
            return [None] * len(self.trials)
        if self.search:
            return [max_cost / self.n_trials] * len(self.trials)
        if self.total_cost <= 0:
            return [max_cost / len(self.trials)] * len(self.trials)
        return [max_cost * float(t.cost or 0.0) / self.total_cost for t in self.trials]

    def fixed(self) -> list[str]:
        varying = set(self.varying())
        return [o for o in self.trials[0].overrides if o.partition("=")[0] not in varying] if self.trials else []

    def describe(self) -> str:
        first = self.trials[0].plan
        head = f"# sweep: {len(self.trials)} trial(s), up to {self.max_parallel} at once"
        if self.search:
            s = self.search
            prune = s["prune"] + (f" from step {s['grace_steps']}" if s["prune"] != "none" else "")
            head = (
                f"# sweep: {s['sampler']} search, {self.n_trials} trial(s) (seed {s['seed']}, prune {prune}),"
                f" up to {self.max_parallel} at once"
            )
        lines = [head, f"fixed:       {' '.join(self.fixed()) or '(none)'}"]
        if self.search:
            lines.append(f"search:      {' '.join(self.search['searched'])}")
        lines += [
            f"where:       {first.where}",
            f"tracking:    {redact(first.tracking_uri)} (experiment '{first.cfg['tracking']['experiment']}')",
            "",
        ]
        if self.search:
            lines.append("checked before launch (each searched key at its ends or choices):")
        keys = self.varying()
        rows = [trial_row(t, keys) for t in self.trials]
        header = ["#", *keys, "procs", "device", "tokens", "est. cost"]
        lines.append(table.render(header, [[str(t.index), *r] for t, r in zip(self.trials, rows)]))
        unpriced = any(t.unpriced for t in self.trials)
        if self.search:
            lines += ["", f"first proposals (seed {self.search['seed']}):"]
            lines += [f"  trial {i}: {' '.join(p)}" for i, p in enumerate(self.search["first"])]
            lines += [
                "",
                f"total:       {self.n_trials} trials, estimated cost"
                f" {table.fmt_cost(self.total_cost, unpriced)} (the costliest checked trial x --trials)",
            ]
        else:
            tokens = sum(_tokens(t.plan.cfg) for t in self.trials)
            lines += [
                "",
                f"total:       {len(self.trials)} trials, {tokens:,} tokens,"
                f" estimated cost {table.fmt_cost(self.total_cost, unpriced)}"
                + ("" if self.total_cost is not None or unpriced else " (no cost estimator yet)"),
            ]
        lines += [f"refused:     `llmctl launch -m` will refuse: {r}" for r in first.refusals]
        lines += [f"note:        {n}" for n in self.notes]
        return "\n".join(lines)


def _tokens(cfg: dict[str, Any]) -> int:
    t = cfg["train"]
    return int(t["steps"] * t["batch_size"] * t["seq_len"])


def trial_row(t: Trial, keys: Optional[list[str]] = None) -> list[str]:
    keys = keys if keys is not None else []
    p = t.plan
    return [
        *table.values(t.overrides, keys),
        str(p.world_size),
        p.device,
        f"{_tokens(p.cfg):,}",
        table.fmt_cost(t.cost, t.unpriced),
    ]


def make_sweep_plan(
    overrides: list[str],
    config_dir: Optional[str] = None,
    max_parallel: Optional[int] = None,
    search: str = "grid",
    n_trials: Optional[int] = None,
    prune: str = "none",
    seed: Optional[int] = None,
) -> SweepPlan:
    """Expand, compose, validate and plan every trial; any invalid trial refuses the whole sweep.

    A search (``random``/``tpe``) plans the trials at the ends of its space (``search.probe_overrides``)
    and records the space and seed; its trials are sampled while it runs.
    """
    from llmctl.config.compose import Composed
    from llmctl.plan.make import make_plan
    from llmctl.sweep.expand import SweepConfigError, TrialError, compose_trials, expand

    if max_parallel is not None and max_parallel < 1:
        raise ConfigError(f"--max-parallel {max_parallel}: must be at least 1")
    from llmctl.sweep import search as searching

    searching.check_options(search, n_trials, prune)
    parallel = max_parallel or default_max_parallel()
    info: Optional[dict[str, Any]] = None
    if search == "grid":
        trial_overrides = expand(overrides, config_dir)
    else:
        space = searching.parse_space(overrides, config_dir)
        trial_overrides = searching.probe_overrides(space)
        seed = seed if seed is not None else int.from_bytes(os.urandom(3), "big")
        first = searching.first_proposals(search, seed, space, int(n_trials or 1))
        info = {
            "sampler": search,
            "seed": seed,
            "n_trials": n_trials,
            "prune": prune,
            "space": searching.space_to_json(space),
            "searched": [o for o in overrides if _key(o) in space.dists],
            "first": [[searching.as_override(k, p[k]) for k in space.dists] for p in first],
        }
    composed = compose_trials(trial_overrides, config_dir)
    if info is not None:  # the probes hold both ends of a searched train.steps
        info["grace_steps"] = min(searching.grace_steps(c.cfg) for c in composed)
    slot = gpu_slots(parallel)[0]
    trials: list[Trial] = []
    errors: list[TrialError] = []
    with _visible_gpus(slot), _history_cache():
        for i, c in enumerate(composed):
            try:
                plan = make_plan(Composed(cfg=c.cfg, choices=c.choices, overrides=c.overrides, typed=c.typed))
            except ConfigError as exc:
                errors.append(TrialError(i, c.overrides, str(exc)))
                continue
            trials.append(Trial(index=i, overrides=c.overrides, plan=plan, composed=c.cfg, cost=estimate_cost(plan)))
    if errors:
        raise SweepConfigError(errors, len(composed))
    stores = {(t.plan.tracking_uri, t.plan.cfg["tracking"]["experiment"]) for t in trials}
    if len(stores) > 1:
        raise ConfigError(
            "tracking.uri and tracking.experiment must be the same for every trial of a sweep"
            " (the trials are children of one MLflow run)"
        )
    sp = SweepPlan(overrides=list(overrides), trials=trials, max_parallel=parallel, config_dir=config_dir, search=info)
    if slot is not None:
        sp.notes.append(f"each trial gets {len(slot.split(','))} GPU(s) (CUDA_VISIBLE_DEVICES per trial)")
    if any(t.plan.backend != "local" for t in trials):
        sp.notes.append("non-local trials each launch through their backend; --max-parallel caps how many at once")
    return sp


class _history_cache:
    """Trials of one shape share one cost-history lookup (an MLflow query per trial would grow with the sweep).

    ``planner.estimate_for`` asks ``llmctl.cost.history.find`` for earlier runs of the trial's shape; within one
    planning pass the answer for the same arguments is the same, so it is memoized here and the
    original restored afterwards.
    """

    def __enter__(self) -> None:
        try:
            from llmctl.cost import history
        except ImportError:
            self.history = None
            return
        self.history, self.original, cache = history, history.find, {}

        def find(uri: str, shape: str, accelerator: str, cfg: Any, tc: Any = None) -> Any:
            key = (uri, shape, accelerator, cfg["infra"]["nodes"], cfg["train"]["batch_size"])
            if key not in cache:
                cache[key] = self.original(uri, shape, accelerator, cfg, tc)
            return cache[key]

        history.find = find

    def __exit__(self, *exc: Any) -> None:
        if self.history is not None:
            self.history.find = self.original


class _visible_gpus:
    """Plan under the GPU slot a trial will get, so the plan's process count is the real one."""

    def __init__(self, value: Optional[str]):
        self.value, self.saved = value, None

    def __enter__(self) -> None:
        if self.value is not None:
            self.saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = self.value

    def __exit__(self, *exc: Any) -> None:
        if self.value is not None:
            if self.saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = self.saved


def check_budget(sp: SweepPlan, max_cost: Optional[float]) -> str:
    """Refuse a sweep whose estimated total exceeds ``max_cost``, or whose trials could not each get
    their share of it as an in-run guard (a trial with no estimate, or on unpriced infra)."""
    total = sp.total_cost
    if max_cost is None:
        return ""
    unpriced = [t for t in sp.trials if t.unpriced]
    if unpriced:
        names = sorted({t.plan.cfg["infra"]["name"] for t in unpriced})
        raise ConfigError(
            f"--max-cost ${max_cost:,.2f} cannot be enforced: trial(s)"
            f" {', '.join(str(t.index) for t in unpriced)} run on unpriced infra ({', '.join(names)}:"
            " no catalog price, no infra.price_per_gpu_hour), so their spend cannot be tracked;"
            " nothing was launched. Fix: infra.price_per_gpu_hour=<$ per GPU-hour>"
        )
    if total is None:
        missing = [str(t.index) for t in sp.trials if t.cost is None]
        raise ConfigError(
            f"--max-cost ${max_cost:,.2f} cannot be enforced: no cost estimate for trial(s)"
            f" {', '.join(missing)} (see `llmctl plan -m`), so they would run without a budget"
            " guard; nothing was launched"
        )
    if total > max_cost:
        raise ConfigError(
            f"the sweep's estimated cost {table.fmt_cost(total)} exceeds --max-cost ${max_cost:,.2f};"
            " fewer trials, fewer steps or a cheaper infra would fit"
        )
    return (
        f"estimated cost {table.fmt_cost(total)} within --max-cost ${max_cost:,.2f}; each trial stops"
        " after a checkpoint at its share of it"
    )


def plan_text(overrides: list[str], config_dir: Optional[str], max_parallel: Optional[int], **search: Any) -> str:
    return make_sweep_plan(overrides, config_dir, max_parallel, **search).describe()


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")
