"""Which program a config runs (``workload``): the bundled trainer (``pretrain``) or a user's own
(``command``, ``workloads/command``). For a command only ``workload``, ``infra``, ``tracking`` and
``checkpoint`` mean anything: those are its params and its printed config; the trainer's sections
stay in the resolved YAML (a resume reads it whole) but are not shown as if they configured it."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

from llmctl.errors import ConfigError
from workloads.protocol.command import KIND_COMMAND, KIND_PRETRAIN, BadWorkload, check, is_command

COMMAND_SECTIONS = ("workload", "infra", "tracking", "checkpoint", "notify")
# names of variables that hold credentials: refused in ``workload.env`` (they would become params)
SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY", re.IGNORECASE)

__all__ = ["COMMAND_SECTIONS", "is_command", "shown", "validate"]


def shown(cfg: dict[str, Any]) -> dict[str, Any]:
    """The sections that configure this run: all of them for the trainer, ``COMMAND_SECTIONS`` for a
    command (``workload`` is left out for the trainer, which it does not configure)."""
    if is_command(cfg):
        return {k: cfg[k] for k in COMMAND_SECTIONS if k in cfg}
    return {k: v for k, v in cfg.items() if k != "workload"}


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_secrets(names: Any) -> None:
    """``workload.secrets``: variable names, each set in the environment llmctl runs in."""
    if isinstance(names, str):
        names = [names]
    for name in names:
        if not ENV_NAME.match(str(name)):
            raise ConfigError(
                f"Bad value for 'workload.secrets': {name!r} is not a variable name."
                " Fix: workload.secrets=[WANDB_API_KEY]"
            )
        if not os.environ.get(str(name)):
            raise ConfigError(
                f"Bad value for 'workload.secrets': {name} is not set in this environment."
                f" Fix: export {name}=... in the shell llmctl runs from"
            )


# what each key only ``workload=command`` reads is when nobody set it (``WorkloadCfg``'s defaults)
COMMAND_ONLY: dict[str, Any] = {"run": None, "args": {}, "torchrun": False, "env": {}, "secrets": [], "hours": None}


def _refuse_command_keys(wl: dict[str, Any]) -> None:
    """A key only a command reads, set under the bundled trainer: refused, since the trainer would run
    and record a run while the user's program never started (a forgotten ``workload=command``)."""
    for key, unset in COMMAND_ONLY.items():
        if wl.get(key, unset) not in (unset, None):
            raise ConfigError(
                f"Bad value for 'workload.{key}': only workload=command reads it; the bundled trainer would run"
                f" instead of your program. Fix: add workload=command (or drop workload.{key})"
            )


def validate(cfg: dict[str, Any], cwd: Optional[Path] = None) -> None:
    """``workload.*``: a known kind, and for a command a program that can start (one-line errors)."""
    wl = cfg.get("workload") or {}
    kind = wl.get("kind", KIND_PRETRAIN)
    if kind not in (KIND_PRETRAIN, KIND_COMMAND):
        raise ConfigError(
            f"Bad value for 'workload.kind': '{kind}'. Fix: workload=pretrain (the bundled trainer) or workload=command"
        )
    if kind != KIND_COMMAND:
        _refuse_command_keys(wl)
        return
    for name in wl.get("env") or {}:
        if SECRET.search(str(name)):
            raise ConfigError(
                f"Bad value for 'workload.env.{name}': a secret would be stored in the run's params and config."
                f" Fix: export {name} in the shell llmctl runs from and pass workload.secrets=[{name}]"
            )
    _check_secrets(wl.get("secrets") or [])
    hours = wl.get("hours")
    if hours is not None and not float(hours) > 0:
        raise ConfigError(f"Bad value for 'workload.hours': {hours} (wall hours, > 0). Fix: workload.hours=2.5")
    try:
        check(wl, cwd or Path.cwd())
    except BadWorkload as exc:
        raise ConfigError(f"Bad value for '{exc.key}': {exc}") from None
