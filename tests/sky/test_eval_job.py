"""``llmctl eval RUN --tasks`` of a cloud or Slurm run: what the job attached to the run is given, and
what is refused before anything exists. The job itself runs on a real Slurm cluster in
tests/sky/test_slurm_launch.py."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient
from sky_helpers import REMOTE_URI, run_cli

from llmctl.config.compose import compose, to_yaml
from llmctl.run import benchmark_scores
from llmctl.run.eval_and_export import Target

TASK_YAMLS = Path(__file__).resolve().parents[2] / "examples" / "eval-tasks"


def _target(overrides: list[str], tmp_path: Path) -> Target:
    cfg = compose([*overrides, f"tracking.uri={REMOTE_URI}", "checkpoint.dir=/shared/ckpt"]).cfg
    return Target(cfg, "r1", REMOTE_URI, None, tmp_path)


def test_the_job_scores_the_request_on_one_node_as_a_cluster_job(tmp_path: Path) -> None:
    """The run's config with the request in ``eval.*`` and the checked step pinned; one node whatever the
    run trained on, the default mesh (one process scores), and a managed run's job torn down after."""
    t = _target(["infra=aws", "infra.nodes=4", "infra.managed=true", "parallel.dp_replicate=4"], tmp_path)
    request = benchmark_scores.TaskRequest(["python_facts_mc"], str(TASK_YAMLS), 1, 4, "auto", True)
    cfg = benchmark_scores.job_config(t, request, 40)
    assert cfg["eval"]["tasks"] == ["python_facts_mc"] and cfg["eval"]["include_path"] == str(TASK_YAMLS)
    assert (cfg["eval"]["num_fewshot"], cfg["eval"]["limit"], cfg["eval"]["batch_size"]) == (1, 4, "auto")
    assert cfg["eval"]["step"] == 40 and cfg["eval"]["every"] is None
    assert (cfg["infra"]["nodes"], cfg["infra"]["managed"], cfg["infra"]["down"]) == (1, False, True)
    assert (cfg["parallel"]["dp_replicate"], cfg["parallel"]["dp_shard"], cfg["parallel"]["tp"]) == (1, -1, 1)
    assert cfg["model"] == t.cfg["model"] and cfg["checkpoint"] == t.cfg["checkpoint"] and cfg["data"] == t.cfg["data"]
    assert t.cfg["infra"]["nodes"] == 4, "the run's own config is left as it was"
    kept = benchmark_scores.job_config(_target(["infra=aws", "infra.down=false"], tmp_path), request, None)
    assert kept["infra"]["down"] is False and kept["eval"]["step"] is None  # None: the node takes the newest
    assert benchmark_scores.on_infra(t) and not benchmark_scores.on_infra(_target([], tmp_path))


def test_the_job_rents_one_gpu_unless_it_spreads_the_model() -> None:
    """A run trained on 8 GPUs per node is scored on one of the same kind (one process scores); with
    ``--parallelize`` lm-eval spreads the model over the node's GPUs, so the job keeps them all."""
    t = _target(["infra=aws", "infra.accelerators=H100:8"], Path("/tmp"))
    one = benchmark_scores.TaskRequest(["python_facts_mc"], None, None, None, "1", False)
    spread = benchmark_scores.TaskRequest(["python_facts_mc"], None, None, None, "1", True)
    assert benchmark_scores.job_config(t, one, None)["infra"]["accelerators"] == "H100:1"
    assert benchmark_scores.job_config(t, spread, None)["infra"]["accelerators"] == "H100:8"
    assert t.cfg["infra"]["accelerators"] == "H100:8", "the run's own config is left as it was"
    cpu = benchmark_scores.job_config(_target(["infra=slurm", "infra.accelerators=null"], Path("/tmp")), one, None)
    assert not cpu["infra"].get("accelerators")  # a CPU run's job asks for no GPU


def test_the_score_jobs_skypilot_task_asks_for_one_gpu(sky_home: Path) -> None:
    """The job's config as SkyPilot reads it (``task_config`` -> ``sky.Task``): a run trained on H100:8
    is scored by a task that requests one H100, on one node; with ``--parallelize``, all eight."""
    import copy

    import sky

    from llmctl.backends.sky import task as sky_task

    t = _target(["infra=lambda", "infra.accelerators=H100:8", "infra.nodes=2"], Path("/tmp"))
    for parallelize, gpus in ((False, 1), (True, 8)):
        request = benchmark_scores.TaskRequest(["python_facts_mc"], None, None, None, "1", parallelize)
        config = sky_task.task_config(
            benchmark_scores.job_config(t, request, None),
            run_id="r1",
            tracking_uri=REMOTE_URI,
            experiment_id="7",
            local_config="/tmp/cfg.yaml",
            environ={},
            job="score",
            parallelize=parallelize,
        )
        task = sky.Task.from_yaml_config(copy.deepcopy(config))
        (res,) = list(task.resources)
        assert res.accelerators == {"H100": gpus} and task.num_nodes == 1, (res, task.num_nodes)


