"""Unpriced infra (Slurm, local GPUs, no catalog and no ``infra.price_per_gpu_hour``) reads ``unpriced``
wherever a price would be, never $0, and ``--max-cost`` is refused there before anything exists (a $0
price would turn the in-run budget guard off without a word). This machine's own CPU stays $0."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
from sky_helpers import REMOTE_URI, run_cli

from llmctl.config.compose import compose
from llmctl.cost.estimate import configured_price
from llmctl.plan.devices import Hardware

SLURM = ["infra=slurm", "infra.accelerators=H100:8", f"tracking.uri={REMOTE_URI}"]
FIX = "infra.price_per_gpu_hour=<$ per GPU-hour>"


def test_who_is_priced() -> None:
    gpu, cpu = Hardware("H100:1", "H100", 1, 1), Hardware("cpu", None, 0, 1, 2)
    local, slurm = compose([]).cfg["infra"], compose(["infra=slurm"]).cfg["infra"]
    assert local["price_per_gpu_hour"] is None and slurm["price_per_gpu_hour"] is None
    assert not configured_price(local, gpu).priced  # this machine's GPUs: nobody said what they cost
    own = configured_price(local, cpu)
    assert own.priced and own.usd_per_hour == 0  # this machine's CPU: nothing to pay
    assert not configured_price(slurm, cpu).priced and not configured_price(slurm, gpu).priced
    assert configured_price({**slurm, "price_per_gpu_hour": 2.5}, Hardware("H100:8", "H100", 8, 2)).usd_per_hour == 40
    assert configured_price({**slurm, "price_per_gpu_hour": 0.0}, gpu).priced  # an explicit 0 is the user's price


def _estimate_lines(stdout: str) -> list[str]:
    return stdout.split("# cost estimate", 1)[1].splitlines()


def test_plan_shows_unpriced_and_the_refusal(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *SLURM, "--max-cost", "100"], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    lines = _estimate_lines(out.stdout)
    assert any(line.startswith("price:       unpriced (slurm: no catalog price;") for line in lines), lines
    assert "total:       unpriced estimated" in lines
    assert not any("$0.00" in line for line in lines), lines
    assert "$0 by default" not in out.stdout  # the offers section agrees: unpriced, not "$0"
    assert "offline catalog for this provider: unpriced until infra.price_per_gpu_hour is set" in out.stdout
    # a Slurm cluster keeps checkpoints on its shared filesystem, as conf/infra/slurm.yaml says; a bucket is second
    [note] = [line for line in out.stdout.splitlines() if "checkpoints stay on the nodes" in line]
    assert "point checkpoint.dir at the cluster's shared filesystem" in note, note
    [cap] = [line for line in lines if line.startswith("max cost:")]
    assert "REFUSED: launch will refuse" in cap and "infra 'slurm' is unpriced" in cap and FIX in cap, cap
    priced = run_cli(["plan", *SLURM, "infra.price_per_gpu_hour=2.5", "--max-cost", "1000000"], tmp_path, sky_env)
    lines = _estimate_lines(priced.stdout)
    assert any(line.startswith("price:       $20.00/h") for line in lines) and any("(within)" in x for x in lines)


def _nothing_created(tmp_path: Path) -> None:
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "llmctl-runs").exists()


def test_max_cost_refused_on_unpriced_launch_and_sweep(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["launch", *SLURM, "--max-cost", "100"], tmp_path, sky_env)
    assert out.returncode == 3, out.stdout + out.stderr
    for needle in ("--max-cost $100.00 cannot be enforced", "infra 'slurm' is unpriced", "nothing was launched", FIX):
        assert needle in out.stderr, out.stderr
    sweep = run_cli(["launch", "-m", *SLURM, "train.lr=1e-3,2e-3", "--max-cost", "100"], tmp_path, sky_env)
    assert sweep.returncode == 3, sweep.stdout + sweep.stderr
    for needle in ("trial(s) 0, 1 run on unpriced infra (slurm", "nothing was launched", FIX):
        assert needle in sweep.stderr, sweep.stderr
    _nothing_created(tmp_path)
    shown = run_cli(["plan", "-m", *SLURM, "train.lr=1e-3,2e-3"], tmp_path, sky_env)
    assert shown.returncode == 0, shown.stderr
    rows = [line for line in shown.stdout.splitlines() if line[:1].isdigit()]
    assert len(rows) == 2 and all(r.split()[-1] == "unpriced" for r in rows), rows
    assert any(x.startswith("total:") and "estimated cost unpriced" in x for x in shown.stdout.splitlines())


def test_an_unpriced_run_reads_unpriced(sky_home: Path, cli_env: dict[str, str], tmp_path: Path) -> None:
    """A run opened and closed by the real lifecycle steps on Slurm: no $ metric that reads like a price,
    and ``status``, ``runs`` and the closing line say unpriced."""
    from mlflow.tracking import MlflowClient

    from llmctl.cost import hooks
    from llmctl.plan.make import make_plan
    from llmctl.run import lifecycle
    from llmctl.tracking import mlflow_run as tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    plan = make_plan(compose(["infra=slurm", "infra.accelerators=H100:8", f"tracking.uri={uri}"]))
    assert not plan.estimate.priced
    handle = tracking.create_run(plan.cfg, plan.choices)
    lifecycle._open_attempt(handle, plan, None, spent=0.0, from_step=0, first=True)
    mc = MlflowClient(uri)
    line = hooks.close(mc, handle.run_id, None, plan.estimate, "finished")
    assert "unpriced over 1 attempt(s)" in line and "(estimated unpriced)" in line, line
    tracking.end_run(handle, "FINISHED", "finished")
    run = mc.get_run(handle.run_id)
    assert run.data.tags["llmctl.price.usd_per_hour"] == run.data.tags["llmctl.attempt.1.usd_per_hour"] == "unpriced"
    tags = run.data.tags
    assert "cost/estimate_usd" not in tags and "cost/actual_usd" not in tags
    # unpriced is not unmeasured: the attempt's device-hours are its 8 GPUs times its billed span
    start, end = (datetime.fromisoformat(tags[f"llmctl.attempt.1.{k}"]) for k in ("start", "end"))
    assert tags["llmctl.attempt.1.devices"] == "8"
    span_h = (end - start).total_seconds() / 3600
    assert float(tags["cost/device_hours"]) == pytest.approx(8 * span_h, rel=1e-6, abs=1e-9)
    assert end > start and "time/estimate_h" in tags

    status = run_cli(["status", handle.run_id, "--tracking-uri", uri], tmp_path, cli_env)
    assert status.returncode == 0, status.stderr
    assert "estimate:    unpriced," in status.stdout and "cost:        unpriced over 1 attempt(s)" in status.stdout
    listed = run_cli(["runs", "--json", "--tracking-uri", uri], tmp_path, cli_env)
    [row] = json.loads(listed.stdout)
    assert row["unpriced"] is True and row["actual_usd"] is None and row["estimate_usd"] is None
    table = run_cli(["runs", "--tracking-uri", uri], tmp_path, cli_env).stdout
    assert table.count("unpriced") == 2, table  # est $ and actual $
