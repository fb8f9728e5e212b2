"""FP8 training (``train.fp8``) through torchao's float8: which linears convert, and the FSDP hooks.

torchao swaps ``nn.Linear`` for ``Float8Linear``, whose matmuls cast inputs, weights and gradients to
FP8 with dynamic scales (``torch._scaled_mm``) while weights, optimizer state and everything else keep
their dtype. Conventions follow torchtitan: convert on meta, before compile and FSDP; skip the LM head
(``output``: the fused loss reads its weight without calling it, and the logits are the most
precision-sensitive matmul) and any linear whose dimensions are not multiples of 16 (``_scaled_mm``
needs them). Under FSDP, ``tensorwise`` all-gathers the weights in FP8 (half the bytes of bf16) and
then needs its scales precomputed once per optimizer step (``after_optimizer_step``); ``rowwise`` has
no FP8 all-gather.
"""

from __future__ import annotations

from typing import Any

import torch

from workloads.planner.hardware import fp8_refusal
from workloads.protocol.schema import TrainerCfg
from workloads.protocol.validate import ConfigError

INSTALL = "pip install 'llmctl-train[fp8]' (torchao)"


def recipe(cfg: TrainerCfg) -> str:
    """``train.fp8`` as a plain string ('none', 'tensorwise' or 'rowwise')."""
    return cfg.train.fp8.value


def fsdp_float8_all_gather(name: str, fsdp: bool) -> bool:
    """Whether FSDP all-gathers FP8 weights: tensorwise scales only, and only when sharded."""
    return fsdp and name == "tensorwise"


def check_device(name: str, device: torch.device) -> None:
    """Refuse (ConfigError, exit 2) FP8 on a device without FP8 tensor cores, and a missing torchao."""
    if name == "none":
        return
    if device.type != "cuda":
        refusal = fp8_refusal(name, None, None)
    else:
        refusal = fp8_refusal(name, torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    if refusal:
        raise ConfigError(refusal)
    _torchao()


def _torchao() -> Any:
    try:
        import torchao.float8 as float8
    except ImportError as exc:
        raise ConfigError(
            f"train.fp8 needs torchao, which is not importable ({exc}). Fix: {INSTALL}, or train.fp8=none"
        ) from None
    return float8


def module_filter(module: torch.nn.Linear, fqn: str) -> bool:
    """torchao asks this of each ``nn.Linear``: convert all but the LM head whose in/out features
    are multiples of 16."""
    if fqn == "output" or fqn.endswith(".output"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert(model: torch.nn.Module, name: str, fsdp: bool) -> list[str]:
    """Swap the eligible ``nn.Linear`` of ``model`` for ``Float8Linear`` in place; their names."""
    float8 = _torchao()
    config = float8.Float8LinearConfig.from_recipe_name(name)
    if fsdp_float8_all_gather(name, fsdp):
        import dataclasses

        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=module_filter)
    from torchao.float8.float8_linear import Float8Linear

    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def after_optimizer_step(model: torch.nn.Module, name: str, fsdp: bool) -> None:
    """Tensorwise + FSDP FP8 all-gather: one all-reduce of every weight's amax for the next step's scales."""
    if fsdp_float8_all_gather(name, fsdp):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
