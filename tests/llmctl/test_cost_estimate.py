"""The estimate: parameter count vs the real model, hand-computed totals (SkyPilot catalog offers from
the fixture CSVs, spot, multi-node, Slurm $/GPU-h), and calibration from earlier MLflow runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

from llmctl.config.compose import compose
from llmctl.cost import history
from llmctl.cost.estimate import shape_key
from llmctl.plan.make import estimate_for as for_plan
from llmctl.plan.make import make_plan
from workloads.protocol.config import typed
from workloads.protocol.shape import flops_per_token, num_params

ROOT = Path(__file__).resolve().parents[2]
REMOTE_URI = "http://mlflow.example:5000"
# dim 512, 8 layers, 8 heads (head dim 64), vocab 32000, FFN round_up(int(2*4*512/3)=1365, 256) = 1536
SHAPE = [
    "model.dim=512",
    "model.n_layers=8",
    "model.n_heads=8",
    "model.n_kv_heads=8",
    "model.vocab_size=32000",
    "model.multiple_of=256",
    "model.tie_embeddings=false",
    "train.seq_len=1024",
    "train.batch_size=64",
    "train.steps=1000",
    "train.val_every=250",
    "train.val_batches=4",
    "train.dtype=bf16",
]
N_SHAPE = 8 * (4 * 512 * 512 + 3 * 512 * 1536 + 2 * 512) + 512 + 32000 * 512  # layers + final norm + LM head
FPT_SHAPE = 6 * N_SHAPE + 12 * 8 * 8 * 64 * 1024
TOKENS = 1000 * 64 * 1024
VAL_PASSES = 1 + 1000 // 250  # step 0, then 250, 500, 750, 1000


# ----------------------------------------------------------------------------- parameter count


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=tiny"],  # GQA 4/2
        ["model=smoke"],
        ["model=125m"],  # tied embeddings
        ["model=1b"],  # tied + GQA 32/8 + ffn_dim_multiplier
        ["model=8b"],  # untied + GQA + multiplier
        ["model=smoke", "model.tie_embeddings=true", "model.n_kv_heads=1", "model.ffn_dim_multiplier=1.3"],
    ],
)
def test_param_count_equals_the_workload_model(overrides: list[str]) -> None:
    import torch

    from workloads.pretrain.model.transformer import Transformer

    m = typed(compose(overrides).cfg).model  # llmctl's composed dict, as the trainer types it
    with torch.device("meta"):  # no memory, even for 8B
        model = Transformer(m)
    counted = sum(p.numel() for p in model.parameters())  # tied weights once
    embedding = 0 if m.tie_embeddings else model.tok_embeddings.weight.numel()
    assert num_params(m) == counted - embedding  # N leaves the input embedding out
    heads, layers, head_dim = m.n_heads, m.n_layers, m.dim // m.n_heads
    assert flops_per_token(m, 512) == 6 * (counted - embedding) + 12 * layers * heads * head_dim * 512


def test_hand_counted_shape() -> None:
    m = typed(compose(SHAPE).cfg).model
    assert num_params(m) == N_SHAPE == 43_655_680
    assert flops_per_token(m, 1024) == FPT_SHAPE


# ----------------------------------------------------------------------------- priced from the catalog


@pytest.fixture(scope="module")
def catalog_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Fixture catalogs (no .meta md5: never refetched). SkyPilot binds its catalog directory to HOME
    when ``sky.catalog.common`` is first imported; another test of this worker may have imported it
    first (``sky.exceptions`` imports the package), so the binding is pointed here too, and back after."""
    home = tmp_path_factory.mktemp("cost-sky-home")
    shutil.copytree(ROOT / "tests" / "fixtures" / "sky-catalog-v8", home / ".sky" / "catalogs" / "v8")
    saved = {k: os.environ.get(k) for k in ("HOME", "SKYPILOT_DISABLE_USAGE_COLLECTION", "DO_NOT_TRACK")}
    os.environ.update({"HOME": str(home), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "DO_NOT_TRACK": "1"})
    import sky.catalog.common as catalogs

    bound = catalogs._ABSOLUTE_VERSIONED_CATALOG_DIR
    catalogs._ABSOLUTE_VERSIONED_CATALOG_DIR = str(home / ".sky" / "catalogs" / "v8")
    yield home
    catalogs._ABSOLUTE_VERSIONED_CATALOG_DIR = bound
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _sky_plan(extra: list[str]) -> Any:
    return make_plan(compose(SHAPE + extra + [f"tracking.uri={REMOTE_URI}"]))


