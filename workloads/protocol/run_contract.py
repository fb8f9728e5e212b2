"""A workload's run contract with whoever launches it, besides the config: the environment it reads,
the MLflow tags it writes (facts, never bills) and its exit codes. The bundled trainer and the
command workload's guard both write these; stdlib only, so a launcher (llmctl) imports these names
instead of spelling them a second time.

Environment (all optional; the trainer runs without any of them):

    MLFLOW_TRACKING_URI, MLFLOW_RUN_ID   the run rank 0 logs metrics and tags into
    LLMCTL_ATTEMPT          the launcher's attempt number (recorded with each start)
    LLMCTL_MAX_COST_USD     budget guard: the limit for the whole run
    LLMCTL_PRICE_PER_HOUR   budget guard: $/h of the whole job (all nodes)
    LLMCTL_BILLING_START    budget guard: epoch seconds when this attempt's billing started
    LLMCTL_SPENT_USD        budget guard: spend of earlier attempts

Tags rank 0 writes (JSON values):

    llmctl.workload_start.<k>  each start: time, attempt, from_step, world_size (k = 1, 2, ...) and,
                               on SkyPilot's nodes, where: its cloud, region, zone
    llmctl.preempted           stopped on SIGTERM/SIGUSR1: step, checkpoint, saved, signal
    llmctl.budget_stop         stopped by the budget guard: step, spent_usd, max_cost_usd, checkpoint
    llmctl.completed           every step ran and the final checkpoint is committed: step, checkpoint
    llmctl.sky.task_id         SkyPilot's task id (stable across a managed job's recoveries)

Each of preempted, budget_stop and completed names the start that wrote it (``start``: the k of
its ``llmctl.workload_start.<k>``, and ``attempt``): a launcher reads a fact only when the newest
start wrote it, since a managed job's supervisor restarts the workload without the launcher, and an
earlier start's preemption says nothing about how a later one ended.

Exit codes: 0 done (also after a budget stop: read the tag), 1 error, 2 bad config, 75 preempted
with state saved, 130 SIGINT. torchrun reports any non-zero worker exit as 1, so a launcher reads
the tags, not the code, to tell a preemption from a failure.
"""

import math
import os
from pathlib import Path

ENV_CACHE_DIR = "LLMCTL_CACHE_DIR"  # llmctl's and the trainer's local cache (tokenized corpora, facts, stores)


def cache_home() -> Path:
    """``$LLMCTL_CACHE_DIR``, else ``~/.cache/llmctl``: the one local cache both sides use."""
    root = os.environ.get(ENV_CACHE_DIR)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "llmctl"


ENV_ATTEMPT = "LLMCTL_ATTEMPT"
ENV_MAX_COST = "LLMCTL_MAX_COST_USD"
ENV_PRICE = "LLMCTL_PRICE_PER_HOUR"
ENV_BILLING_START = "LLMCTL_BILLING_START"
ENV_SPENT = "LLMCTL_SPENT_USD"
ATTEMPT_ENVS = (ENV_ATTEMPT, ENV_PRICE, ENV_MAX_COST, ENV_BILLING_START, ENV_SPENT)

ENV_SKY_CLUSTER_INFO = "SKYPILOT_CLUSTER_INFO"  # SkyPilot's, on every node: cloud, region, zone


def node_where() -> "dict[str, object] | None":
    """Where SkyPilot launched this node (cloud lower-cased, region, zone; Slurm: cluster and
    partition), from the environment SkyPilot gives every node; None elsewhere. A start records it,
    so a launcher bills each attempt of a run over several providers at what actually served it."""
    import json

    try:
        info = json.loads(os.environ.get(ENV_SKY_CLUSTER_INFO) or "null")
    except ValueError:
        return None
    if not isinstance(info, dict) or not info.get("cloud"):
        return None
    return {"cloud": str(info["cloud"]).lower(), "region": info.get("region"), "zone": info.get("zone")}


TAG_START_PREFIX = "llmctl.workload_start."
TAG_PREEMPTED = "llmctl.preempted"
TAG_BUDGET_STOP = "llmctl.budget_stop"
TAG_COMPLETED = "llmctl.completed"
TAG_TASK_ID = "llmctl.sky.task_id"

EXPORT_INFO = "llmctl_export.json"  # in an HF export: what it was made from (step, checkpoint, run)
# the weight dtypes an HF export can be written in (``llmctl export --dtype``); the first is the default
EXPORT_DTYPES = ("bf16", "fp16", "fp32")

EXIT_CONFIG = 2
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request with state saved; a resume continues it

# torchrun's agent, stopped itself (a scheduler signalling every process), stops its ranks and SIGKILLs
# them after its shutdown timeout: 30 s by default, shorter than a longer checkpoint.preempt_grace_s.
# torch >= 2.12 reads this variable; torch 2.11 does not, so launchers stop the ranks, not the agent.
ENV_ELASTIC_SHUTDOWN = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
KILL_AFTER_GRACE_S = 15.0  # past the grace, before a launcher's hard kill: a save's last write and exit


def elastic_shutdown_timeout(grace_s: float) -> str:
    """``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` that honours a grace of ``grace_s`` seconds (whole seconds)."""
    return str(math.ceil(grace_s + KILL_AFTER_GRACE_S))
