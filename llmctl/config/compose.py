"""Compose and validate configs: Hydra overrides in, one typed, resolved config out.

Hydra's own errors name the problem but not always the fix, and some mistakes (``+new_key``)
pass silently. So overrides are checked against the schema first, with did-you-mean
suggestions and option lists, and Hydra's remaining errors are translated into one line.
Hydra and omegaconf are imported inside functions: the CLI's ``--help`` must not pay for them.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, cast

from llmctl.config import root_schema as schema
from llmctl.errors import ConfigError

GROUPS = ("model", "data", "train", "parallel", "infra", "workload", "experiment")
SCHEMA_NAME = "llmctl_schema"


@dataclass
class Composed:
    """A resolved config (plain dict, schema-complete) and the group options that built it."""

    cfg: dict[str, Any]
    choices: dict[str, Optional[str]] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    # the trainer's typed view of ``cfg`` (``workloads.protocol.config.typed``): made once, here, and
    # passed on with the config (the plan, the estimate, the memory plan read it, none re-types it)
    typed: Any = None

    def __post_init__(self) -> None:
        if self.typed is None:
            from workloads.protocol import validate as trainer
            from workloads.protocol.config import typed

            try:
                self.typed = typed(self.cfg)
            except trainer.ConfigError as exc:
                raise ConfigError(str(exc)) from None


def conf_dir() -> Path:
    """The bundled config tree: inside the package in a wheel, beside it in a clone."""
    here = Path(__file__).resolve().parent.parent  # the llmctl package
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise ConfigError(f"llmctl's config tree was not found next to {here} (broken install?)")


def search_dirs(extra_dir: Optional[str] = None) -> list[Path]:
    """Config directories in priority order: a user's ``--config-dir`` first, then the bundled tree."""
    dirs = [conf_dir()]
    if extra_dir:
        user = Path(extra_dir).expanduser().resolve()
        if not user.is_dir():
            raise ConfigError(f"--config-dir {extra_dir}: no such directory")
        dirs.insert(0, user)
    return dirs


def group_options(group: str, extra_dir: Optional[str] = None) -> list[str]:
    """Names a config group offers, read from the directories (no Hydra import: used by completion)."""
    names: set[str] = set()
    for d in search_dirs(extra_dir):
        gdir = d / group
        if gdir.is_dir():
            names.update(p.stem for p in gdir.glob("*.yaml"))
    return sorted(names)