def _refused(tmp_path: Path, env: dict[str, str], status: str, ckpt: str) -> tuple[str, str]:
    """A Slurm run (its config as launch logs it) in ``status`` scored with --tasks: must exit 3 with one
    line, open no attempt and launch nothing. (the run id, the line)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mc = MlflowClient(tracking_uri=uri)
    exp = mc.get_experiment_by_name("llmctl")
    rid = mc.create_run(exp.experiment_id if exp else mc.create_experiment("llmctl")).info.run_id
    cfg = compose(["infra=slurm", "infra.region=c", "experiment=smoke", f"tracking.uri={uri}"]).cfg
    cfg["checkpoint"]["dir"] = ckpt
    mc.log_text(rid, to_yaml(cfg), "config.yaml")
    if status != "RUNNING":
        mc.set_terminated(rid, status)
    flags = ["--tasks", "python_facts_mc", "--include-path", str(TASK_YAMLS), "--tracking-uri", uri]
    out = run_cli(["eval", rid, *flags], tmp_path, env, timeout=300)
    assert out.returncode == 3, out.stdout + out.stderr
    (line,) = out.stderr.strip().splitlines()
    tags = mc.get_run(rid).data.tags
    assert not [k for k in tags if k.startswith("llmctl.attempt")], tags
    return rid, line


def test_a_running_run_is_refused_before_anything_is_created(tmp_path: Path, sky_env: dict[str, str]) -> None:
    """A run still RUNNING (its job on its nodes): its open attempt would take the job's end as its own."""
    rid, line = _refused(tmp_path, sky_env, "RUNNING", str(tmp_path / "ckpt"))
    assert f"run {rid} is still running" in line and "--here" in line, line


def test_checkpoints_left_on_nodes_that_are_gone_are_refused(tmp_path: Path, sky_env: dict[str, str]) -> None:
    """Checkpoints on the nodes' own disks (no checkpoint.dir, no bucket) and no cluster kept up: nothing
    to score, said before a cluster is paid for to find nothing."""
    rid, line = _refused(tmp_path, sky_env, "FINISHED", "llmctl-runs/r/checkpoints")
    assert f"run {rid} kept its checkpoints on its nodes' disks" in line and "checkpoint.dir=" in line, line


def test_status_closes_an_eval_attempt_whose_controller_was_killed(tmp_path: Path, sky_env: dict[str, str]) -> None:
    """An eval job's controller SIGKILLed (nothing of it ran its close): ``llmctl status`` finds the attempt
    open and its controller gone, and closes it at its last output, saying so; the run stays FINISHED."""
    import json
    import os
    import subprocess
    import time

    from llmctl.cost import ledger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mc = MlflowClient(tracking_uri=uri)
    rid = mc.create_run(mc.create_experiment("llmctl")).info.run_id
    cfg = compose(["infra=slurm", "infra.region=c", "experiment=smoke", f"tracking.uri={uri}"]).cfg
    mc.log_text(rid, to_yaml(cfg), "config.yaml")
    mc.set_tag(rid, "llmctl.backend", "sky")
    start = time.time() - 600
    ledger.open_attempt(mc, rid, usd_per_hour=None, nodes=1, devices=1, start=start - 3600)
    ledger.close_attempt(mc, rid, 1, start - 60)
    mc.set_terminated(rid, "FINISHED")
    ledger.open_attempt(mc, rid, usd_per_hour=None, nodes=1, devices=1, start=start, extra={"kind": "eval"})
    dead = subprocess.Popen(["true"])
    dead.wait()
    rdir = tmp_path / "llmctl-runs" / rid
    rdir.mkdir(parents=True)
    (rdir / "controller.json").write_text(json.dumps({"pid": dead.pid, "start": 1.0}))
    (rdir / "score.log").write_text("lm-eval | scoring step 40\n")
    os.utime(rdir / "score.log", (start + 120, start + 120))

    out = run_cli(["status", rid, "--tracking-uri", uri], tmp_path, sky_env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "closed attempt(s) 2: their controller was gone" in out.stdout, out.stdout
    run = mc.get_run(rid)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags["llmctl.attempt.2.status"].startswith("eval: its controller ended without closing it"), tags
    assert abs(ledger.seconds(tags["llmctl.attempt.2.end"]) - (start + 120)) < 1, "billed to its last output"
    assert not ledger.compute(tags).open and float(tags["cost/attempts"]) == 2
    again = run_cli(["status", rid, "--tracking-uri", uri], tmp_path, sky_env, timeout=300)
    assert "closed attempt" not in again.stdout, again.stdout
