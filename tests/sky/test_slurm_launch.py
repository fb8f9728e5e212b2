"""Real launches through SkyPilot's Slurm backend on a localhost Slurm cluster, tracked on a real
MLflow server: a cluster launch followed by ``status``, ``logs``, lm-eval scores by a job of their
own on the cluster (``llmctl eval RUN --tasks``) and ``down``; a managed job whose
Slurm job is cancelled mid-run, recovered by SkyPilot and finished as one MLflow run (the bundled
trainer over two candidates, two partitions at two prices, recovered onto the second; and a
user's transformers script under ``workload=command``); and a sweep whose two trials are managed jobs.

Runs by default (CI runs it as root after .ci/run installs slurm-wlm, munge, openssh-server);
``--no-slurm`` or ``LLMCTL_SKIP_SLURM=1`` skips it locally. Missing prerequisites skip it with the
reason, except under CI=true, where tests/ci_policy.py fails them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest
from helpers import mlflow_server, save_tiny_llama, webhook_server
from sky_helpers import run_cli
from slurm_harness import (
    CLUSTER,
    FIRST_CHOICE,
    PARTITION,
    USER,
    Cluster,
    free_port,
    missing_prerequisites,
    slurm_cluster,
)

# The timeout guards against a hang, not for speed: the first test carries the cluster's start and
# runs launch, status, logs, an lm-eval job and down through SkyPilot; beside the rest of CI on 2
# cores it came within minutes of the suite's 900 s (docs/benchmarks.md, ``ci_run``)
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1800)]


# SkyPilot sizes its API server and, in consolidation mode, its pool of jobs-controller processes by the
# machine's memory: on this 24 GiB CI box that was a dozen `sky.jobs.controller` processes, each importing
# SkyPilot and polling every 10 s, for one job. SkyPilot's own pod-memory setting sizes them for a small
# controller host (one controller, a few workers), as on a real cluster's login node.
# The API server on a port of this module's own (SkyPilot's SKYPILOT_API_SERVER_LOCAL_PORT, which its client
# and server both read): a SkyPilot client anywhere else on the machine (the rest of CI runs beside these
# tests) starts or reaches the default 46580, whose server has another HOME, so no Slurm config and none
# of these jobs. Seen in CI: a launch here talked to such a server ("Available clusters: []").
SMALL_API_SERVER = {"SKYPILOT_POD_MEMORY_GB_LIMIT": "6", "SKYPILOT_API_SERVER_LOCAL_PORT": str(free_port())}


@pytest.fixture(scope="module")
def prerequisites(request: pytest.FixtureRequest) -> None:
    if request.config.getoption("--no-slurm") or os.environ.get("LLMCTL_SKIP_SLURM") == "1":
        pytest.skip("Slurm test disabled (--no-slurm / LLMCTL_SKIP_SLURM=1)")
    missing = missing_prerequisites()
    if missing:
        message = (
            f"localhost Slurm harness needs: {', '.join(missing)} "
            "(apt-get install slurm-wlm munge openssh-server rsync; run as root)"
        )
        pytest.skip(message)


@pytest.fixture(scope="module")
def tracking_server(prerequisites: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real tracking server the "remote" nodes can reach (llmctl refuses a local store for them)."""
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as uri:
        yield uri


def _wait_healthy(uri: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"mlflow server at {uri} not healthy after {timeout} s")


