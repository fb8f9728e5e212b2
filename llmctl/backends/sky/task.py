"""Translate a resolved llmctl config into a SkyPilot task (YAML-style dict) — pure, no sky import.

The dict is what ``sky.Task.from_yaml_config`` loads and what ``llmctl plan`` prints, so the task a
user reviews is the task that launches. What it reads of ``infra`` is ``SkySettings``
(``settings.py``), built once by the backend's ``plan``. Node-side behaviour lives in two shell
scripts: setup (``SETUP``) installs the controller's llmctl from the wheel the task ships
(``llmctl.distribution.wheel``; or checks a shared-filesystem Python), run (``node_run.sh``, beside
this module) checks the node runs the controller's build and starts torchrun from the ``SKYPILOT_*``
environment SkyPilot gives every node.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from llmctl.backends.sky.settings import SkySettings
from llmctl.config.workload import is_command
from llmctl.distribution.identity import describe
from llmctl.errors import ConfigError
from workloads.protocol.run_contract import ENV_ELASTIC_SHUTDOWN, elastic_shutdown_timeout

RUN_ID_PLACEHOLDER = "<run-id>"
BUCKET_MOUNT = "/llmctl-ckpt"
# where the resolved config lands on every node (a file mount; ~ is the node user's home)
REMOTE_CONFIG = "~/.llmctl/runs/{run_id}/config.yaml"
# workload=command: the launch directory (the user's program) on every node; node_run.sh runs it there
REMOTE_PROGRAM = "~/.llmctl/runs/{run_id}/program"
# eval.include_path (the user's own lm-eval task YAMLs and their data) on every node; the nodes'
# config names this path instead of the controller's (``node_config``)
REMOTE_TASKS = "~/.llmctl/runs/{run_id}/eval-tasks"
# the controller's llmctl as a wheel, where SETUP installs it from (a file mount)
REMOTE_WHEEL = "~/.llmctl/wheels/{name}"
# what the plan shows for the wheel, which only a launch builds
WHEEL_PLACEHOLDER = "<llmctl wheel>"
# credentials copied from the launching environment into SkyPilot secrets (never envs, never MLflow)
SECRET_ENVS = (
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
)

SETUP = """\
set -euo pipefail
if [ -n "${LLMCTL_PYTHON:-}" ]; then
  # infra.node_python: a Python on a shared filesystem that already has llmctl's dependencies
  "$LLMCTL_PYTHON" -c 'import llmctl, torch, mlflow' \\
    || { echo "llmctl: infra.node_python=$LLMCTL_PYTHON cannot import llmctl/torch/mlflow" >&2; exit 1; }
else
  # the controller's llmctl, shipped as a wheel, in a venv of its own; kept while it is that build
  VENV="$HOME/.llmctl/venv"
  WHEEL="$HOME/.llmctl/wheels/$LLMCTL_WHEEL"
  UV="$(command -v uv || echo "$HOME/.local/bin/uv")"
  node_install() {
    if [ -x "$UV" ]; then "$UV" pip install --quiet --python "$VENV/bin/python" "$@"
    else "$VENV/bin/pip" install --quiet "$@"; fi
  }
  # from / : `python -m` puts the working directory first on the path, where an llmctl folder may lie
  installed() { (cd / && "$VENV/bin/python" -m llmctl --version 2>/dev/null) || true; }
  if [ ! -x "$VENV/bin/python" ]; then
    if [ -x "$UV" ]; then "$UV" venv --quiet --python "$(command -v python3)" "$VENV"; else python3 -m venv "$VENV"; fi
  fi
  if [ "$(installed)" != "$LLMCTL_VERSION_LINE" ]; then
    node_install $LLMCTL_PIP_ARGS "$WHEEL${LLMCTL_EXTRAS:-}"
    # the same version number from another build: pip keeps what it has unless told
    [ "$(installed)" = "$LLMCTL_VERSION_LINE" ] || node_install --no-deps --force-reinstall "$WHEEL"
  elif [ -n "${LLMCTL_EXTRAS:-}" ]; then
    node_install $LLMCTL_PIP_ARGS "$WHEEL$LLMCTL_EXTRAS"
  fi
