"""Checks composition cannot express, on the plain resolved dict, before anything is created.

The trainer's own rules (value ranges, mesh layout) live with the trainer
(``workloads.pretrain.validate``) so it applies them under plain torchrun too; llmctl runs the same
functions and adds the launcher's (``infra``). Either way a mistake is a ``ConfigError`` naming
the key and the fix.
"""

from __future__ import annotations

from typing import Any

from llmctl.errors import ConfigError
from workloads.pretrain import validate as trainer


def validate(cfg: dict[str, Any]) -> None:
    """Value ranges and cross-key consistency of a resolved config."""
    try:
        trainer.validate(cfg)
    except trainer.ConfigError as exc:
        raise ConfigError(str(exc)) from None
    if cfg["infra"]["nodes"] < 1:
        raise ConfigError("Bad value for 'infra.nodes': must be >= 1")
    if cfg["infra"]["nproc_per_node"] < 0:
        raise ConfigError("Bad value for 'infra.nproc_per_node': must be >= 0 (0 = automatic)")


def pretrained(cfg: dict[str, Any]) -> dict[str, Any]:
    """``model.init_from``: the shape (and tokenizer) are the checkpoint's, as the trainer will see them."""
    from workloads.pretrain import hf_config

    try:
        return hf_config.resolve(cfg)
    except trainer.ConfigError as exc:
        raise ConfigError(str(exc)) from None


def resolve_layout(cfg: dict[str, Any], world_size: int) -> dict[str, int]:
    """Concrete mesh degrees for ``world_size`` processes (``dp_shard=-1`` filled in)."""
    try:
        return trainer.resolve_layout(cfg, world_size)
    except trainer.ConfigError as exc:
        raise ConfigError(str(exc)) from None
