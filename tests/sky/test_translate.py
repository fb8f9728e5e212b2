"""Config → SkyPilot task, per provider: SkyPilot's own YAML loader accepts what we generate, and the
run script turns a 2-node SKYPILOT_* environment into the right torchrun arguments."""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from sky_helpers import REMOTE_URI, node_python, version_env

from llmctl.backends.sky import task as sky_task
from llmctl.config.compose import compose
from llmctl.distribution.identity import describe
from workloads.protocol.run_contract import ATTEMPT_ENVS


def _task(overrides: list[str], environ: dict[str, str] | None = None, **kwargs: Any) -> tuple[dict[str, Any], Any]:
    """The task of ``overrides`` (``kwargs``: task_config's own, e.g. ``job="score"``), and SkyPilot's reading of it."""
    import sky

    cfg = compose(overrides + [f"tracking.uri={REMOTE_URI}"]).cfg
    config = sky_task.task_config(
        cfg,
        run_id="abc123",
        tracking_uri=REMOTE_URI,
        experiment_id="7",
        local_config="/tmp/cfg.yaml",
        environ=environ or {},
        **kwargs,
    )
    task = sky.Task.from_yaml_config(copy.deepcopy(config))  # the loader consumes its input
    return config, task


def _only(resources: Any) -> Any:
    (res,) = list(resources)
    return res


@pytest.mark.parametrize(
    "overrides, cloud, region, acc, spot, nodes",
    [
        (["infra=lambda", "infra.nodes=2"], "Lambda", None, {"H100": 8}, False, 2),
        (["infra=runpod", "infra.accelerators=H100:8"], "RunPod", None, {"H100-SXM": 8}, False, 1),
        (["infra=aws", "infra.use_spot=true", "infra.accelerators=A100:8"], "AWS", "us-east-1", {"A100": 8}, True, 1),
        (
            ["infra=slurm", "infra.region=mycluster", "infra.zone=gpu", "infra.accelerators=H100:4"],
            "Slurm",
            "mycluster",
            {"H100": 4},
            False,
            1,
        ),
        (["infra=kubernetes", "infra.region=gpu-ctx", "infra.nodes=2"], "Kubernetes", "gpu-ctx", {"H100": 8}, False, 2),
    ],
)
def test_task_round_trips_through_skypilot(
    sky_home: Path, overrides: list[str], cloud: str, region: str | None, acc: dict[str, int], spot: bool, nodes: int
) -> None:
    import sky

    config, task = _task(overrides)
    res = _only(task.resources)
    assert str(res.cloud) == cloud
    assert res.region == region
    assert res.accelerators == acc  # aliases applied: RunPod's H100 is H100-SXM
    assert res.use_spot is spot
    assert task.num_nodes == nodes
    assert task.envs["MLFLOW_TRACKING_URI"] == REMOTE_URI and task.envs["MLFLOW_RUN_ID"] == "abc123"
    assert "~/.llmctl/runs/abc123/config.yaml" in task.file_mounts
    # the nodes install the controller's llmctl from the wheel the task ships, nothing from a checkout
    assert task.file_mounts["~/.llmctl/wheels/<llmctl wheel>"] == "<llmctl wheel>"  # built by the launch
    assert '"$WHEEL${LLMCTL_EXTRAS:-}"' in task.setup and "-e ." not in task.setup and task.workdir is None
    assert task.envs["LLMCTL_VERSION_LINE"] == describe()
    assert "LLMCTL_EXTRAS" not in task.envs  # llmctl alone: no eval.tasks here
    assert "workloads.pretrain" in task.run
    # and once more through YAML text, as `sky launch task.yaml` would read it
    again = sky.Task.from_yaml_config(task.to_yaml_config())
    assert _only(again.resources).accelerators == acc and again.num_nodes == nodes


