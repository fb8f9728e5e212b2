"""``llmctl plan`` of a user's own program on a cloud (issue #35): the price per hour from SkyPilot's
catalog (the fixture's), the total from ``workload.hours``, and no memory plan or token count (the
program's memory and work are its own); the task ships the launch directory and runs the guard."""

from __future__ import annotations

import re
from pathlib import Path

from sky_helpers import run_cli

ON_LAMBDA = ["infra=lambda", "infra.accelerators=H100:8", "tracking.uri=http://127.0.0.1:5000"]


def _program(tmp_path: Path) -> list[str]:
    (tmp_path / "train.py").write_text("print('training')\n")
    return ["workload=command", "workload.run=python train.py"]


def test_plan_prices_the_program_per_hour_and_in_total(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *_program(tmp_path), *ON_LAMBDA, "workload.hours=3"], tmp_path, sky_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    price = re.search(r"^price:\s+\$([\d,.]+)/h \(lambda ", out.stdout, re.M)
    total = re.search(r"^total:\s+\$([\d,.]+) estimated", out.stdout, re.M)
    assert price and total, out.stdout[-3000:]
    per_hour = float(price.group(1).replace(",", ""))
    assert per_hour > 0 and float(total.group(1).replace(",", "")) == round(3 * per_hour, 2)
    assert "wall time:   3.00 h (workload.hours=3)" in out.stdout
    assert "program:     python train.py (one per node" in out.stdout
    assert "memory per device" not in out.stdout and "tokens:" not in out.stdout
    assert "\nmodel:" not in out.stdout.split("# plan")[0]  # the trainer's sections are not its config


def test_plan_without_hours_prices_per_hour_and_says_the_total_is_unknown(
    sky_env: dict[str, str], tmp_path: Path
) -> None:
    out = run_cli(["plan", *_program(tmp_path), *ON_LAMBDA], tmp_path, sky_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"^price:\s+\$[\d,.]+/h \(lambda ", out.stdout, re.M), out.stdout[-2000:]
    assert "total:       unknown: set workload.hours=<hours>" in out.stdout


def test_the_skypilot_task_ships_the_launch_directory_and_runs_the_guard(
    sky_env: dict[str, str], tmp_path: Path
) -> None:
    """The task the plan shows: the launch directory mounted on every node, and the node script told
    to start the program's guard there (``node_run.sh``'s command branch)."""
    out = run_cli(["plan", *_program(tmp_path), *ON_LAMBDA], tmp_path, sky_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    task = out.stdout.split("# SkyPilot task", 1)[1]
    assert "LLMCTL_WORKLOAD: command" in task
    assert f"~/.llmctl/runs/<run-id>/program: {tmp_path}" in task, task[:3000]
    assert "-m workloads.command --config" in task and 'cd "$HOME/.llmctl/runs/$LLMCTL_RUN_ID/program"' in task
