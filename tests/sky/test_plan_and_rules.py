"""``plan`` prices from SkyPilot's catalog (fixture CSVs), and provider rules refuse bad infra input
before anything exists: no MLflow run, no SkyPilot API server, no cluster."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from sky_helpers import FIXTURE_CATALOG, REMOTE_URI, run_cli

from llmctl.backends.sky import rules as sky_rules
from llmctl.config.compose import compose
from llmctl.errors import ConfigError


def _rows(cloud: str) -> list[dict[str, str]]:
    with open(FIXTURE_CATALOG / cloud / "vms.csv") as f:
        return list(csv.DictReader(f))


def _expected(cloud: str, acc: str, count: int, spot: bool = False) -> dict[tuple[str, str], float]:
    """(instance type, region) → cheapest price of the matching fixture rows."""
    best: dict[tuple[str, str], float] = {}
    for r in _rows(cloud):
        if r["AcceleratorName"] == acc and r["AcceleratorCount"] and float(r["AcceleratorCount"]) == count:
            price = float(r["SpotPrice" if spot else "Price"])
            key = (r["InstanceType"], r["Region"])
            best[key] = min(price, best.get(key, price))
    return best


def _offers(overrides: list[str]) -> list[sky_rules.Offer]:
    cfg = compose(overrides + [f"tracking.uri={REMOTE_URI}"]).cfg
    sky_rules.check(cfg)
    return sky_rules.offers(cfg["infra"])


@pytest.mark.parametrize(
    "overrides, cloud, acc, count, spot",
    [
        (["infra=lambda"], "lambda", "H100", 8, False),
        (["infra=lambda", "infra.accelerators=A100:2"], "lambda", "A100", 2, False),
        (["infra=runpod"], "runpod", "H100-SXM", 8, False),
        (["infra=aws", "infra.region=null"], "aws", "H100", 8, False),
        (["infra=aws", "infra.region=null", "infra.use_spot=true"], "aws", "H100", 8, True),
    ],
)
def test_offers_equal_fixture_rows(
    sky_home: Path, overrides: list[str], cloud: str, acc: str, count: int, spot: bool
) -> None:
    found = _offers(overrides)
    expected = _expected(cloud, acc, count, spot)
    assert expected, "fixture has rows for this case"
    assert {(o.instance_type, o.region): o.per_node_hour for o in found} == pytest.approx(expected)
    assert [o.total_hour for o in found] == sorted(o.total_hour for o in found)  # cheapest first


def test_multi_node_total_and_region_filter(sky_home: Path) -> None:
    found = _offers(["infra=aws", "infra.nodes=2", "infra.accelerators=H100:8"])
    assert {o.region for o in found} == {"us-east-1"}
    assert found[0].total_hour == pytest.approx(2 * 55.04)


def test_plan_prints_task_yaml_and_offers(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", "infra=lambda", "infra.nodes=2", f"tracking.uri={REMOTE_URI}"], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    assert "gpu_8x_h100_sxm5" in out.stdout and "63.84" in out.stdout  # 2 x $31.92 from lambda/vms.csv
    assert "num_nodes: 2" in out.stdout and "infra: lambda" in out.stdout
    assert "torch.distributed.run" in out.stdout
    assert not (tmp_path / "mlflow.db").exists()


def _checkpoint_warnings(out_stdout: str) -> list[str]:
    return [x for x in out_stdout.splitlines() if x.startswith("note:") and "checkpoint.every=0" in x]


@pytest.mark.parametrize("mode", ["infra.use_spot=true", "infra.managed=true"])
def test_plan_warns_a_spot_or_managed_run_without_periodic_checkpoints(
    sky_env: dict[str, str], tmp_path: Path, mode: str
) -> None:
    """Such a run lives on its emergency save alone: ``plan`` says so and what to set, sized from the
    estimate's step time; with that setting, or on demand, it says nothing."""
    base = ["plan", "infra=aws", "infra.region=null", "model=8b", "train.steps=200000", f"tracking.uri={REMOTE_URI}"]
    out = run_cli([*base, mode], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    [warning] = _checkpoint_warnings(out.stdout)
    assert ("spot run" if "spot" in mode else "managed run") in warning, warning
    assert "emergency save alone" in warning and "checkpoint.preempt_grace_s=20.0s" in warning, warning
    every = int(warning.split("Set checkpoint.every=")[1].split()[0])
    assert 1 <= every < 200000 and "about every 30 min at the estimated" in warning, warning
    following = run_cli([*base, mode, f"checkpoint.every={every}"], tmp_path, sky_env)
    assert following.returncode == 0 and not _checkpoint_warnings(following.stdout), following.stdout[-2000:]
    on_demand = run_cli(base, tmp_path, sky_env)
    assert on_demand.returncode == 0 and not _checkpoint_warnings(on_demand.stdout), on_demand.stdout[-2000:]


def _refused(overrides: list[str], *needles: str) -> None:
    with pytest.raises(ConfigError) as err:
        sky_rules.check(compose(overrides).cfg)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["infra=runpod", "infra.nodes=2"], ("at most 1 node", "infra.nodes=1")),
        (["infra=lambda", "infra.use_spot=true"], ("lambda has no spot", "infra.use_spot=false")),
        (["infra=slurm", "infra.use_spot=true"], ("slurm has no spot",)),
        (["infra=slurm", "infra.autostop_minutes=5"], ("slurm has no autostop",)),
        (["infra=runpod", "infra.accelerators=H200:8"], ("runpod has no 'H200'", "H100-SXM:8")),
        (["infra=lambda", "infra.accelerators=H100:3"], ("no node with 3x H100", "1, 4, 8")),
        (["infra=lambda", "infra.accelerators=NOSUCHGPU:8"], ("lambda has no 'NOSUCHGPU'", "offers A100")),
        (["infra=lambda", "infra.region=mars-1"], ("Invalid region 'mars-1'", "us-east-1")),
        (["infra=aws", "infra.provider=awz"], ("'awz' is not a SkyPilot provider", "Did you mean 'aws'")),
    ],
)
def test_provider_rules(sky_home: Path, overrides: list[str], needles: tuple[str, ...]) -> None:
    _refused(overrides + [f"tracking.uri={REMOTE_URI}"], *needles)


