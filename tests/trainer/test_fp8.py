"""``train.fp8`` on CPU: which devices are refused and with what message, which linears torchao
converts (its float8 matmul is emulated on CPU, so the converted model also trains a step here),
and the trainer's own refusal when started on a machine without an FP8 GPU. The FP8 numerics on a
real GPU are tests/gpu/test_gpu.py's."""

from __future__ import annotations

import pytest
import torch

from workloads.planner.hardware import capability_for, fp8_refusal
from workloads.pretrain.parallel import fp8
from workloads.protocol.validate import ConfigError, resolve_layout, validate


@pytest.mark.parametrize(
    "name, capable",
    [
        ("H100", True),
        ("NVIDIA H100 80GB HBM3", True),
        ("H200", True),
        ("GH200", True),
        ("B200", True),
        ("GB200", True),
        ("L4", True),
        ("L40S", True),
        ("NVIDIA GeForce RTX 4090", True),
        ("RTX6000-Ada", True),
        ("A100", False),
        ("A100-80GB", False),
        ("NVIDIA A100-SXM4-80GB", False),
        ("A10G", False),
        ("V100", False),
        ("T4", False),
        ("RTX A6000", False),
    ],
)
def test_fp8_capable_devices_by_name(name: str, capable: bool) -> None:
    refusal = fp8_refusal("tensorwise", name, capability_for(name))
    assert (refusal is None) == capable, refusal
    if not capable:
        assert refusal.startswith("train.fp8=tensorwise needs an FP8 GPU (compute capability >= 8.9")
        assert f"this run targets {name}" in refusal and "Fix: train.fp8=none" in refusal


def test_cpu_is_refused_and_none_is_never_refused() -> None:
    assert "this run targets CPU" in fp8_refusal("rowwise", None, None)
    assert fp8_refusal("none", None, None) is None and fp8_refusal("none", "T4", (7, 5)) is None
    assert fp8_refusal("rowwise", "SomeFutureGPU", None) is None  # unknown: the trainer checks the device


def test_the_trainer_refuses_a_cpu_device_before_importing_torchao() -> None:
    with pytest.raises(ConfigError, match=r"train.fp8=rowwise needs an FP8 GPU .* targets CPU"):
        fp8.check_device("rowwise", torch.device("cpu"))
    fp8.check_device("none", torch.device("cpu"))  # no-op


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"train.fp8": "tensorwise", "train.dtype": "fp32"}, "Fix: add train.dtype=bf16"),
        ({"train.fp8": "rowwise", "train.dtype": "bf16", "parallel.tp": 2}, "Fix: parallel.tp=1"),
    ],
)
def test_validate_refuses_fp8_without_bf16_or_with_tp(make_tiny_cfg, overrides: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match="train.fp8") as info:
        validate(make_tiny_cfg(**overrides))
    assert needle in str(info.value)
    validate(make_tiny_cfg(**{"train.fp8": "rowwise", "train.dtype": "bf16"}))  # the fixed one passes
    validate(make_tiny_cfg(**{"train.fp8": "rowwise", "train.dtype": "auto"}))  # auto is bf16 where FP8 runs


def test_fp8_needs_tokens_per_micro_batch_divisible_by_16(make_tiny_cfg) -> None:
    """CUDA's ``_scaled_mm`` takes the micro-batch's tokens as the weight gradient's inner dimension
    (CPU does not check it): 1 x 50 tokens would crash the first backward on a GPU."""
    bad = make_tiny_cfg(**{"train.fp8": "rowwise", "train.batch_size": 1, "train.seq_len": 50})
    with pytest.raises(ConfigError) as info:
        validate(bad)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and "1 x 50 = 50" in message and "divisible by 16" in message, message
    assert "train.seq_len" in message and "Fix:" in message and "train.fp8=none" in message, message
    validate(make_tiny_cfg(**{"train.fp8": "rowwise", "train.batch_size": 1, "train.seq_len": 48}))
    validate(make_tiny_cfg(**{"train.batch_size": 1, "train.seq_len": 50}))  # without FP8 any count runs
    # per rank: 16 x 50 = 800 tokens on one rank, but 4 x 50 = 200 on each of 4 (the world size
    # is known only when the layout is resolved, by the trainer and by llmctl plan)
    split = make_tiny_cfg(**{"train.fp8": "rowwise", "train.batch_size": 16, "train.seq_len": 50})
    validate(split)
    resolve_layout(split, 1)
    with pytest.raises(ConfigError, match=r"4 x 50 = 200\)"):
        resolve_layout(split, 4)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_conversion_skips_the_head_and_dims_not_multiple_of_16(make_tiny_cfg, recipe: str) -> None:
    pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'llmctl-train[fp8]')")
    from torchao.float8.float8_linear import Float8Linear

    from workloads.pretrain.model.transformer import Transformer

    cfg = make_tiny_cfg(**{"model.hidden_dim": 40})  # FFN 64 -> 40 -> 64: not FP8-able; attention is
    with torch.device("meta"):
        model = Transformer(cfg.model)
    converted = fp8.convert(model, recipe, fsdp=False)
    attention = {f"layers.{i}.attention.{w}" for i in range(cfg.model.n_layers) for w in ("wq", "wk", "wv", "wo")}
    assert set(converted) == attention
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in attention)
    assert not isinstance(model.output, Float8Linear)
    assert not isinstance(model.layers["0"].feed_forward.w1, Float8Linear)
    assert model.layers["0"].attention.wq.config.cast_config_weight.scaling_granularity.value == (
        "tensorwise" if recipe == "tensorwise" else "axiswise"
    )


