"""The CLI's shape: help, version, lazy imports, usage errors, config inspection."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, run_cli

HEAVY = ("torch", "hydra", "omegaconf", "mlflow", "sky")


def _modules_loaded_by(argv: list[str]) -> list[str]:
    code = (
        "import sys\n"
        "from llmctl.cli import app\n"
        "try:\n"
        f"    app({argv!r}, prog_name='llmctl')\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('LOADED:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("LOADED:")][-1]
    return [m for m in line[len("LOADED:") :].split(",") if m]


def test_help_and_version_import_no_heavy_modules() -> None:
    assert _modules_loaded_by(["--help"]) == []
    assert _modules_loaded_by(["--version"]) == []
    assert _modules_loaded_by(["launch", "--help"]) == []


def test_version_and_help_output(cli_env: dict[str, str], tmp_path: Path) -> None:
    from llmctl import __version__
    from llmctl.distribution.identity import describe

    out = run_cli(["--version"], tmp_path, cli_env)
    assert out.returncode == 0 and out.stdout.strip() == describe(), out.stdout
    assert re.fullmatch(rf"llmctl {re.escape(__version__)} \(build [0-9a-f]{{12}}\)", out.stdout.strip())
    out = run_cli(["--help"], tmp_path, cli_env)
    assert out.returncode == 0
    for command in ("launch", "plan", "config"):
        assert command in out.stdout


def test_unknown_option_is_usage_error(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["launch", "--no-such-flag"], tmp_path, cli_env)
    assert out.returncode == 2
    assert "No such option" in out.stderr


def test_plan_has_no_side_effects(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", "model=tiny", "train.steps=7"], tmp_path, cli_env)
    assert out.returncode == 0, out.stderr
    assert "steps: 7" in out.stdout and "local (this machine)" in out.stdout
    assert "-m workloads.pretrain --config '<run-dir>/config.yaml'" in out.stdout  # one process: no torchrun agent
    two = run_cli(["plan", "model=tiny", "parallel=fsdp2"], tmp_path, cli_env)
    assert "torch.distributed.run --standalone --nnodes=1 --nproc_per_node=2 -m workloads.pretrain" in two.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]


def test_config_show_applies_experiment_preset(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["config", "show", "experiment=smoke", "train.lr=0.01"], tmp_path, cli_env)
    assert out.returncode == 0, out.stderr
    assert "name: tiny" in out.stdout and "lr: 0.01" in out.stdout


def test_user_config_dir_adds_options(cli_env: dict[str, str], tmp_path: Path) -> None:
    user = tmp_path / "myconf" / "model"
    user.mkdir(parents=True)
    (user / "mine.yaml").write_text("name: mine\ndim: 96\nn_layers: 1\nn_heads: 3\nn_kv_heads: 1\n")
    out = run_cli(["config", "show", "--config-dir", str(tmp_path / "myconf"), "model=mine"], tmp_path, cli_env)
    assert out.returncode == 0, out.stderr
    assert "dim: 96" in out.stdout
    out = run_cli(["config", "show", "model=mine"], tmp_path, cli_env)
    assert out.returncode == 3 and "Unknown model 'mine'" in out.stderr


def test_completion_offers_group_options_without_hydra() -> None:
    from llmctl.cli import complete_override

    assert "model=tiny" in complete_override("model=t")
    assert "train.lr=" in complete_override("train.l")


def test_help_lists_every_command_on_one_untruncated_line(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["--help"], tmp_path, cli_env)
    lines = [ln for ln in out.stdout.split("Commands:")[1].splitlines() if ln.strip()]
    names = [line.split()[0] for line in lines]
    for command in (
        "plan",
        "launch",
        "resume",
        "status",
        "logs",
        "down",
        "runs",
        "cost",
        "eval",
        "export",
        "smoke",
        "config",
        "data",
    ):
        assert command in names, command
    for line in lines:
        assert line.startswith("  ") and not line.startswith("   ") and not line.rstrip().endswith("..."), line


def test_export_refuses_an_unknown_dtype_before_creating_anything(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["export", "some-run", "--dtype", "fp64"], tmp_path, cli_env)
    assert out.returncode == 3, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: --dtype fp64: an export is written in bf16, fp16, fp32. Fix: --dtype bf16"
    ]
    assert not (tmp_path / "llmctl-runs").exists()
