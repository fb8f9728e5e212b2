"""Helpers shared by the SkyPilot tests (conftest modules share one import name, so not there)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

FIXTURE_CATALOG = Path(__file__).resolve().parents[1] / "fixtures" / "sky-catalog-v8"
REMOTE_URI = "http://mlflow.example:5000"


def install_catalog(home: Path) -> None:
    """Catalog CSVs without .meta md5 files: SkyPilot treats them as user-provided, never refetched."""
    target = home / ".sky" / "catalogs" / "v8"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(FIXTURE_CATALOG, target, dirs_exist_ok=True)


def run_cli(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess, exactly as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "llmctl", *args],
        cwd=cwd,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
        **kwargs,
    )


def node_python(path: Path, body: str) -> Path:
    """A stand-in for a node's Python, written at ``path``: it answers ``-m llmctl --version`` as this
    checkout's llmctl does (the run script checks that first) and runs the shell ``body`` otherwise."""
    from llmctl.distribution.identity import describe

    path.write_text(f'#!/bin/sh\nif [ "$*" = "-m llmctl --version" ]; then echo "{describe()}"; exit 0; fi\n{body}\n')
    path.chmod(0o755)
    return path


def version_env() -> dict[str, str]:
    """The run script's ``LLMCTL_VERSION_LINE`` as a task from this checkout sets it."""
    from llmctl.distribution.identity import describe

    return {"LLMCTL_VERSION_LINE": describe()}
