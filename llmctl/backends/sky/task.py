"""Translate a resolved llmctl config into a SkyPilot task (YAML-style dict) — pure, no sky import.

The dict is what ``sky.Task.from_yaml_config`` loads and what ``llmctl plan`` prints, so the task a
user reviews is the task that launches. Node-side behaviour lives in two shell scripts: setup
installs this project (or checks a shared-filesystem Python), run starts torchrun from the
``SKYPILOT_*`` environment SkyPilot gives every node.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

from llmctl.errors import ConfigError

RUN_ID_PLACEHOLDER = "<run-id>"
BUCKET_MOUNT = "/llmctl-ckpt"
# where the resolved config lands on every node (a file mount; ~ is the node user's home)
REMOTE_CONFIG = "~/.llmctl/runs/{run_id}/config.yaml"
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
  VENV="$HOME/.llmctl/venv"
  UV="$(command -v uv || echo "$HOME/.local/bin/uv")"
  if [ -x "$UV" ]; then
    [ -x "$VENV/bin/python" ] || "$UV" venv --quiet --python "$(command -v python3)" "$VENV"
    "$UV" pip install --quiet --python "$VENV/bin/python" $LLMCTL_PIP_ARGS -e .
  else
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet $LLMCTL_PIP_ARGS -e .
  fi
fi
"""

# the argument part is one line of its own so tests can execute it with a fake node environment
TORCHRUN = (
    '"$PY" -m torch.distributed.run --nnodes="$SKYPILOT_NUM_NODES" --nproc_per_node="$NPROC"'
    ' --node_rank="$SKYPILOT_NODE_RANK" --master_addr="$MASTER_ADDR"'
    ' --master_port="${LLMCTL_MASTER_PORT:-29500}" -m workloads.pretrain --config "$LLMCTL_CONFIG"'
)
RUN = f"""\
set -euo pipefail
PY="${{LLMCTL_PYTHON:-$HOME/.llmctl/venv/bin/python}}"
NPROC="${{LLMCTL_NPROC_PER_NODE:-$SKYPILOT_NUM_GPUS_PER_NODE}}"
MASTER_ADDR="$(echo "$SKYPILOT_NODE_IPS" | head -n1)"
LLMCTL_CONFIG="$HOME/.llmctl/runs/$LLMCTL_RUN_ID/config.yaml"
exec {TORCHRUN}
"""


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


def node_accelerators(infra: Mapping[str, Any]) -> Optional[tuple[str, int]]:
    """The accelerators of one node, in the provider's own names (``accelerator_aliases``)."""
    acc = parse_accelerators(infra["accelerators"])
    if acc is None:
        return None
    aliases = infra.get("accelerator_aliases") or {}
    return aliases.get(acc[0], acc[0]), acc[1]


