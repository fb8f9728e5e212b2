"""The trainer's config contract: every key it reads, typed. Stdlib only.

The trainer reads one resolved YAML (plus ``key=value`` overrides) shaped like ``TrainerCfg``
(``workloads.pretrain.contract.config.load``). Whoever writes that file, llmctl or a person, needs nothing
but this module to know what is allowed. llmctl builds its own root schema on top of this one
(adding where the job runs and where it is tracked) and composes the YAML with Hydra; the
trainer itself never composes config groups.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


class Kernels(str, enum.Enum):
    """Which math the model runs: the plain-PyTorch oracle or the fast path."""

    reference = "reference"
    fused = "fused"


class Arch(str, enum.Enum):
    """The Hugging Face family a model's weights follow; ``qwen2`` adds biases to q/k/v."""

    llama = "llama"
    qwen2 = "qwen2"


class RopeLayout(str, enum.Enum):
    """Which dimensions RoPE rotates together: Meta's pairs (x0, x1), (x2, x3)... or Hugging Face's
    first half with second half. Weights trained one way only work that way."""

    interleaved = "interleaved"
    half = "half"


class DataFormat(str, enum.Enum):
    """``text``: documents run together, loss on every token (pretraining); ``sft``: jsonl of
    ``messages`` chats or ``prompt``/``completion`` pairs, loss on the answers only, examples packed
    without attention across them (fine-tuning)."""

    text = "text"
    sft = "sft"


class ActivationCheckpointing(str, enum.Enum):
    none = "none"
    selective = "selective"
    full = "full"


class GradSync(str, enum.Enum):
    """When FSDP reduce-scatters gradients under gradient accumulation. ``step``: once, after the
    last micro-batch (one reduction per step, but every rank keeps its blocks' full fp32 gradients
    between micro-batches: 4 bytes per parameter / tp); ``micro_batch``: after every micro-batch
    (torchtitan's way: gradients stay sharded, one reduction per micro-batch); ``auto``: ``step``
    where the memory plan says it fits, else ``micro_batch`` (llmctl decides before launch; the
    trainer alone reads ``auto`` as ``step``)."""

    auto = "auto"
    step = "step"
    micro_batch = "micro_batch"


class DType(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Fp8(str, enum.Enum):
    """FP8 matmuls through torchao's float8 training (``fp8.py``): ``tensorwise`` (one scale per
    tensor: fastest, FP8 all-gather under FSDP) or ``rowwise`` (a scale per row: more accurate)."""

    none = "none"
    tensorwise = "tensorwise"
    rowwise = "rowwise"


class Schedule(str, enum.Enum):
    cosine = "cosine"
    linear = "linear"
    wsd = "wsd"
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
    arch: Arch = Arch.llama
    # the FFN width; None: Llama's rule from dim, multiple_of and ffn_dim_multiplier
    hidden_dim: Optional[int] = None
    rope_layout: RopeLayout = RopeLayout.interleaved
    # None, or Llama 3.1's {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}
    rope_scaling: Optional[Dict[str, Any]] = None
    # a Hugging Face checkpoint (directory or fsspec URL: config.json + safetensors) to start from;
    # its config.json sets the shape fields above (``hf_config``)
    init_from: Optional[str] = None


@dataclass
class DataCfg:
    """Where training text comes from and how it is tokenized."""

    name: str = "pydoc"
    # "builtin:pydoc" (text shipped with Python) or an fsspec URL / glob of .txt/.jsonl/.parquet files
    source: str = "builtin:pydoc"
    text_field: str = "text"  # the text of a .jsonl record / .parquet row (format text)
    format: DataFormat = DataFormat.text
    # format text: attention stays inside each document (the end-of-text token closes one) and RoPE
    # positions restart at each, as Llama 3 pretrained; False lets every token see the whole window.
    # sft always keeps attention inside each example.
    document_mask: bool = False
    vocab_size: int = 4096
    val_fraction: float = 0.05
    # None: $LLMCTL_CACHE_DIR, else ~/.cache/llmctl
    cache_dir: Optional[str] = None
    # a tokenizer.json, a Hugging Face model directory / fsspec URL holding one (its
    # tokenizer_config.json names the end-of-text token and chat template), or a tiktoken BPE file;
    # None: a byte-level BPE of data.vocab_size trained on data.source, or with model.init_from the
    # checkpoint's own tokenizer
    tokenizer: Optional[str] = None


@dataclass
class TrainCfg:
    """Optimisation. ``batch_size`` is the global batch in sequences per optimizer step."""

    steps: int = 200
    batch_size: int = 16
    # sequences per device per forward/backward; the step accumulates gradients over
    # batch_size / (micro_batch_size x data-parallel ranks) of them. None: the whole local batch at once
    micro_batch_size: Optional[int] = None
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    schedule: Schedule = Schedule.cosine
    # the step the decay ends at (None: train.steps); a resume that changes train.steps pins the
    # run's horizon here so the learning rate never jumps (schedule.py, docs/resume.md)
    schedule_steps: Optional[int] = None
    decay_fraction: float = 0.2  # wsd: the decay takes this fraction of the post-warmup steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    dtype: DType = DType.fp32
    # FP8 linears on an FP8 GPU (compute capability >= 8.9), over train.dtype=bf16 (docs/scale.md)
    fp8: Fp8 = Fp8.none
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
    grad_sync: GradSync = GradSync.auto  # FSDP with micro-batches: reduce per step or per micro-batch


@dataclass
class CheckpointCfg:
    """Distributed checkpoints. ``dir`` is any fsspec URL; None (under llmctl) puts them beside the run."""

    dir: Optional[str] = None
    every: int = 0
    keep: int = 2
    async_save: bool = False
    preempt_grace_s: float = 20.0  # SIGTERM/SIGUSR1: emergency save only if it can finish within this (docs/resume.md)


@dataclass
class EvalCfg:
    """``python -m workloads.pretrain.evaluate`` (``llmctl eval``): held-out metrics and samples."""

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
class TrainerCfg:
    """Everything the trainer reads. A resolved YAML may carry more sections (a launcher's own,
    see ``LAUNCHER_SECTIONS``); the trainer ignores those and refuses any other unknown key."""

    model: ModelCfg = field(default_factory=ModelCfg)
    data: DataCfg = field(default_factory=DataCfg)
    train: TrainCfg = field(default_factory=TrainCfg)
    parallel: ParallelCfg = field(default_factory=ParallelCfg)
    checkpoint: CheckpointCfg = field(default_factory=CheckpointCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)


# Sections a launcher writes beside the trainer's in the same resolved YAML (llmctl: where the job
# runs, where it is tracked). Named here so the trainer can skip exactly these and still refuse a typo.
LAUNCHER_SECTIONS = ("infra", "tracking")