def _h100_wall_s(gpus: int) -> float:
    rate = 0.40 * 989e12 * gpus  # MFU prior x H100 bf16 peak x GPUs, FLOP/s
    train = TOKENS * FPT_SHAPE / rate
    val_pass = 4 * 64 * 1024 * FPT_SHAPE / 3 / rate  # forward only: a third of training FLOPs
    return 600 + train + VAL_PASSES * val_pass  # 600 s: provisioning + node setup prior for SkyPilot


def test_aws_two_nodes_on_demand_and_spot(catalog_home: Path) -> None:
    wall_h = _h100_wall_s(16) / 3600
    plan = _sky_plan(["infra=aws", "infra.nodes=2"])
    est = plan.estimate
    assert est.throughput.kind == "prior" and "40% MFU of H100" in est.throughput.source
    assert est.wall_s == pytest.approx(wall_h * 3600, rel=1e-9)
    assert est.device_hours == pytest.approx(wall_h * 16)
    # p5.48xlarge in us-east-1 (fixture rows): $55.04/h on demand; cheapest zone's spot $19.2531/h
    assert est.price.usd_per_hour == pytest.approx(2 * 55.04) and not est.price.spot
    assert est.total_usd == pytest.approx(wall_h * 2 * 55.04)
    spot = [p for p in est.offers if p.spot]
    assert spot and spot[0].usd_per_hour == pytest.approx(2 * 19.2531)
    assert est.cost_at(spot[0]) == pytest.approx(wall_h * 2 * 19.2531)
    spot_plan = _sky_plan(["infra=aws", "infra.nodes=2", "infra.use_spot=true"])
    assert spot_plan.estimate.total_usd == pytest.approx(wall_h * 2 * 19.2531)
    assert "# cost estimate" in plan.describe() and f"${wall_h * 2 * 55.04:,.2f}" in plan.describe()


def test_lambda_one_node(catalog_home: Path) -> None:
    est = _sky_plan(["infra=lambda"]).estimate
    wall_h = _h100_wall_s(8) / 3600
    assert est.total_usd == pytest.approx(wall_h * 31.92)  # gpu_8x_h100_sxm5
    assert not [p for p in est.offers if p.spot]  # Lambda sells no spot


def test_slurm_priced_per_gpu_hour(catalog_home: Path) -> None:
    est = _sky_plan(
        ["infra=slurm", "infra.accelerators=H100:8", "infra.nodes=2", "infra.price_per_gpu_hour=2.5"]
    ).estimate
    wall_h = _h100_wall_s(16) / 3600
    assert est.offers == []  # no catalog for Slurm
    assert est.price.usd_per_hour == pytest.approx(2.5 * 16)
    assert est.total_usd == pytest.approx(wall_h * 2.5 * 16)
    free = _sky_plan(["infra=slurm", "infra.accelerators=H100:8"]).estimate
    assert not free.priced and free.total_text == "unpriced" and "set infra.price_per_gpu_hour" in free.price.source


def test_local_cpu_prior(tmp_path: Path) -> None:
    plan = make_plan(
        compose(["experiment=smoke", "infra.price_per_gpu_hour=1.8", f"tracking.uri=sqlite:///{tmp_path / 'none.db'}"])
    )
    est = plan.estimate
    if est.hw.gpus_per_node:
        pytest.skip("this machine has GPUs")
    cores = len(os.sched_getaffinity(0))
    m = typed(compose(["model=tiny"]).cfg).model
    fpt = flops_per_token(m, 64)
    rate = 25e9 * cores  # stated CPU prior: 25 GFLOP/s per core
    wall = 15 + 40 * 8 * 64 * fpt / rate + 3 * (4 * 8 * 64 * fpt / 3 / rate)  # 15 s overhead prior; val at 0, 20, 40
    assert est.wall_s == pytest.approx(wall)
    assert est.total_usd == pytest.approx(wall / 3600 * 1.8)
    assert not (tmp_path / "none.db").exists()  # plan changes nothing


# ----------------------------------------------------------------------------- calibration from MLflow


def _finished_run(
    mc: Any,
    exp: str,
    *,
    shape: str,
    accelerator: str,
    tok_s: float,
    overhead: float,
    val_pass: float,
    status: str = "FINISHED",
    batch: int = 8,
    nodes: int = 1,
    flops: Any = None,
    as_metrics: bool = False,
) -> str:
    """A run as ``hooks.close`` leaves it: the figures as tags (``as_metrics``: as runs logged them before)."""
    from mlflow.entities import Metric, Param

    tags = {history.TAG_SHAPE: shape, history.TAG_ACCELERATOR: accelerator}
    if flops is not None:
        tags[history.TAG_FLOPS] = str(flops)
    figures = {history.STEADY: tok_s, history.OVERHEAD: overhead, history.VAL_PASS: val_pass}
    if not as_metrics:
        tags.update({k: repr(v) for k, v in figures.items()})
    run = mc.create_run(exp, tags=tags)
    rid = run.info.run_id
    mc.log_batch(
        rid,
        metrics=[Metric(k, v, 0, 0) for k, v in figures.items()] if as_metrics else [],
        params=[
            Param("infra.nodes", str(nodes)),
            Param("train.batch_size", str(batch)),
            Param("train.val_batches", "4"),
            Param("train.steps", "40"),
        ],
    )
    if status != "RUNNING":
        mc.set_terminated(rid, status=status)
    return rid


