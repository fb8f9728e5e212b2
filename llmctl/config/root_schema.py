"""Typed schema of every config key: the trainer's sections plus the launcher's own.

The trainer's keys live in the protocol (``workloads.protocol.schema``: model, data, train, parallel,
checkpoint, eval); llmctl adds where the job runs (``infra``), where it is tracked
(``tracking``), what runs (``workload``) and whom it tells (``notify``). Stdlib only, so the CLI
reads it without importing Hydra. Hydra validates composed
configs against ``RootCfg`` (registered in a ConfigStore by ``llmctl.config.compose``).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Dict, List, Optional

from workloads.protocol.schema import (  # noqa: F401 - the enums are looked up by name (config._field_type_name)
    LAUNCHER_SECTIONS,
    ActivationCheckpointing,
    Arch,
    CheckpointCfg,
    DataCfg,
    DataFormat,
    DpoCfg,
    DpoLoss,
    DpoReference,
    DType,
    EvalCfg,
    Fp8,
    GradSync,
    Kernels,
    ModelCfg,
    Objective,
    ParallelCfg,
    QuantizeBase,
    RopeLayout,
    Schedule,
    TrainCfg,
    TrainerCfg,
)


@dataclass
class InfraCfg:
    """Where the job runs. ``kind`` picks the backend; the rest is provider data.

    One flat section of user-visible keys (``infra.*``, conf/infra/*.yaml); each backend reads its
    own typed view of it, built once per plan: ``LocalSettings`` (``llmctl/backends/local.py``) and
    ``SkySettings`` (``llmctl/backends/sky/settings.py``, where every key is documented). The comment
    on each field says who reads it: ``llmctl`` (whatever the backend), ``local``, ``sky``. On
    ``kind=local`` a sky-only key set to other than its default is refused (``LocalSettings``).

    What a provider can do (spot, several nodes, autostop, bucket mounts) is not configured here:
    it comes from SkyPilot's own cloud classes (``llmctl/backends/sky/rules.py``).
    """

    name: str = "local"  # llmctl (run tags, cost reports), sky (messages)
    kind: str = "local"  # llmctl: the backend (llmctl.backends.registry)
    nodes: int = 1  # sky; local runs one node (refuses another value); llmctl: cost history matches on it
    # local, sky: processes per node; 0 = one per GPU, or the mesh size on CPU
    nproc_per_node: int = 0
    accelerators: Optional[str] = None  # sky
    use_spot: bool = False  # sky; llmctl: spot or on-demand price
    region: Optional[str] = None  # sky: a cloud region; Slurm: the cluster (its ~/.slurm/config alias)
    disk_size: Optional[int] = None  # sky
    autostop_minutes: Optional[int] = None  # sky
    down: bool = True  # sky
    managed: bool = False  # sky
    bucket: Optional[str] = None  # sky
    # llmctl (llmctl.cost.estimate): $ per GPU-hour (per node-hour on CPU) where no catalog prices
    # the job; None: unpriced, except this machine's own CPU, which costs nothing
    price_per_gpu_hour: Optional[float] = None
    # llmctl (llmctl.plan.memory_fit): GiB per device the memory plan holds the job against; None: the
    # catalog's (cloud GPUs), nvidia-smi's (local GPUs), this machine's RAM shared by its processes (CPU)
    device_memory_gib: Optional[float] = None
    # sky only, from here on. Provider defaults live here as data, set per conf/infra file.
    provider: Optional[str] = None  # sky: SkyPilot cloud: aws | lambda | runpod | slurm
    zone: Optional[str] = None  # sky: a zone of ``region``; Slurm: the partition (region = cluster)
    cpus: Optional[str] = None  # sky: SkyPilot syntax: "8", "8+"
    memory: Optional[str] = None  # sky: GB, SkyPilot syntax: "32+"
    # sky: what users write -> the provider's catalog name (RunPod: H100 -> H100-SXM)
    accelerator_aliases: Dict[str, str] = field(default_factory=dict)
    # sky: the bucket as a storage mount (true) or handed to the workload as an fsspec URL (false)
    mount_bucket: bool = True
    # sky: a Python on the nodes that already has llmctl's deps (shared filesystem): skip the node install
    node_python: Optional[str] = None
    # sky: extra arguments for the node install, e.g. "--find-links /opt/wheels torch==2.13.0+cpu"
    pip_args: str = ""
    # sky: several providers for one run, in preference order (llmctl.config.candidates): each a
    # conf/infra name (``lambda``) or a mapping ({infra: aws, use_spot: true, region: us-east-1})
    candidates: List[Any] = field(default_factory=list)
    # sky: how SkyPilot picks among the candidates: ``ordered`` (the first with capacity; its
    # ``resources.ordered``) or ``cheapest`` (its optimizer's cheapest: ``resources.any_of``)
    pick: str = "ordered"


@dataclass
class TrackingCfg:
    """MLflow. ``uri`` None: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db."""

    uri: Optional[str] = None
    experiment: str = "llmctl"
    run_name: Optional[str] = None


@dataclass
class WorkloadCfg:
    """What runs (conf/workload/*.yaml): ``pretrain``, the bundled trainer (the default), or
    ``command``, any program under llmctl's run contract (``workloads/command``, docs/workloads.md).
    Only ``kind`` is read for ``pretrain``."""

    kind: str = "pretrain"  # pretrain | command
    run: Optional[str] = None  # command: the program and its fixed arguments (``python train.py``)
    args: Dict[str, Any] = field(default_factory=dict)  # command: appended as --<name> <value>
    torchrun: bool = False  # command: start it under torchrun with the plan's processes (and nodes)
    env: Dict[str, str] = field(default_factory=dict)  # command: extra environment
    # command: names of variables passed from the launching environment (SkyPilot secrets on nodes)
    secrets: List[str] = field(default_factory=list)
    hours: Optional[float] = None  # command: expected wall hours, for the estimate


@dataclass
class NotifyCfg:
    """Who is told when a run or sweep changes state (``llmctl.config.notify``, docs/notify.md): each
    ``url`` gets one JSON POST per event in ``on`` (Slack's incoming-webhook shape: ``text``), sent by
    the controller, retried once, never failing the run. A webhook URL is a credential: give the
    name of an environment variable holding it (``notify.url=[SLACK_WEBHOOK_URL]``) and the URL is
    read at launch, never stored; a URL written out is stored as its scheme and host only."""

    url: List[str] = field(default_factory=list)
    on: List[str] = field(
        default_factory=lambda: ["recovered", "finished", "failed", "budget_stop", "preempted", "killed", "sweep_end"]
    )
    timeout_s: float = 3.0  # per try, two tries: what a dead endpoint can cost a run, once


@dataclass
class RootCfg(TrainerCfg):
    """The trainer's sections, then the launcher's (``workloads.protocol.schema.LAUNCHER_SECTIONS``)."""

    infra: InfraCfg = field(default_factory=InfraCfg)
    tracking: TrackingCfg = field(default_factory=TrackingCfg)
    workload: WorkloadCfg = field(default_factory=WorkloadCfg)
    notify: NotifyCfg = field(default_factory=NotifyCfg)


# Keys older llmctl versions wrote into a run's config.yaml that the schema no longer has (what a
# provider can do now comes from SkyPilot). Dropped when an old run is resumed or evaluated.
RETIRED_KEYS = ("infra.max_nodes", "infra.supports_spot", "infra.supports_autostop")


def drop_retired(cfg: dict) -> dict:
    """``cfg`` (a nested plain dict) without ``RETIRED_KEYS``."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in cfg.items()}
    for dotted in RETIRED_KEYS:
        section, _, key = dotted.partition(".")
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
    return out


def schema_keys(node: type = RootCfg, prefix: str = "") -> list[str]:
    """Every dotted key the schema knows, for did-you-mean suggestions and completion."""
    keys: list[str] = []
    for f in fields(node):
        dotted = f"{prefix}{f.name}"
        sub = f.default_factory
        if sub is not MISSING and is_dataclass(sub):
            keys.append(dotted)
            keys.extend(schema_keys(sub, dotted + "."))
        else:
            keys.append(dotted)
    return keys
