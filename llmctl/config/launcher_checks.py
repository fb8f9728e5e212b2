"""Checks composition cannot express, on the plain resolved dict, before anything is created.

The trainer's own rules (value ranges, mesh layout) live with the trainer
(``workloads.protocol.validate``) so it applies them under plain torchrun too; llmctl runs the same
functions, on the typed view ``compose`` made once (the trainer's ``config.typed``), and adds the launcher's
(``infra``). Either way a mistake is a ``ConfigError`` naming the key and the fix.
"""

from __future__ import annotations

from typing import Any

from llmctl.config import notify, workload
from llmctl.errors import ConfigError
from workloads.protocol import validate as trainer
from workloads.protocol.schema import TrainerCfg


def validate(cfg: dict[str, Any], tc: TrainerCfg) -> None:
    """Value ranges and cross-key consistency of a resolved config (``tc``: its typed view)."""
    try:
        trainer.validate(tc)
    except trainer.ConfigError as exc:
        raise ConfigError(str(exc)) from None
    workload.validate(cfg)
    notify.validate(cfg)
    if cfg["infra"]["nodes"] < 1:
        raise ConfigError("Bad value for 'infra.nodes': must be >= 1")
    if cfg["infra"]["nproc_per_node"] < 0:
        raise ConfigError("Bad value for 'infra.nproc_per_node': must be >= 0 (0 = automatic)")
    gib = cfg["infra"].get("device_memory_gib")
    if gib is not None and not float(gib) > 0:
        raise ConfigError(
            f"Bad value for 'infra.device_memory_gib': {gib} (GiB per device, > 0). Fix: drop it to look the"
            " memory up, or infra.device_memory_gib=<GiB per device>"
        )


def check_hardware(tc: TrainerCfg, hardware: Any) -> None:
    """What the config asks of the devices the plan targets (``llmctl.plan.devices.Hardware``): FP8
    matmuls need an FP8 GPU and ``model.loss_kernel=liger`` a GPU, refused here rather than after a
    cluster is up (the trainer checks the real device again when it starts; a GPU whose name llmctl
    does not know is left to that check)."""
    from workloads.planner.hardware import capability_for, fp8_refusal

    recipe = tc.train.fp8.value
    gpu = hardware.gpu if hardware.gpus_per_node else None
    refusal = fp8_refusal(recipe, gpu, capability_for(gpu) if gpu else None)
    if refusal:
        raise ConfigError(refusal)
    if tc.model.loss_kernel == "liger" and not gpu:  # the trainer would refuse it at start
        raise ConfigError(
            "Bad value for 'model.loss_kernel': liger runs on CUDA only, and this plan runs on CPU."
            " Fix: model.loss_kernel=chunked (or auto), or a GPU infra"
        )


def pretrained(cfg: dict[str, Any]) -> dict[str, Any]:
    """``model.init_from``: the shape (and tokenizer) are the checkpoint's, as the trainer will see them."""
    from workloads.protocol import hf_config

    try:
        return hf_config.resolve(cfg)
    except trainer.ConfigError as exc:
        raise ConfigError(str(exc)) from None


def resolve_layout(tc: TrainerCfg, world_size: int) -> dict[str, int]:
    """Concrete mesh degrees for ``world_size`` processes (``dp_shard=-1`` filled in)."""
    try:
        return trainer.resolve_layout(tc, world_size)
    except trainer.ConfigError as exc:
        raise ConfigError(str(exc)) from None