def test_calibration_picks_same_shape_and_accelerator(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    plan = make_plan(compose(["experiment=smoke", f"tracking.uri={uri}"]))
    shape, acc = shape_key(plan.cfg), plan.hardware.accelerator
    mc = MlflowClient(uri)
    exp = mc.create_experiment("calib")
    good = _finished_run(
        mc, exp, shape=shape, accelerator=acc, tok_s=1000.0, overhead=5.0, val_pass=0.5, as_metrics=True
    )  # a run from before the figures were tags is still read
    other = compose(["experiment=smoke", "model.dim=128"]).cfg
    _finished_run(
        mc,
        exp,
        shape=shape_key({**other, "parallel": plan.cfg["parallel"]}),
        accelerator=acc,
        tok_s=9e9,
        overhead=0.0,
        val_pass=0.0,
    )  # another shape
    _finished_run(
        mc, exp, shape=shape, accelerator="H100:8", tok_s=9e9, overhead=0.0, val_pass=0.0
    )  # another accelerator
    _finished_run(mc, exp, shape=shape, accelerator=acc, tok_s=9e9, overhead=0.0, val_pass=0.0, status="RUNNING")
    _finished_run(mc, exp, shape=shape, accelerator=acc, tok_s=9e9, overhead=0.0, val_pass=0.0, status="FAILED")

    est = for_plan(plan)
    assert est.throughput.kind == "measured" and est.throughput.run_id == good
    # 40 steps x 8 x 64 tokens at 1000 tok/s + 5 s overhead + 3 val passes (0, 20, 40) x 0.5 s
    assert est.wall_s == pytest.approx(5 + 40 * 8 * 64 / 1000 + 3 * 0.5)
    # twice the batch: same tokens/s, twice the val tokens per pass
    est2 = for_plan(make_plan(compose(["experiment=smoke", "train.batch_size=16", f"tracking.uri={uri}"])))
    assert est2.wall_s == pytest.approx(5 + 40 * 16 * 64 / 1000 + 3 * 1.0)


def test_new_shape_transfers_flops_per_second_of_another_shape(tmp_path: Path) -> None:
    """No run of this shape: the achieved FLOP/s of another shape on the same accelerator carries over
    (closest FLOPs/token in the same dtype/kernels/tp/ac regime); other accelerators and regimes do not."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    plan = make_plan(compose(["experiment=smoke", "model.dim=128", f"tracking.uri={uri}"]))
    acc = plan.hardware.accelerator
    mc = MlflowClient(uri)
    exp = mc.create_experiment("calib")
    small = compose(["experiment=smoke"]).cfg
    small_shape, small_fpt = shape_key(small), flops_per_token(typed(small).model, 64)
    near = _finished_run(
        mc, exp, shape=small_shape, accelerator=acc, tok_s=1000.0, overhead=5.0, val_pass=0.5, flops=small_fpt
    )
    _finished_run(
        mc,
        exp,
        shape=small_shape.replace("-T64-", "-T8-"),
        accelerator=acc,
        tok_s=9e9,
        overhead=0.0,
        val_pass=0.0,
        flops=small_fpt / 50,
    )  # same regime, much further in FLOPs/token
    _finished_run(
        mc,
        exp,
        shape=small_shape.replace("-fp32-", "-bf16-"),
        accelerator=acc,
        tok_s=9e9,
        overhead=0.0,
        val_pass=0.0,
        flops=small_fpt,
    )  # another dtype: another regime
    _finished_run(
        mc, exp, shape=small_shape, accelerator="H100:8", tok_s=9e9, overhead=0.0, val_pass=0.0, flops=small_fpt
    )  # another accelerator
    _finished_run(mc, exp, shape=small_shape, accelerator=acc, tok_s=9e9, overhead=0.0, val_pass=0.0)  # no FLOPs tag

    est = for_plan(plan)
    fpt = flops_per_token(typed(plan.cfg).model, 64)
    assert fpt > 2 * small_fpt and est.flops_per_token == fpt
    assert est.throughput.kind == "transferred" and est.throughput.run_id == near
    # one hidden size measured (64): the FLOP/s carries over scaled by the CPU prior d / (d + 100)
    size = (128 / (128 + 100)) / (64 / (64 + 100))
    tok_s = 1000.0 * small_fpt / fpt * size
    assert est.throughput.tokens_per_s == pytest.approx(tok_s)
    # 40 steps x 8 x 64 tokens + 5 s overhead as measured + 3 val passes, each 0.5 s x the FLOPs ratio
    assert est.wall_s == pytest.approx(5 + 40 * 8 * 64 / tok_s + 3 * 0.5 * fpt / small_fpt / size)
    assert "transferred" in est.describe()
    assert f"x{size:.2f} for hidden size 128 against 64 (prior: FLOP/s ∝ d/(d+100) on CPU)" in est.throughput.source


def test_flops_per_second_by_hidden_size_fitted_over_the_runs_of_two_sizes(tmp_path: Path) -> None:
    """Runs of two hidden sizes (64, 128) in the new shape's regime: FLOP/s at a third size (256) comes
    from ``1/F = a + b/d`` fitted over them, not from the prior. The runs' FLOP/s follow such a line
    exactly here, so the estimate's tokens/s is that line's FLOP/s at 256 over the shape's FLOPs/token;
    a run of another regime (ac=full) at an outlying speed is left out of the fit."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    plan = make_plan(compose(["experiment=smoke", "model.dim=256", f"tracking.uri={uri}"]))
    acc = plan.hardware.accelerator
    mc = MlflowClient(uri)
    exp = mc.create_experiment("calib")
    a, b = 1e-9, 2e-7  # 1/F = a + b/d: F(64) = 0.24 GFLOP/s, F(128) = 0.39, F(256) = 0.56
    runs = {}
    for dim in (64, 128):
        cfg = compose(["experiment=smoke", f"model.dim={dim}"]).cfg
        fpt = flops_per_token(typed(cfg).model, 64)
        tok_s = 1.0 / (a + b / dim) / fpt
        runs[dim] = _finished_run(
            mc, exp, shape=shape_key(cfg), accelerator=acc, tok_s=tok_s, overhead=5.0, val_pass=0.5, flops=fpt
        )
    full = compose(["experiment=smoke", "model.dim=128", "parallel.ac=full"]).cfg
    _finished_run(
        mc,
        exp,
        shape=shape_key(full),
        accelerator=acc,
        tok_s=1.0,
        overhead=5.0,
        val_pass=0.5,
        flops=flops_per_token(typed(full).model, 64),
    )  # another regime: not a point of the fit

    est = for_plan(plan)
    fpt = flops_per_token(typed(plan.cfg).model, 64)
    assert est.throughput.kind == "transferred" and est.throughput.run_id == runs[128]  # the closest FLOPs/token
    assert est.throughput.tokens_per_s == pytest.approx(1.0 / (a + b / 256) / fpt)
    assert "(fit over 2 runs of sizes 64, 128: 1/FLOP/s = a + b/d)" in est.throughput.source


def test_size_fit_refuses_what_it_cannot_say() -> None:
    from llmctl.cost.estimate import fit_sizes, hidden_size

    assert fit_sizes([(128, 1e9), (128, 2e9)]) is None  # one size: the prior decides
    flat = fit_sizes([(64, 2e9), (128, 1e9)])  # slower when bigger (noise): taken as flat, not inverted
    assert flat is not None and flat.b == 0 and flat.speed(64) == flat.speed(4096)
    assert hidden_size("d256-L6-H4-KV4-V4096-F704-tie0-T128-fp32-fused-tp1-acnone") == 256
    assert hidden_size("command:python train.py torchrun=False") is None


def test_calibration_metrics_from_a_run(tmp_path: Path) -> None:
    """What the controller logs at the end: time-weighted steady tokens/s, val pass, overhead."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    mc = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    rid = mc.create_run(mc.create_experiment("c")).info.run_id
    speeds = [(10, 100.0), (20, 400.0), (30, 200.0)]  # first interval (warm-up) is left out
    mc.log_batch(
        rid,
        metrics=[Metric("perf/tokens_per_s", v, 0, s) for s, v in speeds]
        + [Metric("train/loss", 1.0, 0, s) for s, _ in speeds]
        + [Metric("time/val_s", v, 0, s) for s, v in ((0, 2.0), (30, 3.0))],
    )
    cfg = {"train": {"batch_size": 4, "seq_len": 10}}
    cal = history.calibration(mc, rid, cfg, wall_s=100.0)
    steady = 20 / (10 / 400 + 10 / 200)  # tokens over time of steps 11-30
    assert cal[history.STEADY] == pytest.approx(steady)
    assert cal[history.VAL_PASS] == pytest.approx(2.5)
    assert cal[history.OVERHEAD] == pytest.approx(100 - 30 * 40 / steady - 2 * 2.5)
    assert cal["train/steps_done"] == 30