def test_runpod_names_its_gpus_differently(sky_home: Path) -> None:
    """Without conf/infra/runpod.yaml's aliases, 'H100' is refused with RunPod's own names listed."""
    cfg = compose(["infra=runpod", "infra.accelerators=H100:8"]).cfg
    cfg["infra"]["accelerator_aliases"] = {}
    with pytest.raises(ConfigError) as err:
        sky_rules.check(cfg)
    for needle in ("runpod has no 'H100'", "Did you mean 'H100-SXM'", "H100-SXM:8", "A100-80GB"):
        assert needle in str(err.value), str(err.value)


def test_local_store_plan_shows_everything_and_launch_refuses(sky_env: dict[str, str], tmp_path: Path) -> None:
    """Remote nodes cannot reach a local sqlite store: ``plan`` still shows the whole plan (task, offers,
    price) and says that and why ``launch`` refuses; ``launch`` refuses before anything exists."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    shown = run_cli(["plan", "infra=lambda", f"tracking.uri={store}"], tmp_path, sky_env)
    assert shown.returncode == 0, shown.stderr
    assert "gpu_8x_h100_sxm5" in shown.stdout and "31.92" in shown.stdout  # offers from lambda/vms.csv
    assert "# SkyPilot task" in shown.stdout and "# cost estimate" in shown.stdout
    [refused] = [line for line in shown.stdout.splitlines() if line.startswith("refused:")]
    for needle in (
        "`llmctl launch` will refuse",
        "cannot reach the local MLflow store",
        str(tmp_path / "mlflow.db"),
        "mlflow server",
        "tracking.uri=http://",
    ):
        assert needle in refused, refused
    out = run_cli(["launch", "infra=lambda", f"tracking.uri={store}"], tmp_path, sky_env)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "cannot reach the local MLflow store" in out.stderr and "Fix" in out.stderr and "Traceback" not in out.stderr
    sweep = ["-m", "infra=lambda", "train.lr=1e-3,2e-3", f"tracking.uri={store}"]
    shown = run_cli(["plan", *sweep], tmp_path, sky_env)
    assert shown.returncode == 0 and "`llmctl launch -m` will refuse: infra 'lambda'" in shown.stdout, shown.stderr
    out = run_cli(["launch", *sweep], tmp_path, sky_env)
    assert out.returncode == 3 and "cannot reach the local MLflow store" in out.stderr, out.stdout + out.stderr
    _nothing_created(tmp_path, sky_env)
    with_remote = run_cli(["plan", "infra=lambda", f"tracking.uri={REMOTE_URI}"], tmp_path, sky_env)
    assert with_remote.returncode == 0 and "refused:" not in with_remote.stdout, with_remote.stdout[-2000:]


def _nothing_created(tmp_path: Path, env: dict[str, str]) -> None:
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()
    assert not (tmp_path / "llmctl-runs").exists()
    sky_dir = Path(env["HOME"]) / ".sky"
    assert not (sky_dir / "api_server").exists(), "no SkyPilot API server was started"
    assert not list(sky_dir.glob("*.db")), "no SkyPilot state (clusters) was written"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["infra=lambda", "infra.provider=nosuchcloud"], "is not a SkyPilot provider"),
        (["infra=runpod", "infra.nodes=4"], "at most 1 node"),
        (["infra=lambda", "infra.accelerators=H100:3"], "no node with 3x H100"),
        (["infra=lambda"], "lambda is not usable"),  # no ~/.lambda_cloud/lambda_keys: what `sky check` says
    ],
)
def test_bad_infra_launch_exits_3_and_creates_nothing(
    sky_env: dict[str, str], tmp_path: Path, args: list[str], needle: str
) -> None:
    out = run_cli(["launch", *args], tmp_path, {**sky_env, "MLFLOW_TRACKING_URI": REMOTE_URI})
    assert out.returncode == 3, out.stdout + out.stderr
    assert needle in out.stderr and "Fix" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    _nothing_created(tmp_path, sky_env)


def test_missing_credentials_message_says_what_to_do(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["launch", "infra=runpod"], tmp_path, {**sky_env, "MLFLOW_TRACKING_URI": REMOTE_URI})
    assert out.returncode == 3
    assert "~/.runpod/config.toml" in out.stderr and "sky check runpod" in out.stderr
    _nothing_created(tmp_path, sky_env)


def test_unreachable_catalog_is_one_clear_error(cli_env: dict[str, str], tmp_path: Path) -> None:
    """No catalog on disk and none reachable (a proxy on a closed port stands in for no internet): one
    llmctl error naming the fix; none of SkyPilot's raw ``<sky-payload>`` status lines or log lines."""
    env = {
        **cli_env,
        "https_proxy": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    out = run_cli(["plan", "infra=aws", f"tracking.uri={REMOTE_URI}"], tmp_path, env)
    assert out.returncode == 3, out.stderr[-3000:]
    assert out.stdout == ""
    assert out.stderr.startswith("error: SkyPilot has no aws catalog on this machine and could not download it")
    assert "~/.sky/catalogs/" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
