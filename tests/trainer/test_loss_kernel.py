"""``model.loss_kernel``: the loss the trainer runs is named (first log lines, run params) and a
``liger`` that cannot run is refused before training, never swapped for the chunked loss; the
trainer's header also names the SDPA kernel torch picks for the model's own q/k/v."""

from __future__ import annotations

import pytest
import torch

from workloads.pretrain.model import transformer
from workloads.protocol.run_contract import EXIT_CONFIG
from workloads.protocol.validate import ConfigError, validate


def test_auto_and_chunked_resolve_to_chunked_off_cuda() -> None:
    assert transformer.loss_kernel("auto", "cpu") == "chunked"
    assert transformer.loss_kernel("chunked", "cpu") == "chunked"
    assert transformer.loss_kernel("chunked", "cuda") == "chunked"  # asked for: no Liger lookup at all


def test_liger_where_it_cannot_run_is_one_line_naming_the_key_and_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        transformer.loss_kernel("liger", "cpu")
    message = str(info.value)
    assert len(message.splitlines()) == 1 and "'model.loss_kernel'" in message, message
    assert "CUDA only" in message and "Fix:" in message and "model.loss_kernel=chunked" in message, message


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"parallel.tp": 2}, "Fix: model.loss_kernel=auto, or parallel.tp=1"),
        ({"model.kernels": "reference"}, "Fix: model.kernels=fused"),
    ],
)
def test_validate_refuses_liger_where_the_model_would_not_use_it(make_tiny_cfg, overrides, needle) -> None:
    with pytest.raises(ConfigError, match="model.loss_kernel") as info:
        validate(make_tiny_cfg(**{"model.loss_kernel": "liger", **overrides}))
    assert needle in str(info.value)


def test_the_model_refuses_liger_on_cpu_rather_than_falling_back(make_tiny_cfg) -> None:
    model = transformer.build_model(make_tiny_cfg(**{"model.loss_kernel": "liger"}).model)
    tokens = torch.randint(0, 64, (2, 9))
    with pytest.raises(ConfigError, match="model.loss_kernel"):
        model(tokens[:, :-1], tokens[:, 1:])


def test_attention_backend_asks_torch_with_the_models_shapes(make_tiny_cfg) -> None:
    cfg = make_tiny_cfg().model
    cpu = torch.device("cpu")
    plain = transformer.attention_backend(cfg, 2, 64, torch.float32, cpu, masked=False)
    masked = transformer.attention_backend(cfg, 2, 64, torch.float32, cpu, masked=True)
    names = set(torch.nn.attention.SDPBackend.__members__)
    assert plain.startswith("SDPA ") and plain.split()[1].rstrip(",") in names, plain
    assert masked.endswith("document mask") and "document mask" not in plain
    reference = make_tiny_cfg(**{"model.kernels": "reference"}).model
    assert "reference" in transformer.attention_backend(reference, 2, 64, torch.float32, cpu, masked=False)


def test_the_trainer_names_its_loss_and_attention_first(write_tiny_config, workload_env, workload) -> None:
    proc = workload.run(["--config", str(write_tiny_config()), "train.steps=1", "train.val_every=0"], workload_env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    header = [line for line in proc.stdout.splitlines() if line.startswith("pretrain |")]
    assert header[0].startswith("pretrain | model") and ", fp32" in header[0], header  # dtype auto on CPU
    assert header[1].startswith("pretrain | loss chunked (PyTorch fused linear-CE) | attention SDPA "), header


def test_the_trainer_refuses_liger_on_cpu_before_any_work(write_tiny_config, workload_env, workload) -> None:
    proc = workload.run(["--config", str(write_tiny_config()), "model.loss_kernel=liger"], workload_env)
    assert proc.returncode == EXIT_CONFIG, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "pretrain | model" not in proc.stdout  # refused before data or model work
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and "model.loss_kernel" in error[0] and "Fix:" in error[0], error