@pytest.fixture(scope="module")
def cluster(prerequisites: None, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with slurm_cluster(Path(request.config.cache.mkdir("llmctl-slurm"))) as c:
        yield c


def test_launch_status_logs_down_on_real_slurm(
    tracking_server: str, cluster: Cluster, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    """What a user installs, not this checkout: llmctl's wheel in a venv of its own, run from a
    directory outside the checkout, launches here (FINISHED) and on Slurm, whose node runs that
    installed llmctl (the cluster's shared filesystem: infra.node_python) and says so in the run's log
    (the build check passed); then ``status``, ``logs``, lm-eval scores by a job on the cluster and
    ``down``, all from the installed package."""
    from llmctl.distribution.identity import describe

    build = describe()  # this checkout's, before anything else runs
    venv = _wheel_venv(cluster, tmp_path)
    wheel_env = {k: v for k, v in cli_env.items() if k != "PYTHONPATH"}
    wheel_env.update(PATH=f"{venv / 'bin'}:{wheel_env['PATH']}", VIRTUAL_ENV=str(venv))

    def installed(*args: str, cwd: Path = tmp_path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        llmctl = str(venv / "bin" / "llmctl")
        return subprocess.run([llmctl, *args], cwd=cwd, env=wheel_env, text=True, capture_output=True, timeout=timeout)

    def without_lm_eval(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """The installed llmctl in a process where ``import lm_eval`` fails: a controller without lm-eval
        (the node, the same venv through infra.node_python, keeps it)."""
        cmd = [str(venv / "bin" / "python"), "-c", NO_LM_EVAL, *args]
        return subprocess.run(cmd, cwd=tmp_path, env=wheel_env, text=True, capture_output=True, timeout=timeout)

    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import llmctl; print(llmctl.__file__)"],
        env=wheel_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr  # the wheel's copy, not this checkout
    assert installed("--version").stdout.strip() == build
    (tmp_path / "here").mkdir()
    here = installed("launch", "model=tiny", "train.steps=4", cwd=tmp_path / "here")
    assert here.returncode == 0 and "FINISHED" in here.stdout, here.stdout[-3000:] + here.stderr[-3000:]

    home = Path(cli_env["HOME"])
    cluster.write_client_config(home, cluster.root / "ssh" / "user_key")
    env = {**cli_env, **SMALL_API_SERVER, "MLFLOW_TRACKING_URI": tracking_server, "AWS_EC2_METADATA_DISABLED": "true"}
    wheel_env.update({k: env[k] for k in (*SMALL_API_SERVER, "MLFLOW_TRACKING_URI", "AWS_EC2_METADATA_DISABLED")})
    sky_bin = str(Path(sys.executable).with_name("sky"))
    shared = cluster.root / "shared-launch"  # the cluster's shared filesystem: the controller reads it too
    shared.mkdir(exist_ok=True)
    shutil.chown(shared, USER, USER)
    _wait_healthy(tracking_server)
    try:
        out = installed(
            "launch",
            "infra=slurm",
            "experiment=smoke",
            f"infra.region={CLUSTER}",
            f"infra.zone={PARTITION}",
            f"infra.node_python={venv / 'bin' / 'python'}",  # the nodes run the installed wheel
            "infra.cpus=1",
            "infra.memory=2",
            "infra.down=false",
            "checkpoint.every=0",
            f"checkpoint.dir={shared / 'ckpt'}",
            timeout=600,
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]

        from mlflow.tracking import MlflowClient

        mc = MlflowClient(tracking_uri=tracking_server)
        (run,) = mc.search_runs([mc.get_experiment_by_name("llmctl").experiment_id])
        assert run.info.status == "FINISHED"
        tags = run.data.tags
        assert tags["llmctl.sky.cluster"].startswith("llmctl-") and tags["llmctl.sky.job_id"]
        val = mc.get_metric_history(run.info.run_id, "val/loss")
        assert val, "the workload on the Slurm node logged into the controller's MLflow run"
        rid = run.info.run_id

        status = installed("status", rid, timeout=120)
        assert status.returncode == 0, status.stderr
        assert "FINISHED" in status.stdout and "UP" in status.stdout and "SUCCEEDED" in status.stdout, status.stdout
        listing = installed("status", timeout=120)
        assert rid in listing.stdout

        logs = installed("logs", rid, timeout=120)
        assert logs.returncode == 0, logs.stderr
        assert "val" in logs.stdout and "step" in logs.stdout, logs.stdout[-2000:]
        assert f"llmctl on node 0: {build}" in logs.stdout, logs.stdout[-3000:]  # the node ran the controller's

        _scores_by_a_job_on_the_cluster(mc, rid, tmp_path, installed, without_lm_eval)

        # clusters stay visible to plain `sky status`
        assert (
            tags["llmctl.sky.cluster"]
            in subprocess.run([sky_bin, "status"], env=env, capture_output=True, text=True, timeout=120).stdout
        )

        down = installed("down", rid, timeout=180)
        assert down.returncode == 0 and "is down" in down.stdout, down.stdout + down.stderr
        after = installed("status", rid, timeout=120)
        assert "gone" in after.stdout, after.stdout
        assert cluster.squeue().strip() == "", "no Slurm job left behind"
        # logs still readable from the controller's copy once the cluster is gone
        assert "step" in installed("logs", rid, timeout=120).stdout
    finally:
        subprocess.run([sky_bin, "api", "stop"], env=env, capture_output=True, timeout=120)


EVAL_FLAGS = [
    "--tasks",
    "python_facts_mc,python_facts_gen",
    "--include-path",
    str(Path(__file__).resolve().parents[2] / "examples" / "eval-tasks"),  # docs/eval.md's local tasks
    "--num-fewshot",
    "1",
    "--limit",
    "4",
]


# the installed CLI with lm-eval unimportable in its process only (sys.argv: the CLI's arguments)
NO_LM_EVAL = "import sys; sys.modules['lm_eval'] = None; sys.argv[0] = 'llmctl'; from llmctl.cli import main; main()"


def _scores_by_a_job_on_the_cluster(
    mc: "object",
    rid: str,
    tmp_path: Path,
    llmctl: "Callable[..., subprocess.CompletedProcess[str]]",
    without_lm_eval: "Callable[..., subprocess.CompletedProcess[str]]",
) -> None:
    """``llmctl eval RUN --tasks`` of a Slurm run: a job of its own on the run's cluster (kept up by
        infra.down=false), attached to the run as attempt 2 and billed, logs lm-eval's scores into the run at
        the final checkpoint's step; the run stays FINISHED with its training config. It is asked for from a
        controller without lm-eval (issue #51: the tasks are checked where they are scored, on the node).
        The same command with ``--here`` scores on this machine and logs the same values at the same step
    (``llmctl``: the one installed from the wheel, as the node's)."""
    before = mc.get_run(rid)  # type: ignore[attr-defined]
    refused_here = without_lm_eval("eval", rid, *EVAL_FLAGS, "--here", timeout=120)
    assert refused_here.returncode == 3 and "lm-eval is not installed" in refused_here.stderr, refused_here.stderr
    out = without_lm_eval("eval", rid, *EVAL_FLAGS, timeout=420)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "lm-eval | step 40" in out.stdout and f"logged to run {rid}" in out.stdout, out.stdout[-3000:]
    run = mc.get_run(rid)  # type: ignore[attr-defined]
    tags = run.data.tags
    assert run.info.status == "FINISHED" and run.info.end_time == before.info.end_time, "the run's end stays training's"
    assert tags["llmctl.status"] == before.data.tags["llmctl.status"]
    assert tags["llmctl.attempt"] == "2" and tags["llmctl.attempt.2.kind"] == "eval", tags
    assert tags["llmctl.attempt.2.status"] == "eval: finished" and tags["llmctl.attempt.2.usd_per_hour"] == "unpriced"
    assert datetime.fromisoformat(tags["llmctl.attempt.2.start"]) < datetime.fromisoformat(tags["llmctl.attempt.2.end"])
    assert float(tags["cost/attempts"]) == 2
    assert float(tags["cost/billed_hours"]) > float(before.data.tags["cost/billed_hours"]), "the job's time is billed"
    assert tags["llmctl.sky.eval_job_id"] != tags["llmctl.sky.job_id"], "the training job's id stays on the run"
    names = [k for k in run.data.metrics if k.startswith("eval/python_facts_")]
    assert {"eval/python_facts_mc/acc", "eval/python_facts_mc/acc_stderr", "eval/python_facts_gen/exact_match"} <= set(
        names
    ), names
    job = {k: [(m.step, m.value) for m in mc.get_metric_history(rid, k)] for k in names}  # type: ignore[attr-defined]
    assert all(len(v) == 1 and v[0][0] == 40 for v in job.values()), job
    log = mc.download_artifacts(rid, "attempts/2/output.log", str(tmp_path / "dl"))  # type: ignore[attr-defined]
    assert "lm-eval | step 40" in Path(log).read_text()
    assert mc.download_artifacts(rid, "eval/step-40/lm_eval/samples_python_facts_mc.jsonl", str(tmp_path / "dl"))  # type: ignore[attr-defined]
    assert mc.download_artifacts(rid, "attempts/2/config.yaml", str(tmp_path / "dl"))  # type: ignore[attr-defined]

    here = llmctl("eval", rid, *EVAL_FLAGS, "--here", timeout=420)
    assert here.returncode == 0, here.stdout[-4000:] + here.stderr[-4000:]
    both = {k: [(m.step, m.value) for m in mc.get_metric_history(rid, k)] for k in names}  # type: ignore[attr-defined]
    differ = {k: (job[k], both[k]) for k in names if sorted(both[k]) != sorted(job[k] * 2)}
    assert not differ, differ
    assert mc.get_run(rid).data.tags["llmctl.attempt"] == "2", "scoring here is no job on the infra"  # type: ignore[attr-defined]


OFFLINE_NETWORK = Path(__file__).resolve().parent / "offline_network"


def _wait_for(what: str, ok: "callable[[], bool]", timeout: float, proc: subprocess.Popen[str]) -> None:  # type: ignore[valid-type]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        if proc.poll() is not None:
            raise AssertionError(f"llmctl launch exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.3)
    raise AssertionError(f"{what}: not after {timeout:.0f} s")


@contextlib.contextmanager
def _managed_jobs(
    cluster: Cluster, cli_env: dict[str, str], tracking_server: str
) -> Iterator[tuple[dict[str, str], str]]:
    """The client side of managed jobs on the harness (SSH config, the jobs controller in the local API
    server: consolidation mode) and the env for llmctl; every job cancelled and the API server stopped after."""
    home = Path(cli_env["HOME"])
    cluster.write_client_config(home, cluster.root / "ssh" / "user_key")
    (home / ".sky").mkdir(parents=True, exist_ok=True)
    (home / ".sky" / "config.yaml").write_text("jobs:\n  controller:\n    consolidation_mode: true\n")
    env = {
        **cli_env,
        **SMALL_API_SERVER,
        "MLFLOW_TRACKING_URI": tracking_server,
        "AWS_EC2_METADATA_DISABLED": "true",
        # the API server (and the jobs controller in it) inherit this: the internet probe stub only
        "PYTHONPATH": os.pathsep.join(filter(None, [str(OFFLINE_NETWORK), cli_env.get("PYTHONPATH")])),
    }
    sky_bin = str(Path(sys.executable).with_name("sky"))
    _wait_healthy(tracking_server)
    try:
        yield env, sky_bin
    finally:
        subprocess.run([sky_bin, "jobs", "cancel", "--all", "--yes"], env=env, capture_output=True, timeout=120)
        subprocess.run([sky_bin, "api", "stop"], env=env, capture_output=True, timeout=120)


def _assert_no_slurm_job_left(cluster: Cluster) -> None:
    deadline = time.monotonic() + 120  # the controller tears each job's cluster down after it succeeds
    while cluster.squeue().strip() and time.monotonic() < deadline:
        time.sleep(2)
    assert cluster.squeue().strip() == "", "no Slurm job left behind"


def _slurm_job_of(cluster: Cluster, tracking_uri: str, run_name: str) -> str:
    """The Slurm job of the run named ``run_name``: SkyPilot names a cluster's job after the cluster,
    ``llmctl-<run id[:10]>...`` (another test's job, still being torn down, may be listed first)."""
    from mlflow.tracking import MlflowClient

    mc = MlflowClient(tracking_uri=tracking_uri)
    exp = mc.get_experiment_by_name("llmctl")
    (run,) = mc.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.runName = '{run_name}'")
    prefix = f"llmctl-{run.info.run_id[:10]}"
    mine = [ln.split()[0] for ln in cluster.squeue().splitlines() if ln.strip() and ln.split()[1].startswith(prefix)]
    assert mine, f"no Slurm job named {prefix}...: {cluster.squeue()}"
    return mine[0]


def _complete_steps(ckpt: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in ckpt.glob("step-*/.complete"))


def test_managed_job_recovers_from_scancel_as_one_run(
    tracking_server: str, cluster: Cluster, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    """A run over two candidates (``infra.candidates``: two partitions of the cluster, each its own
    price): scancel the managed job's Slurm allocation mid-run with its first candidate closed to new
    jobs. SkyPilot's controller (consolidation mode, in the local API server) relaunches it on the
    second, the workload resumes from its checkpoint on the shared filesystem by itself, and the run
    finishes FINISHED as one MLflow run with two attempts, each billed at its own candidate's price;
    the controller tells ``notify.url`` of the recovery as it happens."""
    shared = cluster.root / "shared"  # the cluster's shared filesystem: where checkpoints outlive a node
    shared.mkdir()
    shutil.chown(shared, USER, USER)
    # The scancel follows the first complete checkpoint (step 20) after one squeue; the workload trains
    # on meanwhile, and the rest of the run (100 steps, several times what it trains while this test
    # polls, queries and cancels: the same machine runs both) is what keeps the scancel mid-run.
    # Periodic checkpoints every 20 steps also give the rerun one to start from if the emergency
    # save is lost.
    steps = 120
    first, second = (
        f"{{infra:slurm,name:{name},region:{CLUSTER},zone:{zone},price_per_gpu_hour:{price}}}"
        for name, zone, price in (("first", FIRST_CHOICE, 1.5), ("second", PARTITION, 4.0))
    )
    candidates = [f"infra.candidates=[{first},{second}]"]

    def close_first() -> None:  # running jobs go on; a new one is refused, so SkyPilot takes the next candidate
        subprocess.run(
            ["scontrol", "update", f"PartitionName={FIRST_CHOICE}", "State=DRAIN"], env=cluster.env, check=True
        )

    with _managed_jobs(cluster, cli_env, tracking_server) as (env, sky_bin), webhook_server() as (hook, base):
        try:
            run, status = _launch_and_recover(
                cluster, shared, steps, env, sky_bin, tmp_path, [*candidates, f"notify.url=[{base}/ops]"], close_first
            )
        finally:
            subprocess.run(["scontrol", "update", f"PartitionName={FIRST_CHOICE}", "State=UP"], env=cluster.env)
    tags = run.data.tags
    first_served, second_served = (
        f"{name} {CLUSTER}/{zone} CPU (slurm/{CLUSTER}/{zone})"  # the candidate, and where its node said it ran
        for name, zone in (("first", FIRST_CHOICE), ("second", PARTITION))
    )
    assert (tags["llmctl.attempt.1.served"], tags["llmctl.attempt.2.served"]) == (first_served, second_served)
    # a CPU node counts as one device: each attempt at its own candidate's price
    assert [tags[f"llmctl.attempt.{n}.usd_per_hour"] for n in (1, 2)] == ["1.500000", "4.000000"]
    assert f"attempt 1:   {first_served}, $1.50/h" in status, status  # `llmctl status RUN`
    assert f"attempt 2:   {second_served}, $4.00/h" in status
    events = [m["llmctl"]["event"] for m in hook.at("/ops")]
    assert events == ["recovered", "finished"], events
    recovered = hook.at("/ops")[0]["llmctl"]
    assert recovered["attempt"] == 2 and recovered["run_id"] == run.info.run_id
    assert f"recovered by SkyPilot: attempt 2 on {second_served}, from step" in hook.at("/ops")[0]["text"]


def _managed_launch(steps: int, ckpt: Path, run_name: str, extra: Sequence[str] = ()) -> list[str]:
    """``llmctl launch`` of the smoke job as a SkyPilot managed job on the harness's partition
    (``extra``: more overrides)."""
    return [
        sys.executable,
        "-m",
        "llmctl",
        "launch",
        "infra=slurm",
        "infra.managed=true",
        "experiment=smoke",
        f"infra.region={CLUSTER}",
        f"infra.zone={PARTITION}",
        f"infra.node_python={sys.executable}",
        "infra.cpus=1",
        "infra.memory=2",
        f"train.steps={steps}",
        "checkpoint.every=20",
        "train.val_every=60",
        f"checkpoint.dir={ckpt}",
        f"tracking.run_name={run_name}",
        *extra,
    ]


def _launch_and_recover(
    cluster: Cluster,
    shared: Path,
    steps: int,
    env: dict[str, str],
    sky_bin: str,
    tmp_path: Path,
    extra: Sequence[str] = (),
    before_cancel: Callable[[], None] = lambda: None,
) -> tuple[Any, str]:
    """Launch, scancel after the first complete checkpoint, and check the one run it finishes as;
    returns that run and what ``llmctl status`` said of it. ``before_cancel`` runs just before the scancel."""
    log = open(tmp_path / "launch.log", "w+")  # noqa: SIM115 - the launch's output, read after it ends
    proc = subprocess.Popen(
        _managed_launch(steps, shared / "ckpt", "managed-recovery", extra),
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for(
            "a complete checkpoint on the shared filesystem", lambda: bool(_complete_steps(shared / "ckpt")), 420, proc
        )
        first_ckpt = _complete_steps(shared / "ckpt")[0]
        slurm_job = _slurm_job_of(cluster, env["MLFLOW_TRACKING_URI"], "managed-recovery")
        before_cancel()
        subprocess.run(["scancel", slurm_job], env=cluster.env, check=True, timeout=30)
        assert proc.wait(timeout=840) == 0, _tail(log)

        from mlflow.tracking import MlflowClient

        mc = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
        runs = mc.search_runs(
            [mc.get_experiment_by_name("llmctl").experiment_id],
            filter_string="tags.mlflow.runName = 'managed-recovery'",
        )
        assert len(runs) == 1, "one MLflow run across the recovery"
        run = runs[0]
        tags = run.data.tags
        assert run.info.status == "FINISHED", tags.get("llmctl.status")
        assert tags["llmctl.attempt"] == "2" and tags.get("llmctl.sky.task_id"), tags
        assert "llmctl.attempt.1.end" in tags and "llmctl.attempt.2.end" in tags, "both attempts billed and closed"
        assert int(tags["llmctl.attempt.2.from_step"]) >= first_ckpt > 0, "the rerun resumed from a checkpoint"
        assert datetime.fromisoformat(tags["llmctl.attempt.1.end"]) <= datetime.fromisoformat(
            tags["llmctl.attempt.2.start"]
        )
        # scancel sends SIGTERM, then SIGKILL after Slurm's KillWait. When the workload's handler wins
        # (the usual case) it saves and tags the run, and the rerun starts from that emergency save; on a
        # loaded machine the step's processes can be killed first (seen once in CI), and the rerun then
        # starts from the last periodic checkpoint, asserted above. Either way nothing is logged twice.
        if "llmctl.preempted" in tags:
            preempted = json.loads(tags["llmctl.preempted"])
            assert preempted["signal"] == "SIGTERM"
            assert preempted["checkpoint"] == int(tags["llmctl.attempt.2.from_step"]), (preempted, tags)
        losses = mc.get_metric_history(run.info.run_id, "train/loss")
        logged = [m.step for m in losses]
        assert len(logged) == len(set(logged)), "no step logged twice across the recovery"
        assert max(logged) == steps
        assert mc.get_metric_history(run.info.run_id, "val/loss")[-1].step == steps
        assert float(run.data.tags["cost/attempts"]) == 2

        status = run_cli(["status", run.info.run_id], tmp_path, env, timeout=120)
        assert "SUCCEEDED" in status.stdout, status.stdout + status.stderr
        queue = subprocess.run(
            [sky_bin, "jobs", "queue", "--all"], env=env, capture_output=True, text=True, timeout=120
        ).stdout
        assert "SUCCEEDED" in queue, queue
        _assert_no_slurm_job_left(cluster)
        return mc.get_run(run.info.run_id), status.stdout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        log.close()


def test_a_transformers_script_as_a_managed_job_recovers_from_scancel_as_one_run(
    tracking_server: str, cluster: Cluster, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    """``workload=command``: the transformers ``Trainer`` script of tests/e2e/programs (shipped from
    the launch directory with the tiny Llama it trains) as a managed job. scancel its Slurm
    allocation once it has logged a few steps: SkyPilot reruns it, the guard starts it with
    ``LLMCTL_RESUME=1``, it continues from its newest checkpoint on the shared filesystem
    (``resume_from_checkpoint``), and the one MLflow run holds every step over two billed attempts.
    The program gets the contract's run folder as on infra=local, and a secret named in
    ``workload.secrets`` (a SkyPilot secret) that appears in no MLflow record, artifact or log."""
    shared = cluster.root / "shared-program"
    shared.mkdir()
    shutil.chown(shared, USER, USER)
    shutil.copy(Path(__file__).parents[1] / "e2e" / "programs" / "hf_trainer.py", tmp_path / "hf_trainer.py")
    save_tiny_llama(tmp_path / "tiny")
    steps = 60
    secret = f"s3cr3t-{uuid.uuid4().hex}"  # made here: no file of the tree holds it
    with _managed_jobs(cluster, {**cli_env, "LLMCTL_TEST_API_KEY": secret}, tracking_server) as (env, sky_bin):
        from mlflow.tracking import MlflowClient

        mc = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
        log = open(tmp_path / "launch.log", "w+")  # noqa: SIM115 - the launch's output, read after it ends
        launch = [
            sys.executable,
            "-m",
            "llmctl",
            "launch",
            "infra=slurm",
            "infra.managed=true",
            f"infra.region={CLUSTER}",
            f"infra.zone={PARTITION}",
            f"infra.node_python={sys.executable}",
            "infra.cpus=1",
            "infra.memory=2",
            "workload=command",
            "workload.run=python hf_trainer.py --model tiny",
            f"workload.args.max_steps={steps}",
            "workload.args.save_steps=2",
            "workload.args.step_sleep=0.3",
            f"checkpoint.dir={shared / 'out'}",
            f"workload.args.contract_report={shared / 'contract.json'}",
            "workload.secrets=[LLMCTL_TEST_API_KEY]",
            "tracking.run_name=program-recovery",
        ]
        proc = subprocess.Popen(
            launch, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )

        def losses() -> list[int]:
            exp = mc.get_experiment_by_name("llmctl")
            found = mc.search_runs([exp.experiment_id], "tags.mlflow.runName = 'program-recovery'") if exp else []
            return [m.step for m in mc.get_metric_history(found[0].info.run_id, "loss")] if found else []

        try:
            _wait_for(
                "a checkpoint and 5 logged steps",
                lambda: len(losses()) >= 5 and any((shared / "out").glob("checkpoint-*")),
                420,
                proc,
            )
            job = _slurm_job_of(cluster, env["MLFLOW_TRACKING_URI"], "program-recovery")
            subprocess.run(["scancel", job], env=cluster.env, check=True, timeout=30)
            assert proc.wait(timeout=840) == 0, _tail(log)

            runs = mc.search_runs(
                [mc.get_experiment_by_name("llmctl").experiment_id],
                filter_string="tags.mlflow.runName = 'program-recovery'",
            )
            assert len(runs) == 1, "one MLflow run across the recovery"
            run, tags = runs[0], runs[0].data.tags
            assert run.info.status == "FINISHED", tags.get("llmctl.status")
            assert tags["llmctl.attempt"] == "2" and float(tags["cost/attempts"]) == 2, tags
            assert "llmctl.attempt.1.end" in tags and "llmctl.attempt.2.end" in tags, "both attempts billed and closed"
            logged = losses()
            assert sorted(set(logged)) == list(range(1, steps + 1)), logged
            # the rerun continued from a checkpoint: steps before it were not trained (logged) again
            assert logged.count(1) == 1 and len(logged) < 2 * steps - 5, logged
            _assert_no_slurm_job_left(cluster)
            _assert_contract_and_secret_kept(mc, run, shared / "contract.json", secret, log, tmp_path)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
            log.close()


def _assert_contract_and_secret_kept(
    mc: "object", run: "object", report: Path, secret: str, log: "object", tmp_path: Path
) -> None:
    """The node's program saw the run folder (with the resolved config) and the forwarded secret; the
    secret is in none of the run's params, tags or artifacts, nor in what the launch printed."""
    seen = json.loads(report.read_text())
    assert seen["config"] and Path(seen["run_dir"]).name == run.info.run_id, seen  # type: ignore[attr-defined]
    assert seen["key_sha256"] == hashlib.sha256(secret.encode()).hexdigest()[:16], seen
    data = run.data  # type: ignore[attr-defined]
    assert data.params["workload.secrets"] == "['LLMCTL_TEST_API_KEY']"
    assert secret not in json.dumps([data.params, data.tags])
    artifacts = Path(mc.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts")))  # type: ignore[attr-defined]
    leaked = [str(p) for p in artifacts.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    log.seek(0)  # type: ignore[attr-defined]
    assert leaked == [] and secret not in log.read(), leaked  # type: ignore[attr-defined]


def _tail(log: "object") -> str:
    log.seek(0)  # type: ignore[attr-defined]
    return log.read()[-6000:]  # type: ignore[attr-defined]


def test_sweep_trials_run_as_managed_jobs_on_slurm(
    tracking_server: str, cluster: Cluster, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    """A grid sweep whose trials are SkyPilot managed jobs on Slurm: each trial's controller submits
    its managed job and follows it, so the sweep ends with one FINISHED child run per trial and no
    Slurm job left behind."""
    steps = 4
    with _managed_jobs(cluster, cli_env, tracking_server) as (env, sky_bin):
        out = run_cli(
            [
                "launch",
                "-m",
                "--wait",
                "--max-parallel",
                "1",
                "infra=slurm",
                "infra.managed=true",
                "experiment=smoke",
                f"infra.region={CLUSTER}",
                f"infra.zone={PARTITION}",
                f"infra.node_python={sys.executable}",
                "infra.cpus=1",
                "infra.memory=2",
                f"train.steps={steps}",
                "train.log_every=1",
                "train.val_every=2",
                "train.val_batches=1",
                "checkpoint.every=0",
                "tracking.run_name=managed-sweep",
                "train.lr=1e-3,3e-3",
            ],
            tmp_path,
            env,
            timeout=600,
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        sid = next(w.rstrip(":") for w in out.stdout.split() if w.startswith("sweep-"))

        from mlflow.tracking import MlflowClient

        mc = MlflowClient(tracking_uri=tracking_server)
        runs = mc.search_runs(
            [mc.get_experiment_by_name("llmctl").experiment_id], filter_string=f"tags.`llmctl.sweep_id` = '{sid}'"
        )
        (parent,) = [r for r in runs if r.data.tags.get("llmctl.kind") == "sweep"]
        assert parent.info.status == "FINISHED", parent.data.tags.get("llmctl.status")
        trials = sorted(
            (r for r in runs if r.data.tags.get("llmctl.kind") == "trial"),
            key=lambda r: int(r.data.tags["llmctl.trial"]),
        )
        assert [t.data.tags["llmctl.trial"] for t in trials] == ["0", "1"], "each trial once"
        assert all(t.data.tags["mlflow.parentRunId"] == parent.info.run_id for t in trials)
        assert [t.info.status for t in trials] == ["FINISHED"] * 2, [t.data.tags.get("llmctl.status") for t in trials]
        assert [t.data.params["train.lr"] for t in trials] == ["0.001", "0.003"]
        job_ids = [t.data.tags.get("llmctl.sky.managed_job_id") for t in trials]
        assert all(job_ids) and len(set(job_ids)) == 2, "each trial submitted its own managed job"
        for t, job_id in zip(trials, job_ids):
            assert "llmctl.sky.cluster" not in t.data.tags, "a managed job, not a cluster launch"
            task_id = t.data.tags.get("llmctl.sky.task_id", "")  # set by the workload from SKYPILOT_TASK_ID
            assert task_id.startswith("sky-managed-") and task_id.endswith(f"_{job_id}-0"), (task_id, job_id)
            assert mc.get_metric_history(t.info.run_id, "val/loss")[-1].step == steps, "trained on the node"

        status = run_cli(["status", sid], tmp_path, env, timeout=120)
        assert status.returncode == 0, status.stderr
        assert "2 trials: 2 FINISHED" in status.stdout and "supervisor exited" in status.stdout, status.stdout
        queue = subprocess.run(
            [sky_bin, "jobs", "queue", "--all"], env=env, capture_output=True, text=True, timeout=120
        ).stdout
        assert queue.count("SUCCEEDED") >= 2, queue
        _assert_no_slurm_job_left(cluster)


def test_a_recovered_then_crashed_managed_job_ends_failed(
    tracking_server: str, cluster: Cluster, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    """Issue #32: a managed job preempted (scancel: the workload saves and tags ``llmctl.preempted``),
    recovered by SkyPilot, then crashed (every checkpoint unreadable, so the rerun fails loading it)
    ends FAILED, exit 1: the first start's preemption is not how the second one ended."""
    from llmctl.cost import ledger

    shared = cluster.root / "shared-crash"
    shared.mkdir()
    shutil.chown(shared, USER, USER)
    ckpt = shared / "ckpt"
    with _managed_jobs(cluster, cli_env, tracking_server) as (env, sky_bin):
        log = open(tmp_path / "launch.log", "w+")  # noqa: SIM115 - the launch's output, read after it ends
        proc = subprocess.Popen(
            _managed_launch(1200, ckpt, "managed-crash"),  # the scancel comes long before: the rerun crashes
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            _wait_for("a complete checkpoint on the shared filesystem", lambda: bool(_complete_steps(ckpt)), 420, proc)
            slurm_job = _slurm_job_of(cluster, env["MLFLOW_TRACKING_URI"], "managed-crash")
            subprocess.run(["scancel", slurm_job], env=cluster.env, check=True, timeout=30)

            def first_gone() -> bool:
                return slurm_job not in [line.split()[0] for line in cluster.squeue().splitlines() if line.strip()]

            _wait_for("the first allocation to end (its emergency save done)", first_gone, 300, proc)
            for shard in ckpt.glob("step-*/*.distcp"):  # the rerun will crash loading any of them
                shard.unlink()
            assert proc.wait(timeout=840) == 1, _tail(log)

            from mlflow.tracking import MlflowClient

            mc = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
            (run,) = mc.search_runs(
                [mc.get_experiment_by_name("llmctl").experiment_id],
                filter_string="tags.mlflow.runName = 'managed-crash'",
            )
            tags = run.data.tags
            assert run.info.status == "FAILED", tags.get("llmctl.status")
            assert tags["llmctl.status"] == "workload exited with code 1", tags["llmctl.status"]
            assert len(ledger.workload_starts(tags)) == 2, "the first start and SkyPilot's rerun"
            if "llmctl.preempted" in tags:  # the first start's (scancel's SIGTERM usually wins: see above)
                assert json.loads(tags["llmctl.preempted"])["start"] == 1, tags["llmctl.preempted"]
            rows = ledger.attempts(tags)
            assert [a.n for a in rows] == [1, 2] and all(a.end is not None for a in rows), "both billed, closed"
            _assert_no_slurm_job_left(cluster)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
            log.close()


def _wheel_venv(cluster: Cluster, tmp_path: Path) -> Path:
    """A fresh venv outside the checkout, in the cluster's shared directory (the node's Python too),
    with llmctl's wheel installed (not editable, ``pip install --no-deps``). Its dependencies are this
    suite's environment's, through a path entry (not its .pth files: this checkout's editable llmctl
    stays out), so nothing is downloaded: what differs from the checkout is llmctl alone. How a node
    installs the shipped wheel itself is tests/sky/test_node_setup.py's."""
    import sysconfig

    from llmctl.distribution.wheel import wheel_for_nodes

    wheel = wheel_for_nodes(tmp_path / "wheels")
    venv = cluster.root / "installed"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "suite_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv
