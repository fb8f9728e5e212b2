"""``infra.candidates``: one run over several providers. The task goes through SkyPilot's own YAML
loader with ``ordered``/``any_of``, SkyPilot's optimizer (in-process, offline, the fixture catalog)
takes the candidate ``plan`` says it tries first at the price ``plan`` prints, and the CLI refuses,
in one line naming the candidate, one that cannot run the job, cannot hold it in memory or would
pass ``--max-cost``. The one thing faked is that the clouds' credentials were checked: SkyPilot's
own state says those clouds are enabled (no cloud API can be reached here)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator

import pytest
from sky_helpers import REMOTE_URI, run_cli

TWO = "infra.candidates=[lambda,runpod]"
THREE = "infra.candidates=[lambda,runpod,{infra:aws,use_spot:true}]"
JOB = ["infra=lambda", "model=8b", f"tracking.uri={REMOTE_URI}"]


@pytest.fixture()
def enabled_clouds(sky_home: Path) -> Iterator[None]:
    """SkyPilot's record that ``sky check`` passed for lambda, runpod and aws (its state database)."""
    from sky import check, global_user_state, skypilot_config
    from sky.clouds import CloudCapability

    ws = skypilot_config.get_active_workspace()
    global_user_state.set_allowed_clouds(check._get_workspace_allowed_clouds(ws), ws)
    global_user_state.set_enabled_clouds(["lambda", "runpod", "aws"], CloudCapability.COMPUTE, ws)
    yield
    global_user_state.set_enabled_clouds([], CloudCapability.COMPUTE, ws)


def _plan(*overrides: str) -> Any:
    from llmctl.config.compose import compose
    from llmctl.plan.make import make_plan

    return make_plan(compose([*JOB, *overrides]))


def _optimized(plan: Any) -> Any:
    """The resources SkyPilot's optimizer picks for the plan's task, loaded by SkyPilot's own loader."""
    import sky
    from sky import optimizer
    from sky.utils import dag_utils

    from llmctl.backends.sky import task as sky_task

    config = sky_task.task_config(
        plan.cfg,
        run_id="r1",
        tracking_uri=REMOTE_URI,
        experiment_id="1",
        local_config=__file__,
        wheel=__file__,
        settings=plan.settings,
    )
    task = sky.Task.from_yaml_config(copy.deepcopy(config))  # the loader pops what it reads
    dag = optimizer.Optimizer.optimize(dag_utils.convert_entrypoint_to_dag(task), quiet=True)
    return config, dag.tasks[0].best_resources


@pytest.mark.parametrize(
    "pick, key, first, provider",
    [("ordered", "ordered", 0, "lambda"), ("cheapest", "any_of", 2, "aws")],
)
def test_skypilot_takes_the_candidate_the_plan_names(
    enabled_clouds: None, pick: str, key: str, first: int, provider: str
) -> None:
    plan = _plan(THREE, f"infra.pick={pick}")
    assert plan.first_candidate == first and [c.infra["provider"] for c in plan.candidates] == [
        "lambda",
        "runpod",
        "aws",
    ]
    config, best = _optimized(plan)
    listed = config["resources"][key]
    assert [r["infra"] for r in listed] == ["lambda", "runpod", "aws/us-east-1"]
    assert listed[1]["accelerators"] == "H100-SXM:8" and listed[2]["use_spot"] is True  # RunPod's name, AWS spot
    assert str(best.cloud).lower() == provider
    chosen = plan.candidates[first]
    assert best.get_cost(3600) == pytest.approx(chosen.hourly)  # the price plan printed is what SkyPilot pays
    # the plan's own estimate, hardware and memory plan are the first-tried candidate's
    assert plan.estimate is chosen.estimate and plan.estimate.price.usd_per_hour == pytest.approx(chosen.hourly)
    assert plan.memory is chosen.memory


