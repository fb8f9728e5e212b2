"""Search sweeps end to end: real supervisor, real torchrun trials, real Optuna study, one sqlite store.

One module-scoped store holds two sweeps: a 12-trial TPE search with ASHA pruning, and a search whose
supervisor is killed mid-sweep and resumed. (The issue's comparison with a 12-trial grid over the same
ranges is not here: with 12-step trials, ASHA's first rung at step 1 makes which trials are pruned,
and so TPE's later proposals, depend on timing; it passed 2 of 3 runs. See the #19 note.)
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli

pytestmark = pytest.mark.slow

STEPS = 12
TINY = [
    "experiment=smoke",
    f"train.steps={STEPS}",
    "train.log_every=2",
    "train.val_every=2",
    "train.val_batches=1",
    "checkpoint.every=0",
]
SEARCH = ["train.lr=tag(log, interval(1e-3, 1.0))", "train.warmup_steps=choice(0,2,5)"]
SEED = "7"


class Store:
    def __init__(self, root: Path, env: dict[str, str]):
        self.root, self.env = root, env

    def client(self) -> Any:
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=f"sqlite:///{self.root / 'mlflow.db'}")

    def sweep(self, sid: str) -> tuple[Any, list[Any]]:
        mc = self.client()
        runs = mc.search_runs([e.experiment_id for e in mc.search_experiments()], f"tags.`llmctl.sweep_id` = '{sid}'")
        [parent] = [r for r in runs if r.data.tags.get("llmctl.kind") == "sweep"]
        children = sorted(
            (r for r in runs if r.data.tags.get("llmctl.kind") == "trial"),
            key=lambda r: int(r.data.tags["llmctl.trial"]),
        )
        return parent, children

    def study(self, sid: str) -> Any:
        import optuna

        return optuna.load_study(study_name=sid, storage=f"sqlite:///{self.sweep_dir(sid) / 'optuna.db'}")

    def sweep_dir(self, sid: str) -> Path:
        return self.root / "llmctl-runs" / "sweeps" / sid


def _sweep_id(stdout: str) -> str:
    return next(w.rstrip(":") for w in stdout.split() if w.startswith("sweep-"))


@pytest.fixture(scope="module")
def store(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("search-store")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}
    env.update(
        {
            "LLMCTL_CACHE_DIR": str(cache_dir),
            "PYTHONUNBUFFERED": "1",
            "HOME": str(root / "home"),
            "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    (root / "home").mkdir()
    return Store(root, env)


@pytest.fixture(scope="module")
def tpe_sweep(store: Store) -> dict[str, Any]:
    t0 = time.monotonic()
    tpe = run_cli(
        [
            "launch",
            "-m",
            "--wait",
            "--max-parallel",
            "2",
            "--search",
            "tpe",
            "--trials",
            "12",
            "--prune",
            "asha",
            "--seed",
            SEED,
            *TINY,
            *SEARCH,
        ],
        store.root,
        store.env,
        timeout=900,
    )
    assert tpe.returncode == 0, tpe.stdout[-3000:] + tpe.stderr[-3000:]
    print(f"tpe sweep {time.monotonic() - t0:.0f} s")
    return {"tpe": _sweep_id(tpe.stdout), "tpe_out": tpe.stdout}


def test_tpe_search_prunes_some_trials(store: Store, tpe_sweep: dict[str, Any]) -> None:
    sid = tpe_sweep["tpe"]
    parent, children = store.sweep(sid)
    assert parent.info.status == "FINISHED"
    assert [int(c.data.tags["llmctl.trial"]) for c in children] == list(range(12))  # each trial once
    pruned = [c for c in children if "llmctl.pruned" in c.data.tags]
    finished = [c for c in children if c.info.status == "FINISHED"]
    assert pruned and len(pruned) + len(finished) == 12, [(c.info.status, c.data.tags) for c in children]
    for c in pruned:  # stopped as a preemption, after a val step, not FAILED
        assert c.info.status == "KILLED" and c.data.tags["llmctl.status"].startswith("pruned at step")
        assert json.loads(c.data.tags["llmctl.preempted"])["checkpoint"] is not None  # SIGTERM → checkpoint
        steps = [m.step for m in store.client().get_metric_history(c.info.run_id, "val/loss")]
        assert int(c.data.tags["llmctl.pruned"]) in steps and max(steps) < STEPS
        # the trial's own log says pruned, as information: not a preemption, not an error
        log = (store.sweep_dir(sid) / f"trial-{c.data.tags['llmctl.trial']}.log").read_text()
        assert "pruned by the sweep's asha pruner at step" in log, log[-2000:]
        assert "preempted" not in log and "error:" not in log and "resume with" not in log, log[-2000:]
    # Optuna's study saw the same outcome for each trial, by trial number
    study = store.study(sid)
    states = {t.number: t.state.name for t in study.trials}
    assert states == {int(c.data.tags["llmctl.trial"]): "PRUNED" if c in pruned else "COMPLETE" for c in children}
    # each trial ran the values its Optuna trial holds
    for t in study.trials:
        c = children[t.number]
        assert float(c.data.params["train.lr"]) == pytest.approx(t.params["train.lr"], rel=1e-12)
        assert int(c.data.params["train.warmup_steps"]) == t.params["train.warmup_steps"]
    # the parent carries the best values and the importances
    best = study.best_trial
    assert float(parent.data.params["best.train.lr"]) == pytest.approx(best.params["train.lr"], rel=1e-12)
    summary = json.loads(Path(store.client().download_artifacts(parent.info.run_id, "search.json")).read_text())
    assert summary["best_trial"] == best.number and set(summary["importance"]) == {"train.lr", "train.warmup_steps"}
    assert parent.data.params["sweep.seed"] == SEED and parent.data.params["sweep.search"] == "tpe"
    history = Path(store.client().download_artifacts(parent.info.run_id, "history.png"))
    assert history.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    status = run_cli(["status", sid], store.root, store.env)
    assert status.returncode == 0, status.stderr
    assert f"12 of 12 trials ended, 12 started, {len(pruned)} pruned" in status.stdout
    assert status.stdout.count("PRUNED") == len(pruned) + 1  # one per trial and the counts line
    assert f"trial {best.number} " in status.stdout.split("best:")[-1]
    runs = run_cli(["runs", "--limit", "100"], store.root, store.env)
    assert sum(1 for line in runs.stdout.splitlines() if " PRUNED " in line) == len(pruned)


def test_same_seed_proposes_the_same_first_trials(store: Store, tpe_sweep: dict[str, Any]) -> None:
    """The sweep's first trials (TPE's random startup: a quarter of 12) are what a fresh plan with the
    seed proposes, whatever the trials' results and timing were."""
    _, children = store.sweep(tpe_sweep["tpe"])
    plan = run_cli(
        ["plan", "-m", "--search", "tpe", "--trials", "12", "--seed", SEED, *TINY, *SEARCH], store.root, store.env
    )
    assert plan.returncode == 0, plan.stderr
    proposed = [line.split(": ", 1)[1].split() for line in plan.stdout.splitlines() if line.startswith("  trial ")]
    ran = [c.data.tags["llmctl.trial.overrides"].split()[-2:] for c in children[: len(proposed)]]
    assert len(proposed) == 3 and ran == proposed


