"""The config is typed once, where it is composed: following the overrides from ``llmctl launch``
(and ``llmctl plan``) through the plan, the memory plan, the estimate with each kind of evidence
(the prior, a measured run of the same shape, a run of another shape transferred) and the attempt's
records, ``workloads.protocol.config.typed`` turns a plain mapping into the trainer's config once;
everything after reads that object, or a copy with the values the backend resolved
(``with_values``). Counted in the real CLI process: ``typed`` is wrapped before llmctl imports it,
and every call that is handed a mapping (not a config typed already) is recorded with its callers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, mlflow_runs, run_cli

COUNTING = """
import collections, sys, traceback
import workloads.protocol.config as config
from workloads.protocol.schema import TrainerCfg

calls = collections.Counter()
original = config.typed

def typed(cfg):
    if not isinstance(cfg, TrainerCfg):
        ours = [f for f in traceback.extract_stack()[:-1] if "/llmctl/" in f.filename or "/workloads/" in f.filename]
        calls[" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.name}" for f in reversed(ours[-4:]))] += 1
    return original(cfg)

config.typed = typed
from llmctl.cli import app
try:
    app(sys.argv[1:], prog_name="llmctl")
except SystemExit as exc:
    code = exc.code
print("TYPED", sum(calls.values()), dict(calls), "EXIT", code)
"""


def _typed_calls(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-c", COUNTING, *args],
        cwd=cwd,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("TYPED ")), "")
    assert line.endswith("EXIT 0"), out.stdout[-3000:] + out.stderr[-3000:]
    return int(line.split()[1]), line


@pytest.mark.slow
def test_launch_and_plan_type_the_config_once(cli_env: dict[str, str], tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**cli_env, "MLFLOW_TRACKING_URI": uri}
    launch = ["launch", "model=tiny", "train.steps=2", "train.val_every=0"]
    first, seen = _typed_calls(launch, tmp_path, env)
    assert first == 1, seen  # the estimate from the prior
    again, seen = _typed_calls(launch, tmp_path, env)
    assert again == 1, seen  # the estimate from the run just measured (same shape)
    sources = sorted((r.info.start_time, r.data.tags["llmctl.estimate.source"]) for r in mlflow_runs(uri))
    assert [s.split(":")[0] for _, s in sources] == ["prior (rough)", "measured"], sources
    other, seen = _typed_calls(["plan", "model=tiny", "model.dim=128"], tmp_path, env)
    assert other == 1, seen  # another shape: the measured run's FLOP/s transferred
    shown = run_cli(["plan", "model=tiny", "model.dim=128"], tmp_path, env)
    assert "transferred: run" in shown.stdout, shown.stdout[-3000:]
