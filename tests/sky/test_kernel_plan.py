"""``llmctl plan`` names the compute dtype, loss kernel and attention the trainer will run, from the
config and the target alone (no torch): ``train.dtype=auto`` and ``model.loss_kernel=auto`` resolve
one way on a GPU target and another on this CPU machine; ``liger`` on a CPU target is refused."""

from __future__ import annotations

from pathlib import Path

from sky_helpers import REMOTE_URI, run_cli

from llmctl.plan.job_plan import kernel_lines

GPU = ["infra=lambda", "model=tiny", "infra.accelerators=H100:8", f"tracking.uri={REMOTE_URI}"]


def _lines(stdout: str) -> dict[str, str]:
    keys = ("dtype:", "loss kernel:", "attention:")
    return {line.split(":")[0]: line.split(":", 1)[1].strip() for line in stdout.splitlines() if line.startswith(keys)}


def test_a_gpu_plan_names_bf16_liger_and_sdpa(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *GPU], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    seen = _lines(out.stdout)
    assert seen["dtype"].startswith("bf16 (train.dtype=auto, TF32"), seen
    assert seen["loss kernel"].startswith("liger (Triton fused linear-CE) if liger-kernel imports"), seen
    assert seen["attention"].startswith("SDPA; torch picks cuDNN or flash on CUDA at start"), seen
    chunked = _lines(run_cli(["plan", *GPU, "model.loss_kernel=chunked"], tmp_path, sky_env).stdout)
    assert chunked["loss kernel"] == "chunked (PyTorch fused linear-CE)", chunked
    tp = _lines(run_cli(["plan", *GPU, "parallel.tp=2"], tmp_path, sky_env).stdout)
    assert tp["loss kernel"].startswith("vocab-parallel"), tp


def test_a_cpu_plan_names_fp32_and_the_chunked_loss(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", "model=tiny"], tmp_path, cli_env)
    assert out.returncode == 0, out.stderr
    seen = _lines(out.stdout)
    assert seen == {
        "dtype": "fp32 (train.dtype=auto)",
        "loss kernel": "chunked (PyTorch fused linear-CE)",
        "attention": "SDPA (CPU: its flash kernel)",
    }, seen


def test_liger_on_a_cpu_target_is_refused_with_the_fix(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", "model=tiny", "model.loss_kernel=liger"], tmp_path, cli_env)
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr
    message = out.stderr.strip()
    assert len(message.splitlines()) == 1 and "model.loss_kernel" in message and "Fix:" in message, message


def test_reference_kernels_and_explicit_dtypes() -> None:
    cfg = {"model": {"kernels": "reference"}, "train": {"dtype": "fp32"}}
    assert kernel_lines(cfg, gpu=True) == [
        "dtype:       fp32",
        "loss kernel: full logits + F.cross_entropy (reference kernels)",
        "attention:   explicit softmax (reference kernels)",
    ]
    assert kernel_lines({"train": {"dtype": "bf16"}}, gpu=False)[0] == "dtype:       bf16"