def nproc_per_node(cfg: Mapping[str, Any]) -> int:
    """Processes per node: explicit, else one per accelerator, else the CPU mesh split over nodes."""
    infra, par = cfg["infra"], cfg["parallel"]
    if infra["nproc_per_node"]:
        return int(infra["nproc_per_node"])
    acc = node_accelerators(infra)
    if acc:
        return acc[1]
    shard = par["dp_shard"] if par["dp_shard"] > 0 else 1
    return max(1, par["dp_replicate"] * shard * par["tp"] // max(1, infra["nodes"]))


def infra_string(infra: Mapping[str, Any]) -> str:
    """SkyPilot's ``infra``: ``aws/us-east-1``, ``slurm/<cluster>/<partition>``, ``lambda``."""
    parts = [infra["provider"]]
    if infra.get("region"):
        parts.append(infra["region"])
    if infra.get("zone"):
        if not infra.get("region"):
            raise ConfigError(
                "Bad value for 'infra.zone': a zone/partition needs infra.region"
                " (Slurm: the cluster name from ~/.slurm/config)"
            )
        parts.append(infra["zone"])
    return "/".join(parts)


def checkpoint_dir(cfg: Mapping[str, Any], run_id: str) -> str:
    """Where the workload writes checkpoints: the mounted bucket, the bucket URL, or beside the run."""
    infra, ckpt = cfg["infra"], cfg["checkpoint"]
    if ckpt["dir"]:
        return str(ckpt["dir"])
    if infra.get("bucket"):
        if infra.get("mount_bucket"):
            return f"{BUCKET_MOUNT}/{run_id}"
        return f"{str(infra['bucket']).rstrip('/')}/{run_id}"
    return f"llmctl-runs/{run_id}/checkpoints"  # relative to the node's workdir: gone with the node


def resources(cfg: Mapping[str, Any]) -> dict[str, Any]:
    infra = cfg["infra"]
    res: dict[str, Any] = {"infra": infra_string(infra)}
    acc = node_accelerators(infra)
    if acc:
        res["accelerators"] = f"{acc[0]}:{acc[1]}"
    for key in ("cpus", "memory", "disk_size"):
        if infra.get(key) is not None:
            res[key] = infra[key]
    if infra["use_spot"]:
        res["use_spot"] = True
    if infra["managed"]:
        res["job_recovery"] = {"max_restarts_on_errors": 0}
    elif infra.get("autostop_minutes") is not None:  # sky_rules.check refused it where SkyPilot has none
        res["autostop"] = {"idle_minutes": int(infra["autostop_minutes"]), "down": bool(infra["down"])}
    return res


def secrets_from(environ: Mapping[str, str], tracking_uri: str) -> dict[str, str]:
    """Credentials present in the launching environment; a URI with a password is one too."""
    secrets = {k: environ[k] for k in SECRET_ENVS if environ.get(k)}
    if "@" in tracking_uri.split("://", 1)[-1].split("/", 1)[0]:
        secrets["MLFLOW_TRACKING_URI"] = tracking_uri
    return secrets


def task_config(
    cfg: Mapping[str, Any],
    *,
    run_id: str,
    tracking_uri: str,
    experiment_id: str,
    local_config: str,
    workdir: str,
    environ: Optional[Mapping[str, str]] = None,
    attempt_env: Optional[Mapping[str, str]] = None,
) -> dict[str, Any]:
    """The SkyPilot task as a YAML-style dict (``sky.Task.from_yaml_config`` loads it).

    ``attempt_env``: the attempt number and the budget guard's inputs (``RunHandle.attempt_env``)."""
    infra = cfg["infra"]
    secrets = secrets_from(os.environ if environ is None else environ, tracking_uri)
    envs = {
        "LLMCTL_RUN_ID": run_id,
        "MLFLOW_RUN_ID": run_id,
        "MLFLOW_EXPERIMENT_ID": experiment_id,
        "PYTHONUNBUFFERED": "1",
        "LLMCTL_PIP_ARGS": str(infra.get("pip_args") or ""),
    }
    envs.update(attempt_env or {})
    if "MLFLOW_TRACKING_URI" not in secrets:
        envs["MLFLOW_TRACKING_URI"] = tracking_uri
    if infra["nproc_per_node"] or not infra["accelerators"]:
        envs["LLMCTL_NPROC_PER_NODE"] = str(nproc_per_node(cfg))
    if infra.get("node_python"):
        envs["LLMCTL_PYTHON"] = str(infra["node_python"])
    file_mounts: dict[str, Any] = {REMOTE_CONFIG.format(run_id=run_id): local_config}
    if infra.get("bucket") and infra.get("mount_bucket") and str(cfg["checkpoint"]["dir"]).startswith(BUCKET_MOUNT):
        file_mounts[BUCKET_MOUNT] = {"source": str(infra["bucket"]), "mode": "MOUNT"}
    task: dict[str, Any] = {
        "name": cfg["tracking"]["run_name"] or f"llmctl-{cfg['model']['name']}",
        "num_nodes": int(infra["nodes"]),
        "workdir": workdir,
        "resources": resources(cfg),
        "envs": envs,
        "file_mounts": file_mounts,
        "setup": SETUP,
        "run": RUN,
    }
    if secrets:
        task["secrets"] = secrets
    return task


def project_root() -> Path:
    """The source tree that is synced to the nodes as the workdir (a checkout with pyproject.toml)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file() or not (root / "workloads").is_dir():
        raise ConfigError(
            f"infra.kind=sky ships this project's source to the nodes, but {root} is not a"
            " source checkout. Fix: run llmctl from a clone (pip install -e .)"
        )
    return root
