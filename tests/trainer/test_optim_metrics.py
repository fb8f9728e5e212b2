"""LR schedule, optimizer groups, MFU peaks, and batched MLflow logging into a real sqlite store."""

from __future__ import annotations

import math

import pytest
import torch

from workloads.planner.hardware import cpu_threads
from workloads.pretrain.components.metrics import MetricSink, format_train_line, peak_memory_gib, peak_tflops
from workloads.pretrain.components.optim import build_optimizer, lr_factor
from workloads.protocol.schema import Schedule, TrainCfg


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_then_decay_to_floor(schedule):
    tc = TrainCfg(steps=100, warmup_steps=10, min_lr_ratio=0.1, schedule=Schedule(schedule))
    assert lr_factor(1, tc) == pytest.approx(0.1)
    assert lr_factor(10, tc) == pytest.approx(1.0)
    end = {"cosine": 0.1, "linear": 0.1, "constant": 1.0}[schedule]
    assert lr_factor(100, tc) == pytest.approx(end)
    mid = {"cosine": 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), "linear": 0.55, "constant": 1.0}[schedule]
    assert lr_factor(55, tc) == pytest.approx(mid)
    factors = [lr_factor(s, tc) for s in range(10, 101)]
    assert factors == sorted(factors, reverse=True)


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, TrainCfg(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.ndim == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3


def test_no_mfu_on_cpu_and_peak_table_order():
    assert peak_tflops(torch.device("cpu"), "bf16") is None
    assert peak_memory_gib(torch.device("cpu")) > 0.01
    line = format_train_line(
        10,
        100,
        {
            "train/loss": 6.1234,
            "train/lr": 3e-3,
            "train/grad_norm": 0.5,
            "perf/tokens_per_s": 12345.0,
            "perf/tflops": 0.1,
            "perf/mfu": None,
        },
    )
    assert line.startswith("step  10/100 | loss 6.1234 | lr 3.00e-03") and "12,345 tok/s" in line
    assert line.endswith("MFU n/a (cpu)")


def test_cpu_threads_honours_omp_num_threads_else_splits_the_cores(monkeypatch):
    """A set OMP_NUM_THREADS wins (sweeps and parallel tests split the cores with it); else a share."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [cpu_threads(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(1) == cpu_threads(2) == 3
    for junk in ("", "0", "two", "-1"):
        monkeypatch.setenv("OMP_NUM_THREADS", junk)
        assert cpu_threads(2) == 4, junk


def test_launcher_thread_shares_follow_the_affinity_mask_not_the_host(monkeypatch):
    """A container or Slurm job may run on 8 of a host's 64 cores: llmctl's shares (eval processes,
    concurrent sweep trials) come from the trainer's rule over those 8."""
    from llmctl.run import eval_and_export as llmctl_eval
    from llmctl.sweep import trial_plans as planning

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setattr(planning, "local_gpu_count", lambda: 0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert planning.default_max_parallel() == 4
    assert llmctl_eval._env(2)["OMP_NUM_THREADS"] == "4"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert llmctl_eval._env(2)["OMP_NUM_THREADS"] == "3"


def test_peak_table_resolves_real_device_names():
    from workloads.planner.hardware import PEAK_TFLOPS

    def lookup(name):
        return next(bf16 for key, bf16, _ in PEAK_TFLOPS if key.lower() in name.lower())

    assert lookup("NVIDIA H100 80GB HBM3") == 989
    assert lookup("NVIDIA H100 PCIe") == 756
    assert lookup("NVIDIA H100 NVL") == 835
    assert lookup("NVIDIA H200") == 989
    assert lookup("NVIDIA A100-SXM4-80GB") == 312
    assert lookup("NVIDIA L40S") == 362
    assert lookup("NVIDIA A10G") == 125


def test_sink_is_inert_without_run_id(monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    sink = MetricSink()
    sink.log({"train/loss": 1.0}, 1)
    sink.flush()
    assert not sink.active


def test_sink_batches_into_a_real_mlflow_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("wl"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)

    sink = MetricSink()
    for step in range(1, 1201):  # more than one log_batch request's worth
        sink.log({"train/loss": 10.0 / step, "perf/mfu": None}, step)
    sink.flush()
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert len(history) == 1200 and sorted(m.step for m in history)[-1] == 1200
    assert client.get_metric_history(run.info.run_id, "perf/mfu") == []


def test_wsd_holds_the_peak_then_decays_linearly_to_the_floor():
    tc = TrainCfg(steps=110, warmup_steps=10, min_lr_ratio=0.1, schedule=Schedule.wsd, decay_fraction=0.2)
    assert lr_factor(5, tc) == pytest.approx(0.5)
    assert [lr_factor(s, tc) for s in (10, 50, 90)] == [1.0, 1.0, 1.0]  # decay starts at 10 + 0.8 * 100
    assert lr_factor(100, tc) == pytest.approx(0.55)
    assert lr_factor(110, tc) == pytest.approx(0.1)


def test_schedule_steps_is_the_horizon_and_the_floor_holds_after_it():
    tc = TrainCfg(steps=60, warmup_steps=5, min_lr_ratio=0.1, schedule_steps=20)
    assert lr_factor(20, tc) == pytest.approx(0.1)
    assert [lr_factor(s, tc) for s in (21, 40, 60)] == pytest.approx([0.1, 0.1, 0.1])
    assert lr_factor(12, tc) == lr_factor(12, TrainCfg(steps=20, warmup_steps=5, min_lr_ratio=0.1))


def _train(**kw):
    return TrainCfg(
        warmup_steps=5, min_lr_ratio=0.1, lr=3e-4, **{**kw, "schedule": Schedule(kw.get("schedule", "cosine"))}
    )


def test_extension_pins_a_decayed_cosine_and_lets_a_stable_wsd_extend():
    from workloads.planner.schedule import extension
    from workloads.planner.schedule import lr_factor as f

    pin, said = extension(_train(steps=20), _train(steps=60), 20)  # the case: no jump to 7.5e-4
    assert pin == 20 and "keeps its horizon of 20" in said and "train.schedule_steps=60" in said
    old, new = _train(steps=20), _train(steps=60, schedule_steps=pin)
    assert f(21, new) == pytest.approx(f(20, old)) == pytest.approx(0.1)

    pin, said = extension(_train(steps=100, schedule="wsd"), _train(steps=200, schedule="wsd"), 50)
    assert pin is None and "without a jump" in said  # still stable in both: the longer horizon is taken
    pin, _ = extension(_train(steps=100, schedule="wsd"), _train(steps=200, schedule="wsd"), 90)
    assert pin == 100  # already decaying: re-stretching would raise the learning rate

    pin, said = extension(_train(steps=20), _train(steps=60, schedule_steps=60), 20)  # asked for by name
    jump = 3e-4 * f(21, _train(steps=60))
    assert jump > 2e-4 and pin is None and f"jumps from 3.00e-05 (step 20) to {jump:.2e} (step 21)" in said
    assert extension(_train(steps=20), _train(steps=20), 10) == (None, "")


def test_extension_with_fewer_steps_says_the_decay_is_cut_short():
    """Resuming with fewer steps keeps the horizon too, and says what that means for a shorter run
    (it ends before its decay), not the longer run's "after step N it stays at" line."""
    from workloads.planner.schedule import extension
    from workloads.planner.schedule import lr_factor as f

    pin, said = extension(_train(steps=40), _train(steps=30), 20)
    assert pin == 40 and "train.steps 40 -> 30" in said
    end = 3e-4 * f(30, _train(steps=30, schedule_steps=40))
    assert f"ends at step 30, before its decay does (learning rate {end:.2e} there, not the floor 3.00e-05)" in said
    assert "add train.schedule_steps=30" in said and "after step" not in said and "extends cleanly" not in said