@pytest.mark.parametrize(
    "overrides, extras",
    [
        (["eval.tasks=[python_facts_mc]"], "[eval]"),
        (["train.fp8=tensorwise", "checkpoint.dir=s3://b/ck"], "[fp8,s3]"),
        (
            ["model=1b", "model.lora.rank=8", "model.lora.quantize_base=nf4", "data.source=gs://b/*.jsonl"],
            "[gcs,qlora]",
        ),
    ],
)
def test_the_nodes_install_the_extras_the_config_uses(sky_home: Path, overrides: list[str], extras: str) -> None:
    """``eval.tasks``: lm-eval scores checkpoints on the nodes; FP8, NF4, s3:// and gs:// need theirs."""
    _, task = _task(["infra=lambda", *overrides])
    assert task.envs["LLMCTL_EXTRAS"] == extras
    lines = [ln.strip() for ln in task.setup.splitlines()]
    wheel = next(ln for ln in lines if ln.startswith("WHEEL="))
    install = next(ln for ln in lines if ln.startswith("node_install $LLMCTL_PIP_ARGS"))
    shown = subprocess.run(
        ["bash", "-c", f"{wheel}; echo " + install.split("$LLMCTL_PIP_ARGS ", 1)[1]],
        env={"LLMCTL_EXTRAS": extras, "HOME": "/h", "LLMCTL_WHEEL": "llmctl_train-1-py3-none-any.whl"},
        capture_output=True,
        text=True,
    )
    assert shown.stdout.strip() == f"/h/.llmctl/wheels/llmctl_train-1-py3-none-any.whl{extras}"


def test_autostop_spot_and_managed_are_data(sky_home: Path) -> None:
    _, lam = _task(["infra=lambda"])
    assert _only(lam.resources).autostop_config.idle_minutes == 10
    assert _only(lam.resources).autostop_config.down is True
    config, slurm = _task(["infra=slurm"])
    assert "autostop" not in config["resources"]  # Slurm has none
    config, managed = _task(["infra=aws", "infra.managed=true", "infra.use_spot=true"])
    assert _only(managed.resources).job_recovery is not None and "autostop" not in config["resources"]


def test_bucket_is_a_mount_where_supported_and_a_url_on_runpod(sky_home: Path) -> None:
    cfg = compose(["infra=aws", "infra.bucket=s3://ckpts/llm", f"tracking.uri={REMOTE_URI}"]).cfg
    assert sky_task.checkpoint_dir(cfg, "r1") == "/llmctl-ckpt/r1"
    cfg["checkpoint"]["dir"] = "/llmctl-ckpt/r1"
    config = sky_task.task_config(
        cfg,
        run_id="r1",
        tracking_uri=REMOTE_URI,
        experiment_id="1",
        local_config="/tmp/c.yaml",
        environ={},
    )
    import sky

    task = sky.Task.from_yaml_config(config)
    storage = task.storage_mounts["/llmctl-ckpt"]
    assert storage.source == "s3://ckpts/llm" and storage.mode.value == "MOUNT"
    cfg = compose(["infra=runpod", "infra.bucket=s3://ckpts/llm", f"tracking.uri={REMOTE_URI}"]).cfg
    assert sky_task.checkpoint_dir(cfg, "r1") == "s3://ckpts/llm/r1"


def test_credentials_are_secrets_never_envs(sky_home: Path) -> None:
    environ = {"MLFLOW_TRACKING_PASSWORD": "pw", "HF_TOKEN": "hf", "AWS_SECRET_ACCESS_KEY": "k", "UNRELATED": "x"}
    config, task = _task(["infra=lambda"], environ)
    assert config["secrets"] == {"MLFLOW_TRACKING_PASSWORD": "pw", "HF_TOKEN": "hf", "AWS_SECRET_ACCESS_KEY": "k"}
    assert not set(config["secrets"]) & set(task.envs)
    uri = "https://user:token@mlflow.example"
    assert sky_task.secrets_from({}, uri) == {"MLFLOW_TRACKING_URI": uri}


