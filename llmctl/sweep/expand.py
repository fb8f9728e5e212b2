"""Hydra ``-m`` sweeps: expand override strings into trials, then compose every trial fast.

Expansion follows Hydra 1.3's basic sweeper exactly (``BasicSweeper.split_arguments``): each
override is parsed by Hydra's own grammar; a choice list (``a,b``, ``choice(a,b)``), ``range(...)``
or ``glob(...)`` expands to its values as strings, a plain override stays as written; a key given
twice keeps the last value at the first position; the trials are the cartesian product in the
order the keys were given. Continuous sweeps (``interval(...)``) are refused, as the basic sweeper
refuses them.

A Hydra composition per trial makes large sweeps slow to plan (benchmarks/sweep_plan.py).
Trials that pick the same config-group options
share one Hydra composition; each trial's value overrides are then applied to a copy of it the way
Hydra applies command-line overrides after composing the defaults (``OmegaConf.update`` on the
typed, struct-mode config), so every schema type check still runs. Tests compare a sample against
``config.compose`` of the same overrides.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from llmctl.config.compose import GROUPS, SCHEMA_NAME, Composed, parse_overrides, search_dirs
from llmctl.errors import ConfigError


@dataclass
class TrialError:
    index: int
    overrides: list[str]
    message: str


class SweepConfigError(ConfigError):
    """One or more trials are invalid; ``errors`` has each, in trial order."""

    def __init__(self, errors: list[TrialError], total: int):
        self.errors = errors
        lines = [f"{len(errors)} of {total} trial(s) are invalid; nothing was launched:"]
        lines += [f"  trial {e.index} ({' '.join(e.overrides)}): {e.message}" for e in errors]
        super().__init__("\n".join(lines))


def config_loader(config_dir: Optional[str] = None) -> Any:
    """A Hydra config loader over llmctl's search path (``glob()`` lists group options through it)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path

    dirs = search_dirs(config_dir)
    csp = create_config_search_path(str(dirs[-1]))
    for d in dirs[:-1]:
        csp.prepend("llmctl-user", f"file://{d}")
    return ConfigLoaderImpl(config_search_path=csp)


def _parser(config_dir: Optional[str]) -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create(config_loader=config_loader(config_dir))


def parse(overrides: list[str], config_dir: Optional[str] = None) -> list[Any]:
    """Hydra ``Override`` objects; ``glob()`` sees the user's config dir too."""
    return parse_overrides(overrides, _parser(config_dir))


def expand(overrides: list[str], config_dir: Optional[str] = None) -> list[list[str]]:
    """The trials Hydra's basic sweeper would run for these overrides, as override lists."""
    from hydra.errors import HydraException

    per_key: "OrderedDict[str, list[str]]" = OrderedDict()
    for raw, ov in zip(overrides, parse(overrides, config_dir)):
        key = ov.get_key_element()
        if not ov.is_sweep_override():
            per_key[key] = [f"{key}={ov.get_value_element_as_str()}"]
            continue
        if not ov.is_discrete_sweep():
            raise ConfigError(
                f"'{raw}': {ov.value_type.name.lower()} sweeps have no list of values;"
                " a grid (--search grid, the default) runs choice lists (a,b), range(start,stop[,step])"
                " and glob(...). Fix: --search tpe --trials N (or --search random) samples it"
            )
        try:
            values = list(ov.sweep_string_iterator())
        except HydraException as exc:
            raise ConfigError(f"'{raw}': {exc}") from None
        if not values:
            raise ConfigError(f"'{raw}' expands to no values (empty range or glob with no match)")
        per_key[key] = [f"{key}={v}" for v in values]
    return [list(t) for t in itertools.product(*per_key.values())]


def is_sweep(overrides: list[str], config_dir: Optional[str] = None) -> bool:
    return any(ov.is_sweep_override() for ov in parse(overrides, config_dir))


def _is_group(ov: Any) -> bool:
    return ov.key_or_group in GROUPS or ov.package is not None


class _Composer:
    """One Hydra context for many compositions; bases cached by their group overrides."""

    def __init__(self, config_dir: Optional[str]):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from llmctl.config.compose import _register_schema

        self.config_dir = config_dir
        self.dirs = search_dirs(config_dir)
        self.parser = OverridesParser.create()
        self.parsed: dict[str, Any] = {}
        self.checked: dict[str, Optional[str]] = {}
        self.bases: dict[tuple[str, ...], Any] = {}
        _register_schema()

    def parse_one(self, raw: str) -> Any:
        if raw not in self.parsed:
            self.parsed[raw] = self.parser.parse_overrides([raw])[0]
        return self.parsed[raw]

    def check(self, raw: str) -> None:
        """config._check_override once per distinct string (schema keys, group options)."""
        from llmctl.config.compose import _check_override

        if raw not in self.checked:
            ov = self.parse_one(raw)
            try:
                _check_override(raw, ov.key_or_group, ov.is_add(), ov.is_delete(), ov.value(), self.config_dir)
                self.checked[raw] = None
            except ConfigError as exc:
                self.checked[raw] = str(exc)
        if self.checked[raw] is not None:
            raise ConfigError(self.checked[raw])

    def base(self, group_overrides: tuple[str, ...], all_overrides: list[str]) -> tuple[Any, dict[str, Any]]:
        """The composed DictConfig (no hydra node, struct mode) and the group choices."""
        if group_overrides not in self.bases:
            from hydra import compose as hydra_compose
            from hydra.errors import HydraException
            from omegaconf import OmegaConf
            from omegaconf.errors import OmegaConfBaseException

            from llmctl.config.compose import _translate, open_dict

            extra = list(group_overrides)
            if len(self.dirs) > 1:
                extra.append("hydra.searchpath=[" + ",".join(f"file://{d}" for d in self.dirs[:-1]) + "]")
            try:
                cfg = hydra_compose("config", overrides=extra, return_hydra_config=True)
                choices = dict(OmegaConf.to_container(cfg.hydra.runtime.choices))
                with open_dict(cfg):
                    del cfg["hydra"]
                choices = {k: v for k, v in choices.items() if not k.startswith("hydra") and k != SCHEMA_NAME}
                self.bases[group_overrides] = (cfg, choices)
            except (HydraException, OmegaConfBaseException, ValueError) as exc:
                self.bases[group_overrides] = _translate(exc, all_overrides)
        result = self.bases[group_overrides]
        if isinstance(result, ConfigError):
            raise ConfigError(str(result))
        return result

    def compose(self, overrides: list[str]) -> Composed:
        """Equal to ``config.compose(overrides)``, reusing the base of the same group choices."""
        from hydra.errors import ConfigCompositionException
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        from llmctl.config.compose import _translate, free_form
        from llmctl.config.launcher_checks import validate

        for raw in overrides:
            self.check(raw)
        parsed = [self.parse_one(raw) for raw in overrides]
        groups = tuple(raw for raw, ov in zip(overrides, parsed) if _is_group(ov))
        base, choices = self.base(groups, overrides)
        cfg = copy.deepcopy(base)
        try:
            for ov in parsed:  # as Hydra's ConfigLoaderImpl._apply_overrides_to_config, after defaults
                if _is_group(ov):
                    continue
                try:
                    # a user program's own flag (``workload.args.*``) is added, as ``++`` does
                    add = free_form(ov.key_or_group)
                    OmegaConf.update(cfg, ov.key_or_group, ov.value(), merge=True, force_add=add)
                except OmegaConfBaseException as exc:
                    raise ConfigCompositionException(f"Error merging override {ov.input_line}") from exc
            resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True, enum_to_str=True)
        except (ConfigCompositionException, OmegaConfBaseException, ValueError) as exc:
            raise _translate(exc, overrides) from None
        composed = Composed(cfg=resolved, choices=dict(choices), overrides=list(overrides))
        validate(composed.cfg, composed.typed)
        return composed


def compose_trials(trials: list[list[str]], config_dir: Optional[str] = None) -> list[Composed]:
    """Compose and validate every trial; raise SweepConfigError listing every invalid one."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    composer = _Composer(config_dir)
    results: list[Composed] = []
    errors: list[TrialError] = []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(composer.dirs[-1]), version_base="1.3"):
            for i, overrides in enumerate(trials):
                try:
                    results.append(composer.compose(overrides))
                except ConfigError as exc:
                    errors.append(TrialError(i, overrides, str(exc)))
    finally:
        GlobalHydra.instance().clear()
    if errors:
        raise SweepConfigError(errors, len(trials))
    return results


def iter_hydra_oracle(overrides: list[str], config_dir: Optional[str] = None) -> Iterator[list[str]]:
    """Hydra's own job list (private ``BasicSweeper.split_arguments``): the reference in tests."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    batches = BasicSweeper.split_arguments(_parser(config_dir).parse_overrides(overrides), None)
    yield from batches[0]
