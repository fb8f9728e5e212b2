"""The tree passes the tools its pyproject.toml configures: ruff (lint and format) everywhere, mypy
on the trainer's contract and llmctl's config stage. In the test command, so CI runs them."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT


@pytest.mark.parametrize(
    "args",
    [["ruff", "check", "."], ["ruff", "format", "--check", "."], ["mypy"]],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_the_tree_is_clean(args: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
