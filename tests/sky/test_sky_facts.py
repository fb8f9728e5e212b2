"""``llmctl plan infra=<cloud>`` without importing SkyPilot once it has answered: the remembered answers
(``llmctl/backends/sky/facts.py``) give the same plan as SkyPilot asked afresh (the oracle), are
forgotten when the catalog changes, hold no credentials, and never stand in for an error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sky_helpers import run_cli

PLAN = ["plan", "infra=lambda", "tracking.uri=http://alice:s3cret-pw@mlflow.example:5000"]


def _plan_imports(env: dict[str, str], cwd: Path, args: list[str]) -> tuple[str, list[str]]:
    """The plan's output, and which of sky/pandas/requests the process imported."""
    code = (
        "import sys; from llmctl.cli import main\n"
        f"sys.argv = ['llmctl', *{args!r}]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('LOADED:' + ','.join(m for m in ('sky', 'pandas', 'requests') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, text=True, capture_output=True, timeout=300)
    assert "LOADED:" in out.stdout, out.stderr[-3000:]
    text, _, loaded = out.stdout.rpartition("LOADED:")
    return text, [m for m in loaded.strip().split(",") if m]


def test_remembered_plan_equals_skypilot_and_skips_its_import(sky_env: dict[str, str], tmp_path: Path) -> None:
    fresh = run_cli(PLAN, tmp_path, {**sky_env, "LLMCTL_SKY_FACTS": "0"})
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "gpu_8x_h100_sxm5" in fresh.stdout and "31.92" in fresh.stdout

    first, loaded_first = _plan_imports(sky_env, tmp_path, PLAN)
    assert "sky" in loaded_first  # nothing remembered yet: SkyPilot answers
    second, loaded_second = _plan_imports(sky_env, tmp_path, PLAN)
    assert loaded_second == []  # every answer remembered: no sky, no pandas, no requests
    assert first == second == fresh.stdout

    cache = Path(sky_env["LLMCTL_CACHE_DIR"]) / "sky-facts.json"
    text = cache.read_text()
    assert json.loads(text) and "s3cret-pw" not in text and "alice" not in text


def test_a_changed_catalog_is_asked_again(sky_env: dict[str, str], tmp_path: Path) -> None:
    before = run_cli(PLAN, tmp_path, sky_env)
    assert before.returncode == 0 and "31.92" in before.stdout, before.stderr[-3000:]
    vms = Path(sky_env["HOME"]) / ".sky" / "catalogs" / "v8" / "lambda" / "vms.csv"
    vms.write_text(vms.read_text().replace("31.92", "27.50"))
    after, loaded = _plan_imports(sky_env, tmp_path, PLAN)
    assert "sky" in loaded and "27.50" in after and "31.92" not in after
    assert after == run_cli(PLAN, tmp_path, {**sky_env, "LLMCTL_SKY_FACTS": "0"}).stdout


def test_a_refusal_is_skypilots_own(sky_env: dict[str, str], tmp_path: Path) -> None:
    bad = [*PLAN, "infra.region=mars-north-1"]
    fresh = run_cli(bad, tmp_path, {**sky_env, "LLMCTL_SKY_FACTS": "0"})
    assert fresh.returncode != 0 and "infra.region" in fresh.stderr and "mars-north-1" in fresh.stderr
    for _ in range(2):
        again = run_cli(bad, tmp_path, sky_env)
        assert (again.returncode, again.stderr) == (fresh.returncode, fresh.stderr)


def test_entries_expire_and_exceptions_are_not_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmctl.backends.sky import facts as sky_facts

    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path))
    calls: list[int] = []
    offline = [True]

    @sky_facts.remembered
    def answer(x: int) -> list[int]:
        if offline[0]:
            raise ConnectionError("catalog unreachable")
        calls.append(x)
        return [x, len(calls)]

    with pytest.raises(ConnectionError):
        answer(1)
    offline[0] = False

    clock = [1000.0]
    monkeypatch.setattr(sky_facts.time, "time", lambda: clock[0])
    assert answer(1) == [1, 1] and answer(1) == [1, 1] and answer(2) == [2, 2]
    clock[0] += sky_facts.TTL_S + 1
    assert answer(1) == [1, 3] and calls == [1, 2, 1]
