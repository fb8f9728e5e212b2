"""Typed schema of every config key: the contract between the CLI, the docs and the workload.

Stdlib only, so the CLI can read it without importing Hydra and the workload can build typed
configs from a resolved YAML file. Hydra validates composed configs against these dataclasses
(registered in a ConfigStore by ``llmctl.config``).
"""

from __future__ import annotations

import enum
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Dict, List, Optional


class Kernels(str, enum.Enum):
    """Which math the model runs: the plain-PyTorch oracle or the fast path."""

    reference = "reference"
    fused = "fused"


class ActivationCheckpointing(str, enum.Enum):
    none = "none"
    selective = "selective"
    full = "full"


class DType(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Schedule(str, enum.Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


@dataclass
class ModelCfg:
    """Llama-style decoder shape. ``ffn_dim_multiplier``/``multiple_of`` follow Llama's rule."""

    name: str = "smoke"
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    vocab_size: int = 4096
    multiple_of: int = 32
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    kernels: Kernels = Kernels.fused
    compile: bool = False


@dataclass
class DataCfg:
    """Where training text comes from and how it is tokenized."""

    name: str = "pydoc"
    # "builtin:pydoc" (text shipped with Python) or an fsspec URL / glob of .txt/.jsonl/.parquet files
    source: str = "builtin:pydoc"
    text_field: str = "text"
    vocab_size: int = 4096
    val_fraction: float = 0.05
    # None: $LLMCTL_CACHE_DIR, else ~/.cache/llmctl
    cache_dir: Optional[str] = None


@dataclass
class TrainCfg:
    """Optimisation. ``batch_size`` is the global batch in sequences per optimizer step."""

    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    schedule: Schedule = Schedule.cosine
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    dtype: DType = DType.fp32
    log_every: int = 10
    val_every: int = 50
    val_batches: int = 4


@dataclass
class ParallelCfg:
    """Device-mesh degrees. ``dp_shard=-1`` takes every device the other degrees leave."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    ac: ActivationCheckpointing = ActivationCheckpointing.none


@dataclass
class InfraCfg:
    """Where the job runs. ``kind`` picks the backend; the rest is provider data."""

    name: str = "local"
    kind: str = "local"
    nodes: int = 1
    # processes per node; 0 = one per GPU, or the mesh size on CPU
    nproc_per_node: int = 0
    accelerators: Optional[str] = None
    use_spot: bool = False
    region: Optional[str] = None
    disk_size: Optional[int] = None
    autostop_minutes: Optional[int] = None
    down: bool = True
    managed: bool = False
    bucket: Optional[str] = None
    price_per_gpu_hour: float = 0.0
    # kind=sky only (llmctl/backends/sky.py). Provider quirks live here as data, set per conf/infra file.
    provider: Optional[str] = None  # SkyPilot cloud: aws | lambda | runpod | slurm
    zone: Optional[str] = None  # a zone of ``region``; Slurm: the partition (region = cluster)
    cpus: Optional[str] = None  # SkyPilot syntax: "8", "8+"
    memory: Optional[str] = None  # GB, SkyPilot syntax: "32+"
    max_nodes: int = 0  # 0 = no limit; RunPod: 1
    supports_spot: bool = True
    supports_autostop: bool = True
    # what users write -> the provider's catalog name (RunPod: H100 -> H100-SXM)
    accelerator_aliases: Dict[str, str] = field(default_factory=dict)
    # the bucket as a storage mount (true) or handed to the workload as an fsspec URL (false)
    mount_bucket: bool = True
    # a Python on the nodes that already has llmctl's deps (shared filesystem): skip the node install
    node_python: Optional[str] = None
    # extra arguments for the node install, e.g. "--find-links /opt/wheels torch==2.13.0+cpu"
    pip_args: str = ""


@dataclass
class CheckpointCfg:
    """Distributed checkpoints. ``dir`` is any fsspec URL; None puts them beside the run."""

    dir: Optional[str] = None
    every: int = 0
    keep: int = 2
    async_save: bool = False
    preempt_grace_s: float = 20.0  # SIGTERM/SIGUSR1: emergency save only if it can finish within this (docs/resume.md)


@dataclass
class TrackingCfg:
    """MLflow. ``uri`` None: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db."""

    uri: Optional[str] = None
    experiment: str = "llmctl"
    run_name: Optional[str] = None


@dataclass
class EvalCfg:
    """``llmctl eval``: held-out metrics and samples of a checkpoint (docs/eval.md)."""

    prompts: List[str] = field(default_factory=lambda: ["The ", "def ", "Return a"])
    max_new_tokens: int = 32
    temperature: float = 0.8  # the sampled completion; a greedy one is always made too
    top_k: Optional[int] = 50
    seed: int = 0
    # None: train.val_batches (the fixed set training's val/loss uses, so the numbers agree)
    val_batches: Optional[int] = None
    # None: the newest complete checkpoint
    step: Optional[int] = None
    # Another data set (fsspec URL/glob, like data.source), tokenized with the run's tokenizer;
    # None: the held-out split. ``llmctl eval RUN data.source=...`` sets this.
    source: Optional[str] = None
    text_field: str = "text"


@dataclass
class RootCfg:
    model: ModelCfg = field(default_factory=ModelCfg)
    data: DataCfg = field(default_factory=DataCfg)
    train: TrainCfg = field(default_factory=TrainCfg)
    parallel: ParallelCfg = field(default_factory=ParallelCfg)
    infra: InfraCfg = field(default_factory=InfraCfg)
    checkpoint: CheckpointCfg = field(default_factory=CheckpointCfg)
    tracking: TrackingCfg = field(default_factory=TrackingCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)


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