fi
"""

# what every node runs: torchrun from the SKYPILOT_* environment SkyPilot gives each node and the
# LLMCTL_* envs of the task (a real file, so it can be read, linted and run as it is)
RUN = Path(__file__).with_name("node_run.sh").read_text(encoding="utf-8")


def parse_accelerators(spec: Optional[str]) -> Optional[tuple[str, int]]:
    """``"H100:8"`` → ``("H100", 8)``; ``"H100"`` means one."""
    if not spec:
        return None
    name, _, count = str(spec).partition(":")
    try:
        n = int(count) if count else 1
    except ValueError:
        raise ConfigError(
            f"Bad value for 'infra.accelerators': '{spec}'. Fix: infra.accelerators=<NAME>:<count>, e.g. H100:8"
        ) from None
    if not name or n < 1:
        raise ConfigError(f"Bad value for 'infra.accelerators': '{spec}'. Fix: e.g. infra.accelerators=H100:8")
    return name, n


def node_accelerators(settings: SkySettings) -> Optional[tuple[str, int]]:
    """The accelerators of one node, in the provider's own names (``accelerator_aliases``)."""
    acc = parse_accelerators(settings.accelerators)
    if acc is None:
        return None
    return settings.accelerator_aliases.get(acc[0], acc[0]), acc[1]