def _did_you_mean(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def _field_type_name(dotted: str) -> str:
    """What a schema key accepts, in words, for the 'Fix:' part of a message."""
    node: Any = schema.RootCfg
    type_name = ""
    for part in dotted.split("."):
        fld = {f.name: f for f in dataclasses.fields(node)}.get(part) if dataclasses.is_dataclass(node) else None
        if fld is None:
            return "value"
        type_name = str(fld.type)
        node = fld.default_factory
    base = type_name.removeprefix("Optional[").removesuffix("]")
    enum_cls = getattr(schema, base, None)
    if isinstance(enum_cls, type) and issubclass(enum_cls, enum.Enum):
        return "|".join(enum_cls.__members__)
    return {"int": "integer", "float": "number", "bool": "true|false", "str": "string"}.get(base, "value")


def _check_override(raw: str, key: str, is_add: bool, is_delete: bool, value: Any, extra_dir: Optional[str]) -> None:
    """Refuse overrides the schema does not know, before Hydra gets a chance to accept them."""
    if not key:
        raise ConfigError(f"'{raw}' has no key: write key=value (e.g. train.steps=50)")
    top = key.split(".")[0].split("@")[0]
    if key in GROUPS:
        if is_delete and key != "experiment":
            raise ConfigError(
                f"'{raw}': the config group '{key}' cannot be removed; pick an option: "
                + ", ".join(group_options(key, extra_dir))
            )
        options = group_options(key, extra_dir)
        if key == "experiment" and is_delete:  # ~experiment: no preset
            return
        if key == "experiment" and value is None:
            raise ConfigError(f"'{raw}': to run without an experiment preset, write ~experiment")
        if not isinstance(value, str):
            raise ConfigError(f"'{raw}': {key} is a config group; pick one of: {', '.join(options)}")
        if value not in options:
            raise ConfigError(
                f"Unknown {key} '{value}' in '{raw}'."
                f"{_did_you_mean(value, options)} Options for {key}: {', '.join(options)}"
            )
        return
    if top == "hydra":
        raise ConfigError(f"'{raw}': hydra.* settings are managed by llmctl and cannot be overridden")
    if free_form(key):  # a user program's own flags and environment: any name
        return
    known = schema.schema_keys()
    if key not in known:
        hint = _did_you_mean(key, known)
        if is_add:
            raise ConfigError(
                f"'{raw}' adds the key '{key}', which llmctl's schema does not have."
                f"{hint} Extra keys are refused so typos cannot pass silently."
            )
        raise ConfigError(f"Unknown key '{key}' in '{raw}'.{hint} Run 'llmctl config show' to see every key.")
    if is_add:
        raise ConfigError(f"'{raw}': '{key}' already exists; set it without '+': {key}=...")
    if is_delete:
        raise ConfigError(f"'{raw}': schema keys cannot be deleted; set '{key}' to a value instead")
    if key in ("model", "data", "train", "parallel", "infra", "checkpoint", "tracking"):
        raise ConfigError(f"'{raw}': '{key}' is a section; set one of its keys, e.g. {key}.<key>=...")


# Keys under these are the user's own names (``workload=command``'s flags and environment)
FREE_FORM = ("workload.args.", "workload.env.")


def free_form(key: str) -> bool:
    """Whether ``key`` names one of a user program's own flags or variables (``FREE_FORM``)."""
    return key.startswith(FREE_FORM) and len(key.split(".")) == 3


def hydra_form(raw: str) -> str:
    """An override as Hydra takes it: a free-form key is added or set (``++``), since the schema
    cannot list a user's flag names."""
    key = raw.split("=", 1)[0]
    return "++" + raw if free_form(key) else raw


def parse_overrides(overrides: list[str], parser: Any = None) -> list[Any]:
    """Hydra ``Override`` objects, one per string; syntax errors become one-line ConfigErrors."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = parser or OverridesParser.create()
    parsed = []
    for raw in overrides:
        if "=" not in raw and not raw.startswith("~"):
            raise ConfigError(f"'{raw}' is not an override: write key=value (e.g. train.steps=50)")
        try:
            parsed.extend(parser.parse_overrides([raw]))
        except OverrideParseException as exc:
            detail = str(exc).splitlines()[-1] if str(exc) else "syntax error"
            raise ConfigError(
                f"Cannot parse override '{raw}': {detail}. Quote values with special characters, e.g. key='a b'"
            ) from None
    return parsed


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=schema.RootCfg)


def _translate(exc: BaseException, overrides: list[str]) -> ConfigError:
    """Turn a Hydra/omegaconf composition error into one line naming the key and the fix."""
    chain = [exc]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    text = " ".join(str(e) for e in chain)
    full_key = None
    for e in chain:
        full_key = getattr(e, "full_key", None) or full_key
    if full_key is None:
        for raw in overrides:
            k = raw.lstrip("+~").split("=")[0]
            if f"'{k}" in text or f"override {raw}" in text:
                full_key = k
    first = str(chain[-1]).splitlines()[0] if str(chain[-1]) else type(chain[-1]).__name__
    given = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=")[0] == full_key), None)
    if full_key and given is not None and "is not a ListConfig" in text:  # one item given bare
        return ConfigError(f"Bad value for '{full_key}': a list is expected. Fix: {full_key}=[{given}]")
    if full_key:
        return ConfigError(f"Bad value for '{full_key}': {first}. Fix: {full_key}=<{_field_type_name(full_key)}>")
    return ConfigError(f"Invalid configuration: {first}")


def compose(overrides: Optional[list[str]] = None, config_dir: Optional[str] = None) -> Composed:
    """Compose ``conf/config.yaml`` with overrides; validate; return a plain resolved dict."""
    overrides = list(overrides or [])
    parsed = parse_overrides(overrides)
    for raw, ov in zip(overrides, parsed):
        if ov.is_sweep_override():
            raise ConfigError(f"'{raw}' is a sweep; run it with -m (multirun)")
        _check_override(raw, ov.key_or_group, ov.is_add(), ov.is_delete(), ov.value(), config_dir)

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _register_schema()
    dirs = search_dirs(config_dir)
    hydra_overrides = [hydra_form(o) for o in overrides]
    if len(dirs) > 1:
        hydra_overrides.append("hydra.searchpath=[" + ",".join(f"file://{d}" for d in dirs[:-1]) + "]")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(dirs[-1]), version_base="1.3"):
            cfg = hydra_compose("config", overrides=hydra_overrides, return_hydra_config=True)
            choices = cast(dict, OmegaConf.to_container(cfg.hydra.runtime.choices))
            with open_dict(cfg):
                del cfg["hydra"]
            resolved = cast(
                dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True, enum_to_str=True)
            )
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise _translate(exc, overrides) from None
    finally:
        GlobalHydra.instance().clear()
    choices = {k: v for k, v in choices.items() if not k.startswith("hydra") and k != SCHEMA_NAME}
    from llmctl.config import candidates, locations
    from llmctl.config.launcher_checks import pretrained, validate

    resolved = candidates.expand(resolved, dirs)  # each written out, as the run records it
    locations.check(resolved)  # before pretrained() reads init_from's config.json
    resolved = pretrained(resolved)
    composed = Composed(cfg=resolved, choices=choices, overrides=overrides)
    validate(composed.cfg, composed.typed)
    return composed


def open_dict(cfg: Any) -> Any:
    from omegaconf import open_dict as _open_dict

    return _open_dict(cfg)


def to_typed(cfg: dict[str, Any]) -> Any:
    """A plain config dict as a DictConfig checked against the schema (e.g. a resolved YAML file)."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(OmegaConf.structured(schema.RootCfg), cfg)


def to_yaml(cfg: dict[str, Any]) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(cfg))


def flatten(cfg: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{'train': {'lr': 1}}`` → ``{'train.lr': 1}``: MLflow params and table views."""
    flat: dict[str, Any] = {}
    for key, value in cfg.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat
