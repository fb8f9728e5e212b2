"""Read the trainer's config: one resolved YAML plus ``key=value`` overrides, typed by ``schema``.

``--config run.yaml train.steps=50`` (or overrides alone, over the schema's defaults). Picking
presets (``model=tiny``) is composition, the launcher's job: ``llmctl config show model=tiny >
run.yaml`` writes such a file. Sections a launcher adds (``schema.LAUNCHER_SECTIONS``) are
skipped; any other unknown key, a wrong type or a value ``validate`` refuses is a ``ConfigError``
naming the key. omegaconf, not Hydra: the trainer depends on neither llmctl nor Hydra.

Either way in, one object out: ``load`` (the trainer's entry points) and ``typed`` (a plain mapping:
llmctl's composed config, a test's partial dict) both return a ``schema.TrainerCfg`` instance with
enums as members, and everything that reads config reads that.
"""

from __future__ import annotations

import argparse
import enum
import typing
from collections.abc import Mapping
from dataclasses import fields, is_dataclass, replace
from functools import lru_cache
from typing import Any, Optional, Sequence, Union

from workloads.protocol import hf_config
from workloads.protocol.schema import LAUNCHER_SECTIONS, TrainerCfg
from workloads.protocol.validate import ConfigError, validate

SECTIONS = tuple(f.name for f in fields(TrainerCfg))
# what ``typed`` takes: a plain mapping of sections, or a config typed already (returned as it is)
ConfigLike = Union[Mapping[str, Any], TrainerCfg]


def _check_overrides(overrides: Sequence[str]) -> None:
    for raw in overrides:
        key, eq, _ = raw.partition("=")
        if not eq or not key:
            raise ConfigError(f"'{raw}' is not an override: write key=value (e.g. train.steps=50)")
        if key.lstrip("+~") in SECTIONS or key.lstrip("+~") in LAUNCHER_SECTIONS:
            raise ConfigError(
                f"'{raw}': the trainer takes key=value, not presets; compose a config with"
                f" `llmctl config show {raw} > run.yaml`, then --config run.yaml"
            )


def load(path: Optional[str], overrides: Sequence[str] = ()) -> TrainerCfg:
    """The config file at ``path`` (None: the schema's defaults) with ``overrides``, as one
    validated ``TrainerCfg`` instance."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _check_overrides(overrides)
    parts: list[Any] = [OmegaConf.structured(TrainerCfg)]
    if path:
        raw = OmegaConf.to_container(OmegaConf.load(str(path)))
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: not a YAML mapping of config sections ({', '.join(SECTIONS)})")
        parts.append({k: v for k, v in raw.items() if k not in LAUNCHER_SECTIONS})
    try:
        parts.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*parts)
        if merged.model.init_from:  # the checkpoint's config.json decides the shape (and the tokenizer)
            done = hf_config.resolve(OmegaConf.to_container(merged, resolve=True, enum_to_str=True))  # type: ignore[arg-type]
            merged = OmegaConf.merge(merged, {"model": done["model"], "data": done["data"]})
        cfg = OmegaConf.to_object(merged)
    except (OmegaConfBaseException, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        first = str(exc).splitlines()[0]
        raise ConfigError(f"{first}{f' (in {path})' if path else ''}") from None
    assert isinstance(cfg, TrainerCfg)
    validate(cfg)
    return cfg


def parse_args(
    parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None, config_required: bool = False
) -> tuple[argparse.Namespace, TrainerCfg]:
    """Add ``--config PATH [key=value ...]`` to an entry point's parser; returns (args, config)."""
    parser.add_argument("--config", required=config_required, help="resolved config YAML (llmctl writes one per run)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=50")
    args = parser.parse_args(argv)
    return args, load(args.config, args.overrides)


# ----------------------------------------------------------------------------- a plain mapping