def nproc_per_node(cfg: Mapping[str, Any], settings: Optional[SkySettings] = None) -> int:
    """Processes per node: explicit, else one per accelerator, else the CPU mesh split over nodes.
    ``settings``: the plan's (default: built from ``cfg["infra"]``)."""
    infra, par = settings or SkySettings.from_cfg(cfg), cfg["parallel"]
    if infra.nproc_per_node:
        return int(infra.nproc_per_node)
    acc = node_accelerators(infra)
    if acc:
        return acc[1]
    shard = par["dp_shard"] if par["dp_shard"] > 0 else 1
    return max(1, par["dp_replicate"] * shard * par["tp"] // max(1, infra.nodes))


def infra_string(settings: SkySettings) -> str:
    """SkyPilot's ``infra``: ``aws/us-east-1``, ``slurm/<cluster>/<partition>``, ``lambda``."""
    parts = [str(settings.provider)]
    if settings.region:
        parts.append(settings.region)
    if settings.zone:
        if not settings.region:
            raise ConfigError(
                "Bad value for 'infra.zone': a zone/partition needs infra.region"
                " (Slurm: the cluster name from ~/.slurm/config)"
            )
        parts.append(settings.zone)
    return "/".join(parts)


def checkpoint_dir(cfg: Mapping[str, Any], run_id: str, settings: Optional[SkySettings] = None) -> str:
    """Where the workload writes checkpoints: the mounted bucket, the bucket URL, or beside the run."""
    infra, ckpt = settings or SkySettings.from_cfg(cfg), cfg["checkpoint"]
    if ckpt["dir"]:
        return str(ckpt["dir"])
    if infra.bucket:
        if infra.mount_bucket:
            return f"{BUCKET_MOUNT}/{run_id}"
        return f"{str(infra.bucket).rstrip('/')}/{run_id}"
    return f"llmctl-runs/{run_id}/checkpoints"  # relative to the node's workdir: gone with the node


# SkyPilot's key for a list of candidate resources, by ``infra.pick``
PICK_KEYS = {"ordered": "ordered", "cheapest": "any_of"}


def resources(settings: SkySettings) -> dict[str, Any]:
    """The task's ``resources``: where, what each node has, spot, and recovery or autostop. With
    ``infra.candidates``: recovery or autostop once, and each candidate's own under SkyPilot's
    ``ordered`` or ``any_of`` (SkyPilot merges the keys above into every one)."""
    if not settings.candidates:
        return {**node_resources(settings), **lifetime(settings)}
    return {**lifetime(settings), PICK_KEYS[settings.pick]: [node_resources(o) for o in settings.options()]}


def lifetime(settings: SkySettings) -> dict[str, Any]:
    """Recovery (a managed job) or autostop (a cluster): the job's, whichever candidate serves it."""
    if settings.managed:
        return {"job_recovery": {"max_restarts_on_errors": 0}}
    if settings.autostop_minutes is not None:  # sky_rules.check refused it where SkyPilot has none
        return {"autostop": {"idle_minutes": int(settings.autostop_minutes), "down": bool(settings.down)}}
    return {}


def node_resources(settings: SkySettings) -> dict[str, Any]:
    """Where the nodes come from and what each has: one candidate's resources."""
    res: dict[str, Any] = {"infra": infra_string(settings)}
    acc = node_accelerators(settings)
    if acc:
        res["accelerators"] = f"{acc[0]}:{acc[1]}"
    for key, value in (("cpus", settings.cpus), ("memory", settings.memory), ("disk_size", settings.disk_size)):
        if value is not None:
            res[key] = value
    if settings.use_spot:
        res["use_spot"] = True
    return res


def node_extras(cfg: Mapping[str, Any]) -> list[str]:
    """The extras the nodes install with llmctl's wheel: what this config uses beyond the base install."""
    model, train = cfg.get("model") or {}, cfg.get("train") or {}
    urls = [str((cfg.get("checkpoint") or {}).get("dir") or ""), str((cfg.get("data") or {}).get("source") or "")]
    wanted = {
        "eval": bool((cfg.get("eval") or {}).get("tasks")),  # eval.tasks, or a score job: lm-eval on the nodes
        "qlora": str((model.get("lora") or {}).get("quantize_base") or "none") == "nf4",
        "fp8": str(train.get("fp8") or "none") != "none",
        "gpu": str(model.get("loss_kernel") or "") == "liger",
        "s3": any(u.startswith("s3://") for u in urls),
        "gcs": any(u.startswith("gs://") for u in urls),
    }
    return sorted(name for name, needed in wanted.items() if needed)


def secrets_from(environ: Mapping[str, str], tracking_uri: str, named: Sequence[str] = ()) -> dict[str, str]:
    """Credentials present in the launching environment (``named``: a command workload's
    ``workload.secrets`` besides llmctl's own list); a URI with a password is one too."""
    secrets = {k: environ[k] for k in (*SECRET_ENVS, *named) if environ.get(k)}
    if "@" in tracking_uri.split("://", 1)[-1].split("/", 1)[0]:
        secrets["MLFLOW_TRACKING_URI"] = tracking_uri
    return secrets


def node_config(cfg: Mapping[str, Any], run_id: str) -> dict[str, Any]:
    """The config the nodes read: ``eval.include_path`` is the copy ``task_config`` mounts there; no
    ``notify`` (the controller notifies; its endpoints are credentials the nodes have no use for)."""
    cfg = {k: v for k, v in cfg.items() if k != "notify"}
    ev = cfg.get("eval") or {}
    if not (ev.get("tasks") and ev.get("include_path")):
        return cfg
    return {**cfg, "eval": {**ev, "include_path": REMOTE_TASKS.format(run_id=run_id)}}


def task_config(
    cfg: Mapping[str, Any],
    *,
    run_id: str,
    tracking_uri: str,
    experiment_id: str,
    local_config: str,
    wheel: str = WHEEL_PLACEHOLDER,
    version_line: Optional[str] = None,
    environ: Optional[Mapping[str, str]] = None,
    attempt_env: Optional[Mapping[str, str]] = None,
    settings: Optional[SkySettings] = None,
    program_dir: Optional[str] = None,
    job: str = "train",
    parallelize: bool = False,
) -> dict[str, Any]:
    """The SkyPilot task as a YAML-style dict (``sky.Task.from_yaml_config`` loads it).

    ``wheel``: the controller's llmctl as a wheel (``llmctl.distribution.wheel``), installed on the nodes;
    ``version_line``: its ``llmctl --version``, which every node checks it runs before it starts.
    ``attempt_env``: the attempt number and the budget guard's inputs (``RunHandle.attempt_env``).
    ``settings``: the plan's (default: built from ``cfg["infra"]``). ``program_dir``: for
    ``workload=command``, the directory shipped to the nodes (default: the current one). ``job``:
    the plan's (``score``: lm-eval on one checkpoint, one node, ``parallelize`` over its GPUs)."""
    infra = settings or SkySettings.from_cfg(cfg)
    named = [str(n) for n in (cfg.get("workload") or {}).get("secrets") or []] if is_command(cfg) else []
    secrets = secrets_from(os.environ if environ is None else environ, tracking_uri, named)
    grace_s = float((cfg.get("checkpoint") or {}).get("preempt_grace_s") or 0)
    envs = {
        "LLMCTL_RUN_ID": run_id,
        "MLFLOW_RUN_ID": run_id,
        "MLFLOW_EXPERIMENT_ID": experiment_id,
        "PYTHONUNBUFFERED": "1",
        "LLMCTL_PIP_ARGS": str(infra.pip_args or ""),
        "LLMCTL_WHEEL": Path(wheel).name,
        "LLMCTL_VERSION_LINE": version_line or describe(),
        # torchrun on the nodes gets stops itself (SkyPilot, Slurm): torch >= 2.12 then honours the grace
        ENV_ELASTIC_SHUTDOWN: elastic_shutdown_timeout(grace_s),
    }
    ev = cfg.get("eval") or {}
    extras = node_extras(cfg)
    if extras:
        envs["LLMCTL_EXTRAS"] = f"[{','.join(extras)}]"
    if job == "score":
        envs["LLMCTL_WORKLOAD"] = "score"
        if parallelize:
            envs["LLMCTL_EVAL_PARALLELIZE"] = "1"
    envs.update(attempt_env or {})
    if "MLFLOW_TRACKING_URI" not in secrets:
        envs["MLFLOW_TRACKING_URI"] = tracking_uri
    if infra.nproc_per_node or not infra.accelerators:
        envs["LLMCTL_NPROC_PER_NODE"] = str(nproc_per_node(cfg, infra))
    if infra.node_python:
        envs["LLMCTL_PYTHON"] = str(infra.node_python)
    file_mounts: dict[str, Any] = {
        REMOTE_CONFIG.format(run_id=run_id): local_config,
        REMOTE_WHEEL.format(name=Path(wheel).name): wheel,
    }
    if ev.get("tasks") and ev.get("include_path"):  # the user's task YAMLs, where the nodes' config says
        file_mounts[REMOTE_TASKS.format(run_id=run_id)] = str(Path(str(ev["include_path"])).expanduser().resolve())
    if is_command(cfg) and job == "train":  # the user's program and its files: the directory llmctl was launched from
        envs["LLMCTL_WORKLOAD"] = "command"
        file_mounts[REMOTE_PROGRAM.format(run_id=run_id)] = program_dir or os.getcwd()
    if infra.bucket and infra.mount_bucket and str(cfg["checkpoint"]["dir"]).startswith(BUCKET_MOUNT):
        file_mounts[BUCKET_MOUNT] = {"source": str(infra.bucket), "mode": "MOUNT"}
    task: dict[str, Any] = {
        "name": cfg["tracking"]["run_name"] or f"llmctl-{cfg['model']['name']}",
        "num_nodes": int(infra.nodes),
        "resources": resources(infra),
        "envs": envs,
        "file_mounts": file_mounts,
        "setup": SETUP,
        "run": RUN,
    }
    if secrets:
        task["secrets"] = secrets
    return task