def test_attempt_and_budget_reach_the_nodes(sky_home: Path) -> None:
    """The attempt's environment (RunHandle.attempt_env) travels as task envs; the launching
    process's own LLMCTL_* variables do not."""
    import sky

    attempt = {
        "LLMCTL_ATTEMPT": "3",
        "LLMCTL_MAX_COST_USD": "12.500000",
        "LLMCTL_SPENT_USD": "4.2",
        "LLMCTL_BILLING_START": "1700000000.000",
        "LLMCTL_PRICE_PER_HOUR": "23.92",
    }
    assert set(attempt) == set(ATTEMPT_ENVS)  # the trainer's contract names every one of them
    cfg = compose(["infra=lambda", f"tracking.uri={REMOTE_URI}"]).cfg
    config = sky_task.task_config(
        cfg,
        run_id="abc123",
        tracking_uri=REMOTE_URI,
        experiment_id="7",
        local_config="/tmp/cfg.yaml",
        environ={"LLMCTL_ATTEMPT": "9", "LLMCTL_OTHER": "x"},
        attempt_env=attempt,
    )
    task = sky.Task.from_yaml_config(copy.deepcopy(config))
    assert {k: task.envs[k] for k in ATTEMPT_ENVS} == attempt
    assert "LLMCTL_OTHER" not in task.envs
    assert "LLMCTL_ATTEMPT" not in _task(["infra=lambda"], {"LLMCTL_ATTEMPT": "9"})[1].envs


def _fake_python(tmp_path: Path) -> Path:
    return node_python(tmp_path / "python", 'for a in "$@"; do printf "%s\\n" "$a"; done')


def _node_argv(tmp_path: Path, ips: list[str], rank: int, envs: dict[str, str]) -> list[str]:
    """The run script executed under a fake SkyPilot environment (``ips``: the nodes, 8 GPUs each; the
    task's ``LLMCTL_*`` ``envs``): the argv it gives the (fake) Python."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "SKYPILOT_NUM_NODES": str(len(ips)),
        "SKYPILOT_NODE_RANK": str(rank),
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
        "SKYPILOT_NODE_IPS": "\n".join(ips),
        **version_env(),
        **{k: v for k, v in envs.items() if k.startswith("LLMCTL_")},
        "LLMCTL_PYTHON": str(_fake_python(tmp_path)),
    }
    said, *argv = subprocess.run(
        ["bash", "-c", sky_task.RUN], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert said == f"llmctl on node {rank}: {describe()}"  # what the node runs, in the run's log first
    return argv


@pytest.mark.parametrize("rank", [0, 1])
def test_run_script_gives_torchrun_two_node_arguments(tmp_path: Path, rank: int) -> None:
    """Execute the task's run script under a fake 2-node SkyPilot environment; read the argv."""
    assert _node_argv(tmp_path, ["10.0.0.1", "10.0.0.2"], rank, {"LLMCTL_RUN_ID": "abc123"}) == [
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=8",
        f"--node_rank={rank}",
        "--master_addr=10.0.0.1",
        "--master_port=29500",
        "-m",
        "workloads.pretrain",
        "--config",
        f"{tmp_path}/.llmctl/runs/abc123/config.yaml",
    ]


def test_cpu_nodes_take_process_count_from_config(tmp_path: Path) -> None:
    cfg = compose(["infra=slurm", "parallel=fsdp2", f"tracking.uri={REMOTE_URI}"]).cfg
    config = sky_task.task_config(
        cfg,
        run_id="r",
        tracking_uri=REMOTE_URI,
        experiment_id="1",
        local_config="/tmp/c.yaml",
        environ={},
    )
    assert config["envs"]["LLMCTL_NPROC_PER_NODE"] == "2"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NUM_GPUS_PER_NODE": "0",
        "SKYPILOT_NODE_IPS": "127.0.0.1",
        "LLMCTL_RUN_ID": "r",
        "LLMCTL_PYTHON": str(_fake_python(tmp_path)),
        **config["envs"],
    }
    env["LLMCTL_PYTHON"] = str(_fake_python(tmp_path))
    out = subprocess.run(["bash", "-c", config["run"]], env=env, capture_output=True, text=True, check=True)
    assert "--nproc_per_node=2" in out.stdout.splitlines()


