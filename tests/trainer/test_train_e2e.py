"""The workload as llmctl runs it: a subprocess with a resolved config, exit codes, MLflow metrics."""

from __future__ import annotations

import json
import os
import sys

import pytest


def test_tiny_run_learns_and_logs_the_metric_contract(write_tiny_config, workload_env, workload, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("workload")
    run = client.create_run(exp)
    env = {**workload_env, "MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run.info.run_id, "MLFLOW_EXPERIMENT_ID": exp}

    proc = workload.run(["--config", str(write_tiny_config())], env)
    assert proc.returncode == 0, proc.stderr
    losses = workload.losses(proc.stdout)
    assert sorted(losses["val"]) == [0, 15, 30]
    assert sorted(losses["train"]) == [5, 10, 15, 20, 25, 30]
    assert losses["val"][30] < losses["val"][0] - 0.5, proc.stdout
    assert f"final val/loss {losses['val'][30]:.4f} (first {losses['val'][0]:.4f})" in proc.stdout
    assert "MFU n/a (cpu)" in proc.stdout

    metrics = client.get_run(run.info.run_id).data.metrics
    for key in (
        "train/loss",
        "val/loss",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/tokens_per_s_per_device",
        "perf/tflops",
        "perf/peak_mem_gib",
    ):
        assert key in metrics, key
    assert "perf/mfu" not in metrics  # unknown peak on CPU: not guessed
    val = client.get_metric_history(run.info.run_id, "val/loss")
    assert sorted(m.step for m in val) == [0, 15, 30]
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 6


def test_reference_kernels_bf16_and_overrides_after_config(write_tiny_config, workload_env, workload):
    proc = workload.run(
        [
            "--config",
            str(write_tiny_config(**{"model.kernels": "reference"})),
            "train.dtype=bf16",
            "train.steps=6",
            "train.val_every=6",
            "train.log_every=3",
        ],
        workload_env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "reference kernels, bf16" in proc.stdout
    assert sorted(workload.losses(proc.stdout)["train"]) == [3, 6]


def test_injected_failure_exits_nonzero_with_traceback(write_tiny_config, workload_env, workload):
    env = {**workload_env, "LLMCTL_FAIL_AT_STEP": "3"}
    proc = workload.run(["--config", str(write_tiny_config())], env)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "LLMCTL_FAIL_AT_STEP=3" in proc.stderr
    assert "final val/loss" not in proc.stdout


def test_bad_config_is_an_error(write_tiny_config, workload_env, workload):
    """The trainer validates its own config (no llmctl involved): exit 2, one line naming the key."""
    proc = workload.run(["--config", str(write_tiny_config(**{"train.seq_len": 1024}))], workload_env)
    assert proc.returncode == 2 and "Bad value for 'train.seq_len'" in proc.stderr and "max_seq_len" in proc.stderr
    assert "Traceback" not in proc.stderr
    typo = workload.run(["--config", str(write_tiny_config()), "train.lrr=1e-3"], workload_env)
    assert typo.returncode == 2 and "lrr" in typo.stderr and "Traceback" not in typo.stderr


@pytest.mark.slow
def test_two_process_data_parallel_matches_one_process(write_tiny_config, workload_env, workload):
    """torchrun with 2 gloo ranks (local batch 4 each) follows the 1-process run (batch 8)."""
    cfg = str(write_tiny_config(**{"train.steps": 6, "train.log_every": 1, "train.val_every": 3}))
    one = workload.run(["--config", cfg], workload_env)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    # without OMP_NUM_THREADS torchrun sets 1 per process, and the trainer honours it on any machine
    two = workload.run(
        ["--config", cfg], {k: v for k, v in workload_env.items() if k != "OMP_NUM_THREADS"}, launcher=launcher
    )
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert "world 2 on cpu (1 threads/proc)" in two.stdout
    a, b = workload.losses(one.stdout), workload.losses(two.stdout)
    assert sorted(a["train"]) == sorted(b["train"]) == [1, 2, 3, 4, 5, 6]
    for kind in ("train", "val"):
        for step, loss in a[kind].items():
            assert abs(b[kind][step] - loss) <= 2e-4, (kind, step, loss, b[kind][step])


@pytest.mark.slow
def test_trains_under_plain_torchrun_where_llmctl_cannot_be_imported(workload_env, workload, cache_dir, tmp_path):
    """The config llmctl composes, run by torchrun with an ``llmctl`` on the path that refuses to be
    imported: the trainer (and everything it loads) needs nothing from llmctl. Two gloo ranks; the
    metrics and the start record still reach MLflow."""
    import subprocess

    from helpers import ROOT
    from mlflow.tracking import MlflowClient

    config = tmp_path / "run.yaml"
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmctl",
            "config",
            "show",
            "experiment=smoke",
            "parallel=fsdp2",
            "train.steps=4",
            "train.log_every=2",
            "train.val_every=4",
            f"data.cache_dir={cache_dir}",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=workload_env,
        check=True,
    )
    config.write_text(shown.stdout)
    assert "infra:" in shown.stdout and "tracking:" in shown.stdout  # the launcher's sections are there, and skipped
    poisoned = tmp_path / "poisoned" / "llmctl"
    poisoned.mkdir(parents=True)
    (poisoned / "__init__.py").write_text("raise ImportError('the workload imported llmctl')\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mc = MlflowClient(tracking_uri=uri)
    run = mc.create_run(mc.create_experiment("plain"))
    env = {
        **workload_env,
        "PYTHONPATH": os.pathsep.join([str(poisoned.parent), str(ROOT)]),
        "MLFLOW_TRACKING_URI": uri,
        "MLFLOW_RUN_ID": run.info.run_id,
    }
    # from a directory without llmctl in it (python puts the working directory first on the path)
    check = subprocess.run(
        [sys.executable, "-c", "import llmctl"], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert check.returncode == 1 and "the workload imported llmctl" in check.stderr  # the poison works

    proc = subprocess.run(
        [*workload.torchrun(2), "-m", "workloads.pretrain", "--config", str(config)],
        cwd=tmp_path,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "world 2 on cpu" in proc.stdout and "dp_shard 2" in proc.stdout
    assert sorted(workload.losses(proc.stdout)["train"]) == [2, 4]
    assert (tmp_path / "ckpt" / "step-4" / ".complete").is_file()
    got = mc.get_run(run.info.run_id)
    assert {"train/loss", "val/loss", "perf/tokens_per_s"} <= set(got.data.metrics)
    start = json.loads(got.data.tags["llmctl.workload_start.1"])
    assert start["from_step"] == 0 and start["world_size"] == 2
    done = json.loads(got.data.tags["llmctl.completed"])  # every step ran, final checkpoint committed
    assert (done["step"], done["checkpoint"], done["start"]) == (4, 4, 1), done
