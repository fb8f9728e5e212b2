"""Search sweeps without training: the grammar against Hydra's Optuna sweeper, refusals, seeded proposals.

The oracle is hydra-optuna-sweeper's own ``create_optuna_distribution_from_override``. Its package pins
optuna<3 (which cannot share a venv with mlflow's sqlalchemy 2), so the ``oracle`` fixture installs it
without its dependencies into a temporary directory (``pip install --no-deps --target``; PyPI is
reachable wherever the README's install works) unless it is importable already, and its ``_impl``
module runs against the installed optuna, whose old distribution classes still exist (deprecated) and convert to
the new ones with optuna's own ``_convert_old_distribution_to_new_distribution``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import pip_target, run_cli

from llmctl.errors import ConfigError
from llmctl.sweep import search
from llmctl.sweep.expand import expand

GRAMMAR = [
    "train.lr=interval(1e-4,1e-2)",
    "train.lr=tag(log, interval(1e-5, 1e-1))",
    "train.lr=tag(log,interval(0.0001,0.3))",
    "train.warmup_steps=choice(0,2,5)",
    "train.warmup_steps=0,2,5",
    "train.warmup_steps=range(0,10)",
    "train.warmup_steps=range(0,10,3)",
    "train.warmup_steps=range(5)",
    "train.lr=range(0.1,1.0,0.1)",
    "train.steps=interval(10,100)",
    "train.steps=tag(log, interval(10,1000))",
    "model=choice(tiny,smoke)",
    "model=tiny,smoke",
    "data.source='a,b',c",
    "train.dtype=choice(fp32,bf16)",
    "train.lr=choice(1e-3,3e-4,1)",
    "train.compile=choice(true,false)",
]


ORACLE = "hydra-optuna-sweeper==1.3.0"


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> object:
    import importlib
    import sys

    try:
        return importlib.import_module("hydra_plugins.hydra_optuna_sweeper._impl")
    except ImportError:
        pass
    target = tmp_path_factory.mktemp("oracle")
    got = pip_target(target, ORACLE)
    if got.returncode != 0:
        pytest.skip(f"could not fetch the oracle ({ORACLE} from PyPI): {got.stderr[-500:]}")
    sys.path.insert(0, str(target))  # hydra_plugins is a namespace package: its path picks this up
    importlib.invalidate_caches()
    return importlib.import_module("hydra_plugins.hydra_optuna_sweeper._impl")


@pytest.mark.parametrize("raw", GRAMMAR)
def test_grammar_equals_hydra_optuna_sweeper(raw: str, oracle: object) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from optuna.distributions import _convert_old_distribution_to_new_distribution as to_new

    [ov] = OverridesParser.create().parse_overrides([raw])
    theirs = to_new(oracle.create_optuna_distribution_from_override(ov))  # type: ignore[attr-defined]
    ours = search.distribution(raw, ov)
    assert ours == theirs, (ours, theirs)


def test_space_keeps_fixed_overrides_and_last_value() -> None:
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    space = search.parse_space(
        [
            "experiment=smoke",
            "train.steps=6",
            "train.lr=1e-3",
            "train.lr=tag(log, interval(1e-4, 1e-2))",
            "train.warmup_steps=0,2",
            "train.steps=8",
        ]
    )
    assert space.fixed == ["experiment=smoke", "train.steps=8"]
    assert space.dists == {
        "train.lr": FloatDistribution(1e-4, 1e-2, log=True),
        "train.warmup_steps": CategoricalDistribution([0, 2]),
    }
    assert search.probe_overrides(space) == [
        ["experiment=smoke", "train.steps=8", "train.lr=0.0001", "train.warmup_steps=0"],
        ["experiment=smoke", "train.steps=8", "train.lr=0.01", "train.warmup_steps=0"],
        ["experiment=smoke", "train.steps=8", "train.lr=0.0001", "train.warmup_steps=2"],
    ]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["train.lr=interval(1e-4,1e-2)"], "Fix: --search tpe"),  # grid is the default
        (["--search", "tpe", "train.lr=interval(1e-4,1e-2)"], "needs --trials N"),
        (["--search", "grid", "--trials", "4", "train.lr=1e-3,3e-4"], "--trials is for --search random|tpe"),
        (["--prune", "asha", "train.lr=1e-3,3e-4"], "Fix: --search tpe"),
        (["--search", "bayes", "--trials", "4", "train.lr=1e-3,3e-4"], "--search bayes: use one of grid, random, tpe"),
        (["--search", "tpe", "--trials", "4", "--prune", "hyperband", "train.lr=1e-3,3e-4"], "--prune hyperband"),
        (["--search", "tpe", "--trials", "4", "train.lr=1e-3"], "needs at least one searched key"),
        (["--search", "tpe", "--trials", "4", "train.lr=tag(log, interval(0, 1e-2))"], "low > 0"),
        (["--search", "tpe", "--trials", "4", "train.lr=interval(1,1e-2)"], "low < high"),
        (["--search", "tpe", "--trials", "4", "train.lr=interval(-1.0,1e-2)"], "train.lr"),  # schema: lr > 0
    ],
)
def test_launch_refuses_before_anything_exists(
    args: list[str], needle: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    out = run_cli(["launch", "-m", "experiment=smoke", *args], tmp_path, cli_env, timeout=120)
    assert out.returncode == 3, out.stdout + out.stderr
    assert needle in out.stderr, out.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "llmctl-runs").exists()


def test_plan_shows_the_same_first_proposals_for_the_same_seed(cli_env: dict[str, str], tmp_path: Path) -> None:
    args = [
        "plan",
        "-m",
        "experiment=smoke",
        "train.lr=tag(log, interval(1e-4, 1e-1))",
        "train.warmup_steps=0,2,5",
        "--search",
        "tpe",
        "--trials",
        "12",
    ]
    a, b, c = (run_cli([*args, "--seed", seed], tmp_path, cli_env, timeout=120) for seed in ("7", "7", "8"))
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + c.stderr
    first = [line for line in a.stdout.splitlines() if line.startswith("  trial ")]
    assert len(first) == 3 and "train.lr=" in first[0] and "train.warmup_steps=" in first[0]  # TPE startup: 12 // 4
    assert first == [line for line in b.stdout.splitlines() if line.startswith("  trial ")]
    assert first != [line for line in c.stdout.splitlines() if line.startswith("  trial ")]
    assert "tpe search, 12 trial(s) (seed 7, prune none)" in a.stdout
    # the probe trials (each key at its ends or choices): 2 ends of lr + 2 more warmup choices
    probes = a.stdout.split("checked before launch")[1].split("first proposals")[0].strip().splitlines()[2:]
    assert [row.split()[:3] for row in probes] == [
        ["0", "0.0001", "0"],
        ["1", "0.1", "0"],
        ["2", "0.0001", "2"],
        ["3", "0.0001", "5"],
    ]
    assert not (tmp_path / "mlflow.db").exists()


def test_grid_is_unchanged_by_search_options() -> None:
    with pytest.raises(ConfigError, match="--search tpe"):
        expand(["train.lr=tag(log, interval(1e-4,1e-2))"])


def test_max_cost_caps_the_whole_search() -> None:
    """The estimate is the costliest checked trial times --trials; each trial's guard is an equal share."""
    from llmctl.sweep import trial_plans as planning

    sp = planning.make_sweep_plan(
        [
            "experiment=smoke",
            "infra.price_per_gpu_hour=100",
            "train.lr=tag(log, interval(1e-4,1e-1))",
            "model=choice(tiny,smoke)",
        ],
        search="tpe",
        n_trials=10,
        seed=1,
    )
    costs = [t.cost for t in sp.trials]
    assert len(costs) == 3 and costs[2] > costs[0]  # model=smoke (the third probe) is the costlier shape
    assert sp.total_cost == pytest.approx(10 * costs[2])
    with pytest.raises(ConfigError, match="exceeds --max-cost"):
        planning.check_budget(sp, 0.9 * sp.total_cost)
    assert "within --max-cost" in planning.check_budget(sp, 1.01 * sp.total_cost)
    assert sp.trial_budgets(5.0) == [0.5] * 3