TASK_YAMLS = Path(__file__).resolve().parents[2] / "examples" / "eval-tasks"


def test_eval_include_path_is_copied_to_the_nodes_and_their_config_names_the_copy(sky_home: Path) -> None:
    """``eval.include_path`` is a directory on the controller: the task mounts it on every node, and the
    config the nodes read names the copy; the run's own config keeps the controller's path (a resume
    checks the tasks here again)."""
    overrides = ["infra=lambda", "eval.tasks=[python_facts_mc]", f"eval.include_path={TASK_YAMLS}"]
    cfg = compose([*overrides, f"tracking.uri={REMOTE_URI}"]).cfg
    config, _ = _task(overrides)
    assert config["file_mounts"]["~/.llmctl/runs/abc123/eval-tasks"] == str(TASK_YAMLS)
    node = sky_task.node_config(cfg, "abc123")
    assert node["eval"]["include_path"] == "~/.llmctl/runs/abc123/eval-tasks"
    assert cfg["eval"]["include_path"] == str(TASK_YAMLS)
    assert node["model"] == cfg["model"]
    no_tasks = compose(["infra=lambda", f"tracking.uri={REMOTE_URI}"]).cfg
    # and no ``notify``: the controller sends the messages, and its endpoints are credentials
    assert sky_task.node_config(no_tasks, "abc123") == {k: v for k, v in no_tasks.items() if k != "notify"}
    assert not any("eval-tasks" in k for k in _task(["infra=lambda"])[0]["file_mounts"])


def test_a_score_job_runs_the_scorer_in_one_process(sky_home: Path, tmp_path: Path) -> None:
    """``llmctl eval RUN --tasks`` on the run's infra: the task installs the eval extra and its run script
    starts ``workloads.pretrain.score_tasks`` (not torchrun) on the config, with ``--parallelize`` when asked."""
    for parallelize, flag in ((False, []), (True, ["--parallelize"])):
        _, task = _task(["infra=lambda", "eval.tasks=[python_facts_mc]"], job="score", parallelize=parallelize)
        assert task.envs["LLMCTL_WORKLOAD"] == "score" and task.envs["LLMCTL_EXTRAS"] == "[eval]"
        assert task.run == sky_task.RUN
        assert _node_argv(tmp_path, ["10.0.0.1"], 0, task.envs) == [
            "-m",
            "workloads.pretrain.score_tasks",
            "--config",
            f"{tmp_path}/.llmctl/runs/abc123/config.yaml",
            *flag,
        ]


COMMAND_TORCHRUN = ["workload=command", "workload.run=python train.py", "workload.torchrun=true"]


@pytest.mark.parametrize("workload", [[], COMMAND_TORCHRUN], ids=["trainer", "command"])
def test_torchrun_on_the_nodes_honours_the_promised_grace(
    workload: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's agent, stopped on a node (Slurm, SkyPilot), SIGKILLs its ranks after its shutdown
    timeout, 30 s by default: the nodes get one past ``checkpoint.preempt_grace_s`` (torch >= 2.12
    reads it)."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    _, task = _task(["infra=lambda", "checkpoint.preempt_grace_s=120", *workload])
    assert int(task.envs["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) > 120


def test_a_command_workloads_named_secrets_travel_as_skypilot_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``workload.secrets=[NAME]``: on the nodes as a SkyPilot secret (kept apart from the task's
    envs, which SkyPilot shows and logs), never among the envs."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_API_KEY", "k-123")  # validate() reads the launching environment
    _, task = _task(
        ["infra=lambda", *COMMAND_TORCHRUN, "workload.secrets=[WANDB_API_KEY]"], environ={"WANDB_API_KEY": "k-123"}
    )
    assert task.secrets["WANDB_API_KEY"].get_secret_value() == "k-123"  # SkyPilot keeps it as a SecretStr
    assert "WANDB_API_KEY" not in task.envs and "k-123" not in str(task.envs)