def test_a_converted_model_trains_a_step_close_to_bf16_on_cpu(make_tiny_cfg) -> None:
    """torchao emulates the FP8 matmul on CPU: the first loss matches bf16 to FP8's precision and
    every converted weight gets a gradient."""
    pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'llmctl-train[fp8]')")
    from workloads.pretrain.model.transformer import build_model

    cfg = make_tiny_cfg().model
    torch.manual_seed(0)
    reference = build_model(cfg)
    torch.manual_seed(0)
    model = build_model(cfg)
    fp8.convert(model, "tensorwise", fsdp=False)
    tokens = torch.randint(0, cfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (reference, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(m(tokens[:, :-1], tokens[:, 1:]))
        losses[-1].backward()
    assert abs(losses[0].item() - losses[1].item()) < 0.02 * losses[0].item(), losses
    grad = model.layers["1"].attention.wq.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_the_trainer_exits_2_on_cpu_with_one_line(write_tiny_config, workload_env, workload) -> None:
    proc = workload.run(
        ["--config", str(write_tiny_config(**{"train.dtype": "bf16"})), "train.fp8=tensorwise"], workload_env
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "config error: train.fp8=tensorwise needs an FP8 GPU" in proc.stderr and "train.fp8=none" in proc.stderr
    assert "pretrain | model" not in proc.stdout  # refused before the model or data


# torch < 2.13's CPU ``_scaled_mm`` (oneDNN) takes per-tensor scales only: rowwise's per-row scales hit
# an internal assert there. A CPU-kernel limitation: CUDA's ``_scaled_mm`` has rowwise scales on 2.11.
CPU_ROWWISE = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


@pytest.fixture(scope="module")
def fsdp_fp8_runs() -> dict:
    """One 2-rank gloo run of fp8_fsdp_worker.py (FSDP2, 3 steps) per recipe, same init and batches;
    rowwise only where the CPU kernel supports it (``CPU_ROWWISE``)."""
    pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'llmctl-train[fp8]')")
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    recipes = ["none", "tensorwise"] + (["rowwise"] if CPU_ROWWISE else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}  # workload_env's
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(Path(__file__).with_name("fp8_fsdp_worker.py")),
            *recipes,
        ],
        cwd=repo,
        env={**env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(repo)},
        text=True,
        capture_output=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["recipe"]: r for r in map(json.loads, (ln for ln in proc.stdout.splitlines() if ln.startswith("{")))}


def _tracks_bf16(runs: dict, recipe: str) -> None:
    for a, b in zip(runs[recipe]["losses"], runs["none"]["losses"]):
        assert abs(a - b) < 0.02 * b, (recipe, runs[recipe]["losses"], runs["none"]["losses"])


def test_fsdp_with_fp8_all_gather_trains_on_two_ranks(fsdp_fp8_runs) -> None:
    """Under FSDP2 (2 gloo ranks) tensorwise shards its weights as torchao's FP8-all-gather tensor
    and steps with the scale precompute; its losses stay within 2% of bf16's (FP8 rounding, no more)."""
    assert fsdp_fp8_runs["tensorwise"]["local_weight"] == "WeightWithDynamicFloat8CastTensor"
    assert fsdp_fp8_runs["none"]["local_weight"] == "Tensor"
    _tracks_bf16(fsdp_fp8_runs, "tensorwise")


@pytest.mark.skipif(
    not CPU_ROWWISE,
    reason=f"torch {torch.__version__}: CPU _scaled_mm supports per-tensor scales only (rowwise needs torch >= 2.13"
    " on CPU; a CPU-kernel limitation, CUDA has rowwise)",
)
def test_fsdp_with_rowwise_fp8_keeps_plain_shards_on_two_ranks(fsdp_fp8_runs) -> None:
    """Rowwise under FSDP2 all-gathers plain bf16/fp32 shards (no FP8 all-gather: its scales are
    per row) and tracks bf16's losses within 2%."""
    assert fsdp_fp8_runs["rowwise"]["local_weight"] == "Tensor"
    _tracks_bf16(fsdp_fp8_runs, "rowwise")
