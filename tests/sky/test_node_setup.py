"""The setup every SkyPilot node runs (``task.SETUP``), for real with bash and pip: it installs the
wheel the controller ships into the node's venv, replaces a build of the same version number (pip
alone would keep it: same name, same version), and leaves the venv alone when it already holds the
controller's build. The node venv reads its dependencies from this suite's environment (a path
entry), so only llmctl itself is installed (``infra.pip_args=--no-deps``): what is tested is the
setup's choice of what to install, not pip's downloads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT

from llmctl.backends.sky import task as sky_task
from llmctl.distribution.identity import describe
from llmctl.distribution.wheel import wheel_for_nodes


def _another_build(tmp_path: Path) -> Path:
    """A wheel of this checkout with one comment more: the same version number, another build."""
    src = tmp_path / "src"
    for name in ("llmctl", "workloads", "conf"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    with open(src / "llmctl" / "__init__.py", "a") as f:
        f.write("# another build\n")
    out = tmp_path / "other"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    subprocess.run(cmd, check=True, capture_output=True)
    return next(out.glob("*.whl"))


def _version_line(wheel: Path, tmp_path: Path) -> str:
    site = tmp_path / f"look-{wheel.parent.name}"
    zipfile.ZipFile(wheel).extractall(site)
    code = "from llmctl.distribution.identity import describe; print(describe())"
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(site)}, cwd=tmp_path, capture_output=True, text=True
    )
    return out.stdout.strip()


def _setup(home: Path, wheel: Path, line: str, ship: bool = True) -> subprocess.CompletedProcess[str]:
    """``SETUP`` as a node runs it, the wheel where the task's file mount puts it (``ship``); no uv on
    the PATH."""
    (home / ".llmctl" / "wheels").mkdir(parents=True, exist_ok=True)
    if ship:
        shutil.copy(wheel, home / ".llmctl" / "wheels" / wheel.name)
    python_dir = str(Path(sys.executable).parent)  # a python3 for the venv; no uv there
    env = {
        "HOME": str(home),
        "PATH": f"{python_dir}:/usr/bin:/bin",
        "LLMCTL_WHEEL": wheel.name,
        "LLMCTL_VERSION_LINE": line,
        "LLMCTL_PIP_ARGS": "--no-deps",
        **{k: v for k, v in os.environ.items() if k.startswith("PIP_")},
    }
    # run from the checkout: an llmctl folder in the working directory must not answer for the venv's
    return subprocess.run(
        ["bash", "-c", sky_task.SETUP], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def _node_venv(home: Path) -> Path:
    """The node's venv, made beforehand the way SETUP makes it, seeing this environment's packages."""
    venv = home / ".llmctl" / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "suite_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _installed(venv: Path) -> str:
    cmd = [str(venv / "bin" / "python"), "-m", "llmctl", "--version"]
    out = subprocess.run(cmd, cwd="/", capture_output=True, text=True)  # not this checkout's llmctl from the cwd
    return out.stdout.strip()


@pytest.mark.slow
def test_the_node_installs_the_controllers_build_and_keeps_it(tmp_path: Path) -> None:
    if shutil.which("uv", path=f"{Path(sys.executable).parent}:/usr/bin:/bin"):
        pytest.skip("uv is on this PATH: SETUP would take it instead of pip")
    home = tmp_path / "home"
    venv = _node_venv(home)
    ours = wheel_for_nodes(tmp_path / "cache")
    first = _setup(home, ours, describe())
    assert first.returncode == 0, first.stderr[-2000:]
    assert _installed(venv) == describe()

    other = _another_build(tmp_path)
    other_line = _version_line(other, tmp_path)
    assert other_line != describe() and other_line.split(" (")[0] == describe().split(" (")[0]  # same version
    second = _setup(home, other, other_line)
    assert second.returncode == 0, second.stderr[-2000:]
    assert _installed(venv) == other_line, "same version number, another build: replaced"

    (home / ".llmctl" / "wheels" / other.name).write_bytes(b"")  # an install from it would now fail
    again = _setup(home, other, other_line, ship=False)
    assert again.returncode == 0, again.stderr[-2000:]  # the venv holds that build: nothing installed
    assert _installed(venv) == other_line