@pytest.mark.parametrize("kind", ["asha", "median"])
def test_pruners_wait_for_a_quarter_of_the_steps(kind: str) -> None:
    """A trial is not judged before ``grace_steps``: the plan records it (the shortest searched
    train.steps sets it), and Optuna's pruner built from it lets the worst trial pass its early val
    steps and prunes it at the first one after the grace period. With Optuna's default
    (``min_resource="auto"``) ASHA pruned it at step 2 of 12 (the last assertion)."""
    import optuna

    from llmctl.sweep import trial_plans as planning

    sp = planning.make_sweep_plan(
        ["experiment=smoke", "train.val_every=2", "train.steps=12,40", "train.lr=tag(log, interval(1e-4,1e-1))"],
        search="tpe",
        n_trials=4,
        seed=1,
        prune=kind,
    )
    assert sp.search["grace_steps"] == 3 == search.grace_steps({"train": {"val_every": 2, "steps": 12}})
    assert "prune " + kind + " from step 3" in sp.describe()
    assert search.grace_steps({"train": {"val_every": 0, "steps": 12}}) == 12  # val only at the end

    def judged_at(pruner: object) -> list[int]:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(pruner=pruner, sampler=optuna.samplers.RandomSampler(seed=0))
        for good in range(3):  # finished trials whose val/loss fell from 8 to 5, asked as the supervisor asks
            trial = study.ask()
            for step in range(0, 13, 2):
                trial.report(8.0 - good * 0.1 - 3.0 * step / 12, step)
                trial.should_prune()  # ASHA records a trial's rungs when it is asked
            study.tell(trial, 5.0)
        worst, steps = study.ask(), []
        for step in range(0, 13, 2):
            worst.report(9.0, step)
            if worst.should_prune():
                steps.append(step)
        return steps

    assert judged_at(search.pruner(kind, sp.search["grace_steps"]))[0] == 4
    if kind == "asha":
        assert judged_at(search.pruner(kind, None))[0] == 2  # Optuna's default: a rung at step 1


