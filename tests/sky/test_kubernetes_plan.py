"""``infra=kubernetes``: the plan a user sees before a launch (task, memory fit, price) and the task
SkyPilot's own loader reads. SkyPilot's Kubernetes cloud has no catalog price (the cluster is the
user's), so the price is ``infra.price_per_gpu_hour``; the fit holds the job against the GPU's
memory as the clouds' catalogs list it (as for Slurm). The round trip through ``sky.Task`` is
tests/sky/test_translate.py's, with a context as the region and two pods."""

from __future__ import annotations

from pathlib import Path

from sky_helpers import run_cli

K8S = ["infra=kubernetes", "infra.region=gpu-ctx", "model=8b", "tracking.uri=http://127.0.0.1:5000"]


def test_plan_prints_the_task_the_fit_and_the_users_price(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *K8S, "infra.nodes=2", "infra.price_per_gpu_hour=2.2"], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    assert "where:       kubernetes/gpu-ctx via SkyPilot (cluster)" in out.stdout
    assert "processes:   2 node(s) x 8 = 16 on 8x H100 per node" in out.stdout
    assert "$35.20/h (kubernetes at $2.2/GPU-h; infra.price_per_gpu_hour $2.2 x 16 GPU(s))" in out.stdout
    fit = next(line for line in out.stdout.splitlines() if line.strip().startswith("fits:"))
    assert "of 80 GiB per H100" in fit and "catalog lists it" in fit, fit
    task = out.stdout.split("# SkyPilot task", 1)[1]
    assert "infra: kubernetes/gpu-ctx" in task, task[:2000]
    assert "num_nodes: 2" in task and "H100: 8" in task


def test_unpriced_until_the_user_says_and_no_spot(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *K8S], tmp_path, sky_env)
    assert out.returncode == 0 and "unpriced" in out.stdout, out.stdout[-3000:]
    refused = run_cli(["launch", *K8S, "--max-cost", "10"], tmp_path, sky_env)
    assert refused.returncode == 3 and "price_per_gpu_hour" in refused.stderr, refused.stderr
    spot = run_cli(["plan", *K8S, "infra.use_spot=true"], tmp_path, sky_env)
    assert spot.returncode == 3 and "kubernetes has no spot instances" in spot.stderr, spot.stderr
    assert not (tmp_path / "mlflow.db").exists()