def typed(cfg: ConfigLike) -> TrainerCfg:
    """The trainer's typed config from a plain mapping of sections: llmctl's composed config (a
    dict, enums as strings), a test's partial dict, or an OmegaConf config of the same shape.

    The schema's defaults fill whatever is missing; launcher sections (``schema.LAUNCHER_SECTIONS``:
    ``infra``, ``tracking``) are skipped. Enum fields become members, ints are accepted for floats,
    lists and maps are copied. An unknown key or a value of the wrong type is a ``ConfigError``
    naming the key. Not validated (``validate`` does that); no ``model.init_from`` lookup (the
    mapping is already resolved). A ``TrainerCfg`` is returned as it is. Stdlib only.
    """
    if isinstance(cfg, TrainerCfg):
        return cfg
    if not isinstance(cfg, Mapping):
        raise TypeError(f"typed() takes a mapping of config sections, not {type(cfg).__name__}")
    unknown = [str(k) for k in cfg if k not in SECTIONS and k not in LAUNCHER_SECTIONS]
    if unknown:
        raise ConfigError(f"Unknown config section(s) {', '.join(unknown)}: the trainer reads {', '.join(SECTIONS)}")
    sections = {}
    for f in fields(TrainerCfg):
        part = cfg.get(f.name)
        section_type = _hints(TrainerCfg)[f.name]
        if isinstance(part, section_type):
            sections[f.name] = part
            continue
        if part is not None and not isinstance(part, Mapping):
            raise ConfigError(f"Bad value for '{f.name}': a section is a mapping of keys, got {part!r}")
        sections[f.name] = _section(section_type, f.name, part or {})
    return TrainerCfg(**sections)


def with_values(tc: TrainerCfg, section: str, **values: Any) -> TrainerCfg:
    """``tc`` with keys of one section changed (``with_values(tc, "parallel", tp=2)``), each value
    typed as its field is: what a launcher resolves after composing (the mesh, a checkpoint folder)
    changes the typed view it already holds, without typing the whole config again. Launcher
    sections are not part of it: ``tc`` comes back as it is."""
    if section in LAUNCHER_SECTIONS:
        return tc
    part = getattr(tc, section)
    section_type: type = type(part)
    hints = _hints(section_type)
    unknown = [k for k in values if k not in hints]
    if unknown:
        names = ", ".join(f"{section}.{k}" for k in unknown)
        raise ConfigError(f"Unknown key(s) {names}: {section} has {', '.join(hints)}")
    changed = {k: _coerce(f"{section}.{k}", hints[k], v) for k, v in values.items()}
    return replace(tc, **{section: replace(part, **changed)})


def _section(cls: type, name: str, part: Mapping[str, Any]) -> Any:
    hints = _hints(cls)
    unknown = [str(k) for k in part if k not in hints]
    if unknown:
        raise ConfigError(f"Unknown key(s) {', '.join(f'{name}.{k}' for k in unknown)}: {name} has {', '.join(hints)}")
    return cls(**{k: _coerce(f"{name}.{k}", hints[k], part[k]) for k in part})


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    """A schema dataclass's field types, resolved (the module writes them as strings)."""
    return typing.get_type_hints(cls)


def _coerce(key: str, hint: Any, value: Any) -> Any:
    """``value`` as the field type ``hint`` holds it, or a ConfigError naming ``key``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if isinstance(hint, type) and is_dataclass(hint):  # a nested group of keys (model.lora)
        if isinstance(value, hint):
            return value
        if isinstance(value, Mapping):
            return _section(hint, key, value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            options = "|".join(m.value for m in hint)
            raise ConfigError(f"Bad value for '{key}': {value!r} is not one of {options}") from None
    if origin is list and isinstance(value, Sequence) and not isinstance(value, str):
        return list(value)
    if origin is dict and isinstance(value, Mapping):
        return dict(value)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint in (bool, str) and isinstance(value, hint):
        return value
    what = getattr(hint, "__name__", str(hint)) if origin is None else str(hint).replace("typing.", "")
    raise ConfigError(f"Bad value for '{key}': expected {what}, got {value!r}")
