"""A cloud or Slurm plan without SkyPilot installed (the ``cloud`` extra) is refused in one line
naming the extra, exit 3, nothing created: the CLI runs in a Python that cannot find ``sky``
(``without_sky/sitecustomize.py`` hides it from the path finder, as a venv without the extra would)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, run_cli

WITHOUT_SKY = Path(__file__).resolve().parent / "without_sky"


def _without_sky(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(WITHOUT_SKY), env.get("PYTHONPATH")) if p)}


def test_the_shim_hides_sky_as_a_missing_install_does(cli_env: dict[str, str], tmp_path: Path) -> None:
    code = "import importlib.util\nprint(importlib.util.find_spec('sky'))\nimport sky"
    out = subprocess.run([sys.executable, "-c", code], env=_without_sky(cli_env), capture_output=True, text=True)
    assert out.stdout.strip() == "None" and "ModuleNotFoundError: No module named 'sky'" in out.stderr, out


def test_the_extra_is_named_in_pyproject() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    message = "the message names llmctl-train[cloud]: it must install SkyPilot"
    assert any(re.match(r"skypilot\[", req) for req in extras["cloud"]), message


@pytest.mark.parametrize("command", ["plan", "launch"])
@pytest.mark.parametrize("infra", ["lambda", "slurm"])
def test_a_cloud_plan_without_skypilot_names_the_extra(
    cli_env: dict[str, str], tmp_path: Path, command: str, infra: str
) -> None:
    out = run_cli([command, f"infra={infra}", "infra.accelerators=H100:8"], tmp_path, _without_sky(cli_env))
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"infra={infra} runs through SkyPilot" in lines[0] and "Fix: pip install 'llmctl-train[cloud]'" in lines[0]
    assert not out.stdout.strip(), out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"], "nothing created (no store, no run directory)"
    assert not (Path(cli_env["HOME"]) / ".sky").exists()
