"""Sweeps without training: expansion equals Hydra's, fast composition equals compose(), refusals."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers import run_cli

from llmctl.config.compose import compose
from llmctl.errors import ConfigError
from llmctl.sweep import state
from llmctl.sweep import trial_plans as planning
from llmctl.sweep.expand import SweepConfigError, compose_trials, expand, iter_hydra_oracle

SWEEPS = [
    ["train.lr=1e-3,3e-4", "model=tiny,smoke", "train.seed=range(0,3)"],
    ["model=glob(*)"],
    ["model=glob(t*,exclude=smoke)", "train.steps=5"],
    ["model=glob([tiny,1b])", "parallel=glob(*)"],
    ["data.source='a,b'", "train.lr=choice(1,2)"],  # a quoted comma is one value
    ['tracking.run_name="x y",z', "train.steps=3"],
    ["train.lr=1", "train.lr=2,3", "model=tiny"],  # a key given twice: last value, first position
    ["train.seed=range(5)", "train.steps=range(1,10,4)", "train.dtype=fp32,bf16"],
    ["experiment=smoke", "train.batch_size=8,16", "model=tiny", "train.warmup_steps=range(0,9,4)"],
    ["train.lr=1e-3"],  # no sweep at all: one trial
]


@pytest.mark.parametrize("overrides", SWEEPS, ids=[" ".join(s) for s in SWEEPS])
def test_expansion_equals_hydra_basic_sweeper(overrides: list[str]) -> None:
    assert expand(overrides) == list(iter_hydra_oracle(overrides))


def test_expansion_examples() -> None:
    trials = expand(["train.lr=1e-3,3e-4", "model=tiny,smoke", "train.seed=range(0,3)"])
    assert len(trials) == 12
    assert trials[0] == ["train.lr=0.001", "model=tiny", "train.seed=0"]
    assert trials[-1] == ["train.lr=0.0003", "model=smoke", "train.seed=2"]


def test_glob_over_user_config_dir(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("name: mine\ndim: 64\nn_layers: 2\nn_heads: 2\nn_kv_heads: 2\n")
    got = expand(["model=glob(m*)"], str(tmp_path))
    assert got == [["model=mine"]] == list(iter_hydra_oracle(["model=glob(m*)"], str(tmp_path)))
    [trial] = compose_trials(got, str(tmp_path))
    assert trial.cfg["model"]["dim"] == 64 and trial.choices["model"] == "mine"


@pytest.mark.parametrize(
    "bad,needle",
    [
        ("train.lr=interval(0.1,1)", "interval"),
        ("train.seed=range(3,3)", "no values"),
        ("model=glob(nothing*)", "no values"),
        ("train.lr=[1,", "Cannot parse"),
    ],
)
def test_expansion_refuses(bad: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        expand([bad])


def test_fast_composition_equals_full_compose() -> None:
    trials = expand(
        [
            "model=tiny,smoke",
            "experiment=smoke",
            "parallel=auto,fsdp2",
            "train.lr=1e-3,3e-4,1e-4",
            "train.seed=range(0,4)",
            "train.dtype=fp32,bf16",
            "parallel.ac=none,full",
        ]
    )
    composed = compose_trials(trials)
    assert len(composed) == 192
    for i in random.Random(7).sample(range(len(trials)), 8) + [0, len(trials) - 1]:
        full = compose(trials[i])
        assert composed[i].cfg == full.cfg, trials[i]
        assert composed[i].choices == full.choices, trials[i]
        assert composed[i].overrides == trials[i]


def test_invalid_trials_all_reported() -> None:
    with pytest.raises(SweepConfigError) as info:
        compose_trials(expand(["train.lr=1e-3,abc", "train.steps=1,-1", "model=tiny"]))
    errors = info.value.errors
    assert [e.index for e in errors] == [1, 2, 3]
    assert "train.steps" in errors[0].message and "train.lr" in errors[1].message
    text = str(info.value)
    assert "3 of 4 trial(s) are invalid" in text and "Fix:" in text


def test_cli_invalid_sweep_creates_nothing(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["launch", "-m", "experiment=smoke", "train.lr=1e-3,abc", "model=tiny,large"], tmp_path, cli_env)
    assert out.returncode == 3, (out.stdout, out.stderr)
    assert "3 of 4 trial(s) are invalid" in out.stderr and "Traceback" not in out.stderr
    assert "train.lr" in out.stderr and "model 'large'" in out.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "llmctl-runs").exists()
    assert not (tmp_path / "mlruns").exists()


def test_cli_sweep_syntax_without_m_is_refused(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(["launch", "train.lr=1e-3,3e-4"], tmp_path, cli_env)
    assert out.returncode == 3 and "-m" in out.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_cli_plan_m_shows_trials_and_total(cli_env: dict[str, str], tmp_path: Path) -> None:
    out = run_cli(
        [
            "plan",
            "-m",
            "--max-parallel",
            "3",
            "train.lr=1e-3,3e-4",
            "model=tiny,smoke",
            "train.seed=range(0,3)",
            "train.steps=10",
        ],
        tmp_path,
        cli_env,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "# sweep: 12 trial(s), up to 3 at once" in lines[0]
    assert any(line.startswith("fixed:") and "train.steps=10" in line for line in lines)
    header = next(line for line in lines if line.startswith("#  "))
    assert header.split() == ["#", "train.lr", "model", "train.seed", "procs", "device", "tokens", "est.", "cost"]
    assert sum(1 for line in lines if line.split()[:1] and line.split()[0].isdigit()) == 12
    assert lines[-1].startswith("total:") and "12 trials" in lines[-1] and "estimated cost $0.00" in lines[-1]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "llmctl-runs").exists()


def test_max_cost_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planning, "estimate_cost", lambda plan: None)  # an estimator that cannot price it
    sp = planning.make_sweep_plan(["train.lr=1e-3,3e-4"], max_parallel=1)
    assert sp.total_cost is None
    with pytest.raises(ConfigError, match=r"no cost estimate for trial\(s\) 0, 1 .* without a budget guard"):
        planning.check_budget(sp, 10.0)  # no estimate: no share for a trial's in-run guard, so refused
    assert planning.check_budget(sp, None) == ""
    monkeypatch.setattr(planning, "estimate_cost", lambda plan: 4.0)
    sp = planning.make_sweep_plan(["train.lr=1e-3,3e-4"], max_parallel=1)
    assert sp.total_cost == 8.0 and "$8.00" in sp.describe()
    assert "within" in planning.check_budget(sp, 8.0)
    with pytest.raises(ConfigError, match=r"\$8.00 exceeds --max-cost \$5.00"):
        planning.check_budget(sp, 5.0)


def test_max_parallel_default_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr("os.cpu_count", lambda: 64)  # the host; the cores this process may use:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)), raising=False)
    assert planning.default_max_parallel() == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert planning.default_max_parallel() == 8
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert planning.default_max_parallel() == 4
    assert planning.gpu_slots(2) == ["0,1", "2,3"]
    assert planning.gpu_slots(8) == [None] * 8  # more trials than GPUs: no partitioning
    with pytest.raises(ConfigError, match="at least 1"):
        planning.make_sweep_plan(["train.lr=1"], max_parallel=0)


def test_sweep_ids_are_recognisable() -> None:
    sid = state.new_sweep_id()
    assert state.is_sweep_id(sid) and not state.is_sweep_id("3d6c9a35d4404a73882f583f440c5a51")


def test_retry_on_locked_database() -> None:
    from llmctl.tracking.mlflow_run import retry

    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("(sqlite3.OperationalError) database is locked")
        return "ok"

    assert retry(flaky) == "ok" and len(calls) == 3
    with pytest.raises(ValueError):
        retry(lambda: (_ for _ in ()).throw(ValueError("other")))


def test_metric_sink_retries_locked_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    from workloads.pretrain.components.metrics import MetricSink

    monkeypatch.setenv("MLFLOW_RUN_ID", "r1")
    monkeypatch.setattr("time.sleep", lambda s: None)
    logged = []

    class Client:
        fails = 3

        def log_batch(self, run_id: str, metrics: list) -> None:
            if self.fails:
                self.fails -= 1
                raise RuntimeError("database is locked")
            logged.extend(metrics)

    sink = MetricSink()
    sink._client = Client()
    sink.log({"train/loss": 1.0, "val/loss": 2.0}, step=1)
    sink.flush()
    assert sorted(m.key for m in logged) == ["train/loss", "val/loss"]


def _pid_facts(pid: int, pid_file) -> dict:
    from pathlib import Path

    from llmctl.controller import procs

    def read(name: str) -> object:
        try:
            return Path(f"/proc/{pid}/{name}").read_bytes()[:200]
        except OSError as exc:
            return repr(exc)

    return {
        "recorded": pid_file.read_text(),
        "alive": procs.pid_alive(pid),
        "start_time": procs.start_time(pid),
        "stat": read("stat"),
        "cmdline": read("cmdline"),
    }


def test_a_supervisor_pid_taken_by_another_process_is_not_the_supervisor(tmp_path, monkeypatch) -> None:
    """``down``/``status`` of a sweep read supervisor.pid: once the supervisor is gone its pid may be
    another process's; the recorded start time tells them apart, so nobody else is signalled."""
    import subprocess
    import sys

    from llmctl.sweep import state

    monkeypatch.chdir(tmp_path)
    d = state.sweep_dir("sweep-x")
    d.mkdir(parents=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state.write_pid(d, other.pid)
        # the process it recorded (once seen failing in CI under load, not reproduced: say which check failed)
        assert state.supervisor_pid("sweep-x") == other.pid, _pid_facts(other.pid, d / state.PID_FILE)
        started = (d / state.PID_FILE).read_text().split()[1]
        (d / state.PID_FILE).write_text(f"{other.pid} {int(started) - 1}")  # same pid, another process
        assert state.supervisor_pid("sweep-x") is None
    finally:
        other.kill()
        other.wait()
    (d / state.PID_FILE).write_text(f"{other.pid} {started}")
    assert state.supervisor_pid("sweep-x") is None  # gone