def test_a_report_at_the_final_step_is_never_pruned(tmp_path: Path) -> None:
    """A trial reporting its last step has done all its work: pruning it would race its own exit and
    record a complete trial as KILLED (seen in CI). Real store, real Optuna trial, a real child
    process, and a pruner that always says prune: the report before the last step stops the process,
    the last-step report leaves it alone."""
    import signal
    import subprocess
    import sys

    mc, eid, study = _store_and_study(tmp_path)
    sup = _bare_supervisor(mc, study, eid, tmp_path)
    procs, run_ids = [], {}
    for index, (final, reported) in enumerate([(12, 12), (12, 10)]):
        study.ask()
        run_id = mc.create_run(eid).info.run_id
        for step in range(2, reported + 1, 2):
            mc.log_metric(run_id, "val/loss", 9.0 - step / 10, step=step)
        sup.spec["trials"].append({"index": index, "cfg": {"train": {"steps": final}}})
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        run_ids[index] = run_id
    sup.run_ids = run_ids
    sup.running = {i: (p, i) for i, p in enumerate(procs)}
    try:
        sup.check_pruning()
        assert procs[1].wait(timeout=60) == -signal.SIGTERM and sup.pruned == {1: (10, 8.0)}
        assert procs[0].poll() is None, "the trial that reported its final step was signalled"
        assert sup.reported == {0: 12, 1: 10}  # both reports reached Optuna
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _store_and_study(tmp_path: Path) -> tuple:
    """A real sqlite MLflow store with an experiment, and an Optuna study whose pruner always prunes."""
    import optuna

    from llmctl.tracking import mlflow_run as tracking

    class AlwaysPrune(optuna.pruners.BasePruner):
        def prune(self, study: object, trial: object) -> bool:
            return True

    mc = tracking.client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    return mc, mc.create_experiment("prune"), optuna.create_study(pruner=AlwaysPrune())


def _bare_supervisor(mc: object, study: object, experiment_id: str, directory: Path) -> object:
    """A supervisor's state as ``Supervisor.__init__`` sets it, without a sweep spec on disk."""
    from collections import deque

    from llmctl.sweep.supervisor import Supervisor

    sup = Supervisor.__new__(Supervisor)
    sup.mc, sup.study, sup.dir, sup.id = mc, study, directory, "sweep-test"
    sup.search = {"prune": "asha"}
    sup.spec = {"metric": "val/loss", "trials": [], "uri": mc.tracking_uri, "experiment_id": experiment_id}
    sup.run_ids, sup.pending, sup.running, sup.outcome = {}, deque(), {}, {}
    sup.pruned, sup.reported, sup.resuming, sup.slots = {}, {}, set(), [0, 1]
    sup.cancelled, sup.stop_deadline = False, None
    return sup


def test_a_trial_pruned_just_before_its_supervisor_died_ends_pruned(tmp_path: Path) -> None:
    """The pruner stops a trial; the supervisor dies before the trial has exited; the trial's
    controller then closes its run as preempted (KILLED). The restarted supervisor must tell the
    study PRUNED (not FAIL, which TPE would learn nothing from) and mark the run pruned, not resume
    it. Real store, real Optuna trial, a real child process for the controller."""
    import signal
    import subprocess
    import sys

    from llmctl.run import closing, outcomes
    from llmctl.sweep import state
    from llmctl.sweep.supervisor import Supervisor

    mc, eid, study = _store_and_study(tmp_path)
    first = _bare_supervisor(mc, study, eid, tmp_path)
    study.ask()
    run_id = mc.create_run(
        eid, tags={state.TAG_SWEEP_ID: "sweep-test", state.TAG_KIND: "trial", state.TAG_TRIAL: "0"}
    ).info.run_id
    for step in (2, 4):
        mc.log_metric(run_id, "val/loss", 9.0 - step / 10, step=step)
    first.spec["trials"].append({"index": 0, "cfg": {"train": {"steps": 12}}})
    controller = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    first.run_ids, first.running = {0: run_id}, {0: (controller, 0)}
    try:
        first.check_pruning()
        assert controller.wait(timeout=60) == -signal.SIGTERM and first.pruned == {0: (4, 8.6)}
    finally:
        controller.kill()
    # the first supervisor is gone (never reaped the trial); the controller closed the run as it does on SIGTERM
    closing.close_run(first.spec["uri"], run_id, outcomes.Outcome.PREEMPTED, "stopped by SIGTERM")
    assert mc.get_run(run_id).info.status == "KILLED"

    second = _bare_supervisor(mc, study, eid, tmp_path)
    assert isinstance(second, Supervisor)
    second.adopt()
    assert [t.state.name for t in study.trials] == ["PRUNED"]
    run = mc.get_run(run_id)
    assert run.data.tags.get(state.TAG_PRUNED) == "4" and "pruned at step 4" in run.data.tags["llmctl.status"]
    assert second.outcome == {0: "KILLED"} and not second.pending and not second.resuming
    assert {t["state"] for t in state.read_json(tmp_path / state.STATE_FILE)["trials"].values()} == {"KILLED"}