def _pause_outside_a_store_write(pgid: int, db: Path) -> None:
    """SIGSTOP a process group, but not while it holds a lock on the sqlite store: stopped inside a
    metric write, it would lock every later command out (seen in CI: `llmctl status` failed with
    "database is locked" after its retries). Probe: a write of the header's user_version (unused by
    MLflow, set to its own value) needs every other lock released; if it cannot get it, let the group
    finish its write and stop it again."""
    import sqlite3

    for _ in range(100):
        os.killpg(pgid, signal.SIGSTOP)
        con = sqlite3.connect(db, timeout=0.5, isolation_level=None)
        try:
            (version,) = con.execute("PRAGMA user_version").fetchone()
            con.execute(f"PRAGMA user_version = {int(version)}")
            return
        except sqlite3.OperationalError:
            os.killpg(pgid, signal.SIGCONT)
            time.sleep(0.05)
        finally:
            con.close()
    pytest.fail("the trial held the store's lock at every one of 100 pauses")


def _wait(predicate: Any, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1)
    pytest.fail(f"timed out waiting for {what}")


def test_killed_supervisor_resumes_every_trial_once(store: Store) -> None:
    """Kill the supervisor (and, for one trial, its controller and workers: a reboot for it) while two
    trials train; ``llmctl resume`` follows the live one, resumes the dead one from its checkpoint in
    the same run, and runs the rest."""
    # long enough to be killed mid-trial: the loss the test reads lags the trial by a few steps, and a
    # loaded machine lets a tiny trial run many steps between that read and its pause (seen in CI: at 24
    # steps the trial to kill had ended first)
    slow = [*TINY, "train.steps=60", "checkpoint.every=6"]
    out = run_cli(
        ["launch", "-m", "--max-parallel", "2", "--search", "random", "--trials", "4", "--seed", "1", *slow, *SEARCH],
        store.root,
        store.env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    sid = _sweep_id(out.stdout)
    sdir = store.sweep_dir(sid)
    mc = store.client()

    def running() -> dict[int, dict[str, Any]]:
        st = json.loads((sdir / "state.json").read_text()) if (sdir / "state.json").exists() else {"trials": {}}
        return {int(i): t for i, t in st["trials"].items() if t["state"] == "RUNNING"}

    def past_checkpoint() -> bool:  # both train; the first has a checkpoint to resume from
        r = running()
        steps = [max((m.step for m in mc.get_metric_history(t["run_id"], "train/loss")), default=0) for t in r.values()]
        return len(r) == 2 and min(steps) >= 8

    _wait(past_checkpoint, "two trials training past step 6")
    supervisor = int((sdir / "supervisor.pid").read_text().split()[0])
    victims = running()
    dead_index, live_index = sorted(victims)

    def workers(index: int) -> int:
        return json.loads((store.root / "llmctl-runs" / victims[index]["run_id"] / "pids.json").read_text())["workers"]

    # Both paused first: the one to kill must not end its last steps in the meantime (a tiny trial
    # trains a step in a fraction of a second; seen in CI: it had FINISHED by the kill), and the live
    # one must surely be running when the sweep is resumed.
    for index in (dead_index, live_index):
        _pause_outside_a_store_write(workers(index), store.root / "mlflow.db")
    os.kill(supervisor, signal.SIGKILL)
    os.kill(victims[dead_index]["pid"], signal.SIGKILL)
    os.killpg(workers(dead_index), signal.SIGKILL)
    time.sleep(1)

    status = run_cli(["status", sid], store.root, store.env)
    assert "supervisor exited" in status.stdout and "RUNNING" in status.stdout, status.stdout
    resumed = run_cli(["resume", sid], store.root, store.env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    again = run_cli(["resume", sid], store.root, store.env)
    assert again.returncode == 3 and "supervisor is alive" in again.stderr, again.stderr
    _wait(lambda: f"trial {live_index} followed" in (sdir / "supervisor.log").read_text(), "the live trial followed")
    os.killpg(workers(live_index), signal.SIGCONT)

    _wait(lambda: store.sweep(sid)[0].info.status != "RUNNING", "the resumed sweep to end", timeout=600)
    parent, children = store.sweep(sid)
    assert parent.info.status == "FINISHED", parent.data.tags
    assert [int(c.data.tags["llmctl.trial"]) for c in children] == [0, 1, 2, 3]  # no duplicate, none lost
    assert all(c.info.status == "FINISHED" for c in children), [c.data.tags["llmctl.status"] for c in children]
    trials = store.study(sid).trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    assert len({t.params["train.lr"] for t in trials}) == 4  # the restarted sampler did not repeat itself
    by_index = {int(c.data.tags["llmctl.trial"]): c for c in children}
    # the dead trial went on in its own run from its checkpoint (attempt 2); the live one was followed
    tags = by_index[dead_index].data.tags
    assert tags["llmctl.attempt"] == "2" and int(tags["llmctl.attempt.2.from_step"]) >= 6, tags
    assert by_index[live_index].data.tags["llmctl.attempt"] == "1"  # followed, not restarted
    log = (sdir / "supervisor.log").read_text()
    assert f"trial {dead_index} resumed" in log
    # the followed trial's controller was the dead supervisor's child: no made-up exit code
    assert f"trial {live_index} FINISHED (followed after a supervisor restart: exit code not seen)" in log, log
    assert "controller exit -1" not in log
    steps = sorted(m.step for m in mc.get_metric_history(by_index[dead_index].info.run_id, "train/loss"))
    assert steps[-1] == 60
