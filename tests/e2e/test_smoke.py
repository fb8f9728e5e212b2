"""``llmctl smoke`` fails loudly when training is broken (docs/ci.md's own command, run by
tests/e2e/test_docs.py, shows it passing)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers import run_cli

pytestmark = pytest.mark.slow


def test_smoke_fails_when_training_is_broken(cli_env: dict[str, str], tmp_path: Path) -> None:
    # lr=1e-9: every stage runs, but the model cannot learn, so the loss gate must trip
    out = run_cli(["smoke", "train.lr=1e-9", "--junit-xml", "junit.xml"], tmp_path, cli_env)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "llmctl smoke FAILED" in out.stdout and "less than --min-loss-drop" in out.stdout
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    cases = {c.attrib["name"]: c for c in suite.iter("testcase")}
    assert list(cases) == ["launch", "resume", "eval", "loss_check"]
    assert suite.attrib["failures"] == "1"
    assert cases["loss_check"].find("failure") is not None
    assert all(cases[n].find("failure") is None for n in ("launch", "resume", "eval"))


def test_smoke_stops_at_the_first_failing_stage(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["smoke", "--junit-xml", "junit.xml"], tmp_path, {**cli_env, "LLMCTL_FAIL_AT_STEP": "3"})
    assert out.returncode == 1
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert [c.attrib["name"] for c in suite.iter("testcase")] == ["launch"]
    assert "exit code 1" in suite.find("testcase/failure").attrib["message"]
