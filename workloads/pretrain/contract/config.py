"""Read the trainer's config: one resolved YAML plus ``key=value`` overrides, typed by ``schema``.

``--config run.yaml train.steps=50`` (or overrides alone, over the schema's defaults). Picking
presets (``model=tiny``) is composition, the launcher's job: ``llmctl config show model=tiny >
run.yaml`` writes such a file. Sections a launcher adds (``schema.LAUNCHER_SECTIONS``) are
skipped; any other unknown key, a wrong type or a value ``validate`` refuses is a ``ConfigError``
naming the key. omegaconf, not Hydra: the trainer depends on neither llmctl nor Hydra.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any, Optional, Sequence

from workloads.pretrain.contract import hf_config
from workloads.pretrain.contract.schema import LAUNCHER_SECTIONS, TrainerCfg
from workloads.pretrain.contract.validate import ConfigError, validate

SECTIONS = tuple(f.name for f in fields(TrainerCfg))


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


def load(path: Optional[str], overrides: Sequence[str] = ()) -> Any:
    """A typed (structured) DictConfig of ``TrainerCfg``, validated."""
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
        cfg = OmegaConf.merge(*parts)
        if cfg.model.init_from:  # the checkpoint's config.json decides the shape (and the tokenizer)
            done = hf_config.resolve(plain(cfg))
            cfg = OmegaConf.merge(cfg, {"model": done["model"], "data": done["data"]})
    except (OmegaConfBaseException, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        first = str(exc).splitlines()[0]
        raise ConfigError(f"{first}{f' (in {path})' if path else ''}") from None
    validate(plain(cfg))
    return cfg


def plain(cfg: Any) -> dict[str, Any]:
    """A DictConfig as a plain dict with enums as strings (what ``validate`` reads)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(cfg):
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]
    return cfg


def parse_args(
    parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None, config_required: bool = False
) -> tuple[argparse.Namespace, Any]:
    """Add ``--config PATH [key=value ...]`` to an entry point's parser; returns (args, config)."""
    parser.add_argument("--config", required=config_required, help="resolved config YAML (llmctl writes one per run)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=50")
    args = parser.parse_args(argv)
    return args, load(args.config, args.overrides)