def test_plan_prints_every_candidate_with_price_fit_and_total(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", *JOB, THREE, "infra.pick=cheapest"], tmp_path, sky_env)
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("# candidates", 1)[1].split("\n\n", 1)[0].splitlines()
    assert "infra.pick=cheapest" in table[0] and "any_of" in table[0]
    rows = {line.split()[0]: line for line in table[2:]}
    assert set(rows) == {"0", "1", "2"}
    assert "lambda H100:8" in rows["0"] and "31.92" in rows["0"] and "fits" in rows["0"]
    assert "runpod H100:8" in rows["1"] and "26.32" in rows["1"]
    assert "aws us-east-1 H100:8 spot" in rows["2"] and rows["2"].endswith("<- tried first")
    assert all("$" in row for row in rows.values())  # each candidate's estimated total
    assert "where:       aws/us-east-1 via SkyPilot (cluster, spot), the first of 3 candidates" in out.stdout
    ordered = run_cli(["plan", *JOB, TWO], tmp_path, sky_env)
    assert ordered.returncode == 0, ordered.stderr
    assert "where:       lambda via SkyPilot (cluster), the first of 2 candidates (infra.pick=ordered)" in (
        ordered.stdout
    )


@pytest.mark.parametrize(
    "override, words",
    [
        ("infra.candidates=[lambda,nosuch]", "infra.candidates[1]': no infra named 'nosuch'"),
        ("infra.candidates=[lambda,local]", "infra.candidates[1]': 'local' runs local"),
        ("infra.candidates=[{infra:aws,nodes:2}]", "'nodes' is the whole run's. Fix: infra.nodes=2"),
        ("infra.candidates=[{infra:aws,gpus:8}]", "unknown key 'gpus'"),
        ("infra.candidates=[lambda,{infra:lambda,accelerators:A100:4}]", "different numbers of processes per node"),
        ("infra.candidates=[lambda,{infra:lambda,accelerators:B300:8}]", "infra.candidates[1] (lambda B300:8): "),
        ("infra.pick=first", "Bad value for 'infra.pick': 'first'"),
    ],
)
def test_a_candidate_that_cannot_run_the_job_is_refused_in_one_line(
    sky_env: dict[str, str], tmp_path: Path, override: str, words: str
) -> None:
    out = run_cli(["plan", *JOB, override], tmp_path, sky_env)
    assert out.returncode == 3 and words in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_each_candidate_is_held_to_its_providers_rules(sky_env: dict[str, str], tmp_path: Path) -> None:
    """Two nodes: Lambda runs them, RunPod (one node per job, as SkyPilot declares) cannot."""
    out = run_cli(["plan", *JOB, TWO, "infra.nodes=2"], tmp_path, sky_env)
    assert out.returncode == 3, out.stderr
    assert "infra.candidates[1] (runpod H100:8): Bad value for 'infra.nodes': runpod runs at most 1 node" in out.stderr


def test_launch_holds_memory_and_budget_against_every_candidate(sky_env: dict[str, str], tmp_path: Path) -> None:
    small = "infra.candidates=[lambda,{infra:runpod,device_memory_gib:8}]"
    out = run_cli(["launch", *JOB, small], tmp_path, sky_env)
    assert out.returncode == 3, out.stderr
    assert "infra.candidates[1] (runpod H100:8) would run out of memory" in out.stderr
    assert "Fix: drop it from infra.candidates" in out.stderr
    # lambda's estimate passes a budget runpod's and aws spot's stay under: the run could land there
    plan = run_cli(["plan", *JOB, THREE], tmp_path, sky_env)
    totals = [float(r.split("$")[-1].split()[0].replace(",", "")) for r in _rows(plan.stdout)]
    budget = (totals[0] + totals[1]) / 2
    assert totals[1] < budget < totals[0]
    over = run_cli(["launch", *JOB, THREE, "infra.pick=cheapest", "--max-cost", f"{budget:.2f}"], tmp_path, sky_env)
    assert over.returncode == 3 and over.stderr.startswith("error: infra.candidates[0] (lambda H100:8): estimated"), (
        over.stderr
    )
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "llmctl-runs").exists()


def _rows(stdout: str) -> list[str]:
    return stdout.split("# candidates", 1)[1].split("\n\n", 1)[0].splitlines()[2:]


def test_candidates_need_a_skypilot_infra(sky_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["plan", "infra=local", TWO], tmp_path, sky_env)
    assert out.returncode == 3 and "Bad value for 'infra.candidates': infra=local runs here" in out.stderr, out.stderr
