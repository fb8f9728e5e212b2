"""Search sweeps (``--search random|tpe``): Hydra's Optuna sweeper grammar, Optuna's samplers and pruners.

A searched key is read as Hydra's Optuna sweeper reads it (``create_optuna_distribution_from_override``
in hydra-optuna-sweeper; tests compare against it): ``choice(a,b)`` / ``a,b`` → categorical,
``range(a,b[,step])`` → integers a..b *with b included* (that sweeper's reading), ``interval(a,b)`` →
uniform, ``tag(log, interval(a,b))`` → log-uniform; int bounds give int distributions. The study lives
in Optuna's RDB storage, a sqlite file in the sweep's directory, so a restarted supervisor continues
the same study; trial ``i`` of the sweep is Optuna's trial number ``i``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from llmctl.errors import ConfigError

SEARCHES = ("grid", "random", "tpe")
PRUNERS = ("none", "median", "asha")
STUDY_FILE = "optuna.db"


@dataclass
class Space:
    fixed: list[str]  # key=value overrides every trial gets
    dists: "OrderedDict[str, Any]"  # searched key -> Optuna distribution, in the order given


def distribution(raw: str, ov: Any) -> Any:
    """The Optuna distribution for one parsed sweep override (as Hydra's Optuna sweeper builds it)."""
    from hydra.core.override_parser.types import Transformer, ValueType
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = ov.value()
    glob = ov.value_type == ValueType.GLOB_CHOICE_SWEEP
    if ov.is_choice_sweep() or glob:
        choices = list(ov.sweep_string_iterator() if glob else ov.sweep_iterator(transformer=Transformer.encode))
        if not choices:
            raise ConfigError(f"'{raw}' has no values to choose from")
        return CategoricalDistribution(choices)
    if ov.is_range_sweep():
        if value.shuffle:
            return CategoricalDistribution(list(ov.sweep_iterator(transformer=Transformer.encode)))
        if any(isinstance(x, float) for x in (value.start, value.stop, value.step)):
            return FloatDistribution(value.start, value.stop, step=value.step)
        return IntDistribution(int(value.start), int(value.stop), step=int(value.step))
    if ov.is_interval_sweep():
        log = "log" in value.tags
        if value.start >= value.end or (log and value.start <= 0):
            raise ConfigError(f"'{raw}': an interval needs low < high{' and low > 0 (log)' if log else ''}")
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(float(value.start), float(value.end), log=log)
    raise ConfigError(f"'{raw}': not a search the Optuna sweeper knows (choice, range, interval, tag(log, ...))")


def parse_space(overrides: list[str], config_dir: Optional[str] = None) -> Space:
    """Split overrides into fixed ones and searched keys; a key given twice keeps its last value."""
    from llmctl.sweep.expand import parse

    fixed: "OrderedDict[str, str]" = OrderedDict()
    dists: "OrderedDict[str, Any]" = OrderedDict()
    for raw, ov in zip(overrides, parse(overrides, config_dir)):
        key = ov.get_key_element()
        fixed.pop(key, None)
        dists.pop(key, None)
        if ov.is_sweep_override():
            dists[key] = distribution(raw, ov)
        else:
            fixed[key] = f"{key}={ov.get_value_element_as_str()}"
    if not dists:
        raise ConfigError(
            "--search random|tpe needs at least one searched key, e.g."
            " 'train.lr=tag(log, interval(1e-4, 1e-2))' or train.warmup_steps=choice(0,10)"
        )
    return Space(list(fixed.values()), dists)


def as_override(key: str, value: Any) -> str:
    """``key=value`` in Hydra's grammar (choice values are already encoded strings)."""
    if value is None:
        return f"{key}=null"
    if isinstance(value, float):
        return f"{key}={value!r}"
    return f"{key}={value}"


def probe_overrides(space: Space) -> list[list[str]]:
    """Trials checked and priced before launch: each searched key at each end (or choice) in turn,
    the others at their first; a sampled value lies between them, so a config error shows here."""
    first = {k: _ends(d)[0] for k, d in space.dists.items()}
    probes: list[list[str]] = []
    for key, dist in space.dists.items():
        for v in _ends(dist):
            trial = space.fixed + [as_override(k, v if k == key else first[k]) for k in space.dists]
            if trial not in probes:
                probes.append(trial)
    return probes


def _ends(dist: Any) -> list[Any]:
    from optuna.distributions import CategoricalDistribution

    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    return [dist.low, dist.high]


def space_to_json(space: Space) -> dict[str, Any]:
    from optuna.distributions import distribution_to_json

    return {"fixed": space.fixed, "dists": {k: distribution_to_json(d) for k, d in space.dists.items()}}


def space_from_json(data: dict[str, Any]) -> Space:
    from optuna.distributions import json_to_distribution

    return Space(list(data["fixed"]), OrderedDict((k, json_to_distribution(v)) for k, v in data["dists"].items()))


def check_options(search: str, n_trials: Optional[int], prune: str) -> None:
    """Refuse option combinations that cannot mean anything, naming the fix."""
    if search not in SEARCHES:
        raise ConfigError(f"--search {search}: use one of {', '.join(SEARCHES)}")
    if prune not in PRUNERS:
        raise ConfigError(f"--prune {prune}: use one of {', '.join(PRUNERS)}")
    if search == "grid":
        if n_trials is not None:
            raise ConfigError("--trials is for --search random|tpe; a grid runs every combination. Fix: --search tpe")
        if prune != "none":
            raise ConfigError(f"--prune {prune} needs a search that is told the results. Fix: --search tpe")
        return
    if n_trials is None or n_trials < 1:
        raise ConfigError(f"--search {search} needs --trials N (N >= 1): how many trials to run")


# ----------------------------------------------------------------------------- the study


def startup_trials(kind: str, n_trials: int) -> int:
    """Trials TPE samples at random before it models the results: a quarter of the budget (2 to
    Optuna's default 10), so a small budget is not spent at random. Random: all of them."""
    return n_trials if kind == "random" else max(2, min(10, n_trials // 4))


def sampler(kind: str, seed: int, n_trials: int) -> Any:
    """Optuna's sampler; TPE with ``constant_liar`` so trials asked while others run spread out."""
    import optuna

    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials(kind, n_trials), constant_liar=True)


def grace_steps(cfg: Any) -> int:
    """The first step a pruner may judge a trial at: a quarter of its steps, and never before its first
    val step after step 0. Earlier, ``val/loss`` mostly tells which trial has the shorter warm-up
    (Optuna's ``min_resource="auto"`` put ASHA's first rung at step 1 of a 12-step trial)."""
    t = cfg["train"]
    return max(1, int(t["val_every"]) or int(t["steps"]), int(t["steps"]) // 4)


def pruner(kind: str, grace: Optional[int] = None) -> Any:
    """``grace``: ``grace_steps`` of the sweep's shortest trial (None: a sweep launched before it was
    recorded, which keeps Optuna's defaults)."""
    import optuna

    if kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=grace or 0)
    if kind == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=grace or "auto")
    return optuna.pruners.NopPruner()


def storage_url(d: Path) -> str:
    return f"sqlite:///{d / STUDY_FILE}"


def study(spec: dict[str, Any], d: Path, create: bool = False) -> Any:
    """The sweep's study in RDB storage (created once, at launch; loaded by every supervisor)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s = spec["search"]
    storage = optuna.storages.RDBStorage(storage_url(d), engine_kwargs={"connect_args": {"timeout": 60}})
    kwargs = dict(
        study_name=spec["sweep_id"],
        storage=storage,
        pruner=pruner(s["prune"], s.get("grace_steps")),
        sampler=sampler(s["sampler"], int(s["seed"]), int(s["n_trials"])),
    )
    if create:
        return optuna.create_study(direction="minimize" if spec["mode"] == "min" else "maximize", **kwargs)
    st = optuna.load_study(**kwargs)
    asked = len(st.get_trials(deepcopy=False))
    if asked:  # a restarted supervisor: a sampler seeded as at launch would propose its first trials again
        st.sampler = sampler(s["sampler"], restart_seed(int(s["seed"]), asked), int(s["n_trials"]))
    return st


def restart_seed(seed: int, asked: int) -> int:
    """The sampler's seed for a supervisor restarted after ``asked`` trials: reproducible, and not the
    launch seed (Optuna cannot save a sampler's random state in its storage)."""
    return (seed + 1_000_003 * asked) % 2**32


def first_proposals(search: str, seed: int, space: Space, n_trials: int, mode: str = "min") -> list[dict[str, Any]]:
    """What a fresh study with this sampler and seed asks first: its random startup trials, which
    no result changes (at most 4 are shown)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    st = optuna.create_study(
        sampler=sampler(search, seed, n_trials), direction="minimize" if mode == "min" else "maximize"
    )
    n = min(4, startup_trials(search, n_trials))
    return [st.ask(fixed_distributions=dict(space.dists)).params for _ in range(n)]


def importance(st: Any) -> dict[str, float]:
    """Optuna's parameter importances (fANOVA) over the completed trials; {} when too few."""
    import optuna

    try:
        return {k: float(v) for k, v in optuna.importance.get_param_importances(st).items()}
    except (RuntimeError, ValueError):  # fewer than two completed trials, or one value only
        return {}


def history_figure(st: Any) -> Any:
    """Optuna's optimization-history plot (matplotlib, which mlflow depends on), as a figure."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    from optuna.visualization.matplotlib import plot_optimization_history

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental" notice
        return plot_optimization_history(st).figure
