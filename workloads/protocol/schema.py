"""The trainer's config contract: every key it reads, typed. Stdlib only.

The trainer reads one resolved YAML (plus ``key=value`` overrides) shaped like ``TrainerCfg``
(``workloads.protocol.config.load``) into one ``TrainerCfg`` instance, enums as members,
which every part of the trainer reads; ``config.typed`` makes the same object from a plain
mapping (llmctl's composed config). Whoever writes that file, llmctl or a person, needs nothing
but this module to know what is allowed: each field's meaning is written beside it, and
docs/config.md's key tables are checked against these types and defaults (``tests/e2e/test_docs.py``).
llmctl builds its own root schema on top of this one (adding where the job runs and where it is
tracked) and composes the YAML with Hydra; the trainer itself never composes config groups.
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
    # jsonl of ``prompt`` + ``chosen`` + ``rejected`` (texts, or chat messages): train.objective=dpo
    preference = "preference"


class Objective(str, enum.Enum):
    """``lm``: next-token cross-entropy (pretraining, SFT); ``dpo``: Direct Preference Optimization on
    chosen/rejected pairs (``data.format=preference``), as TRL's ``DPOTrainer`` computes it."""

    lm = "lm"
    dpo = "dpo"


class DpoLoss(str, enum.Enum):
    """TRL's ``loss_type`` names: ``sigmoid`` DPO (Rafailov et al. 2023); ``ipo`` IPO (Azar et al.
    2023) on per-token averaged log-ratios, as TRL computes it; ``robust`` DPO under label noise
    (Chowdhury et al. 2024): ``train.dpo.label_smoothing`` is the assumed share of flipped pairs."""

    sigmoid = "sigmoid"
    ipo = "ipo"
    robust = "robust"


class DpoReference(str, enum.Enum):
    """Where the reference log-probabilities come from. ``auto``: with LoRA the base model with the
    adapters off (no second copy), else ``copy``; ``copy``: a frozen copy of the starting weights,
    sharded like the policy, in the compute dtype."""

    auto = "auto"
    copy = "copy"


class ActivationCheckpointing(str, enum.Enum):
    """What each block keeps for its backward: everything (``none``), its matmul outputs
    (``selective``: the rest is recomputed) or only its input (``full``: the block is recomputed)."""

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
    """The compute dtype: ``fp32``, or ``bf16`` (FSDP2's bf16 parameters gathered from fp32 master
    weights, fp32 gradient reduction, on one process and many alike); ``auto``: what
    the device is fast at, ``bf16`` on CUDA and ``fp32`` on CPU (``on``)."""

    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"

    def on(self, device_type: str) -> str:
        """The dtype that runs on ``device_type`` ("cuda", "cpu"): ``auto`` resolved. The trainer,
        the memory plan and the cost estimate all resolve it here, so they agree."""
        if self is DType.auto:
            return "bf16" if device_type == "cuda" else "fp32"
        return self.value


class LossKernel(str, enum.Enum):
    """The fused kernels' LM head + cross-entropy: ``liger`` (Liger-Kernel's Triton fused
    linear-CE, CUDA only, ``pip install liger-kernel``), ``chunked`` (``losses.py``, plain PyTorch,
    any device) or ``auto`` (``liger`` on CUDA when it imports, else ``chunked``). A ``liger``
    that cannot run is a config error before training, never a silent fallback."""

    auto = "auto"
    liger = "liger"
    chunked = "chunked"


class Fp8(str, enum.Enum):
    """FP8 matmuls through torchao's float8 training (``fp8.py``): ``tensorwise`` (one scale per
    tensor: fastest, FP8 all-gather under FSDP) or ``rowwise`` (a scale per row: more accurate)."""

    none = "none"
    tensorwise = "tensorwise"
    rowwise = "rowwise"


class Schedule(str, enum.Enum):
    """The learning rate after warmup (``schedule.py``): cosine or linear decay to
    ``train.min_lr_ratio`` at the horizon, ``wsd`` (warmup-stable-decay) or ``constant``."""

    cosine = "cosine"
    linear = "linear"
    wsd = "wsd"
    constant = "constant"


class QuantizeBase(str, enum.Enum):
    """How LoRA stores the frozen base weights it adapts: as they are (``none``) or in 4-bit NF4
    (``nf4``: QLoRA, torchao's NF4 tensor, computed in the compute dtype; ``model/nf4.py``)."""

    none = "none"
    nf4 = "nf4"


# The model's linears LoRA may adapt (``model.lora.targets``): attention's q/k/v/o and the SwiGLU
# FFN's gate (w1), down (w2) and up (w3) projections, Hugging Face's q_proj ... gate_proj, down_proj, up_proj.
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


@dataclass
class LoraCfg:
    """Low-rank adapters (LoRA, Hu et al. 2021) on the model's linears: the base weights stay frozen
    and each target learns ``W + B A * alpha / rank``. ``rank=0`` (the default) trains every weight."""

    rank: int = 0  # r, the adapters' inner dimension; 0: no adapters, every weight trains
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapters' input (PEFT's lora_dropout); 0: none
    # the linears that get adapters, by the model's names (LORA_TARGETS): attention and MLP, as PEFT users expect
    targets: List[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # the frozen base of the target linears: as loaded, or 4-bit NF4 (QLoRA)
    quantize_base: QuantizeBase = QuantizeBase.none


@dataclass
class ModelCfg:
    """Llama-style decoder shape. ``ffn_dim_multiplier``/``multiple_of`` follow Llama's rule."""

    name: str = "smoke"  # a label, recorded on the run
    dim: int = 128  # hidden size (the residual stream's width)
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # attention (query) heads; dim must be a multiple of it
    n_kv_heads: int = 4  # key/value heads: fewer than n_heads is grouped-query attention
    vocab_size: int = 4096  # embedding rows (and LM-head outputs); must cover the tokenizer's tokens
    multiple_of: int = 32  # Llama's rule rounds the FFN width up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None  # Llama's FFN width multiplier (1.3 for 8B); None: 1
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base frequency (500000 for Llama 3)
    max_seq_len: int = 2048  # RoPE table length; train.seq_len may not exceed it
    tie_embeddings: bool = False  # the LM head shares the input embedding's weight
    kernels: Kernels = Kernels.fused  # plain-PyTorch reference math (the oracle) or the fused fast path
    # the fused kernels' LM head + loss: Liger's Triton kernel, our chunked CE, or auto (Liger on CUDA if installed)
    loss_kernel: LossKernel = LossKernel.auto
    # torch.compile each block. Off by default on every device: compile time is paid before the
    # first step on every start and resume, and a short run may never earn it back (docs/benchmarks.md)
    compile: bool = False
    arch: Arch = Arch.llama  # the Hugging Face family the weights follow (qwen2: q/k/v biases)
    # the FFN width; None: Llama's rule from dim, multiple_of and ffn_dim_multiplier
    hidden_dim: Optional[int] = None
    # which dimensions RoPE rotates together: Meta's pairs or Hugging Face's halves (init_from: half)
    rope_layout: RopeLayout = RopeLayout.interleaved
    # None, or Llama 3.1's {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}
    rope_scaling: Optional[Dict[str, Any]] = None
    # a Hugging Face checkpoint (directory or fsspec URL: config.json + safetensors) to start from;
    # its config.json sets the shape fields above (``hf_config``)
    init_from: Optional[str] = None
    # LoRA / QLoRA: frozen base, trained low-rank adapters (rank 0: off, every weight trains)
    lora: LoraCfg = field(default_factory=LoraCfg)


@dataclass
class DataCfg:
    """Where training text comes from and how it is tokenized."""

    name: str = "pydoc"  # a label; the token cache's key includes it
    # "builtin:pydoc" (text shipped with Python) or an fsspec URL / glob of .txt/.jsonl/.parquet files
    source: str = "builtin:pydoc"
    text_field: str = "text"  # the text of a .jsonl record / .parquet row (format text)
    # text: documents run together, loss on every token; sft: chat / prompt-completion records,
    # loss on the answers only, examples packed without attention across them
    format: DataFormat = DataFormat.text
    # format text: attention stays inside each document (the end-of-text token closes one) and RoPE
    # positions restart at each, as Llama 3 pretrained; False lets every token see the whole window.
    # sft always keeps attention inside each example.
    document_mask: bool = False
    vocab_size: int = 4096  # the byte-level BPE trained on data.source (when data.tokenizer is None)
    val_fraction: float = 0.05  # the held-out share of the tokens (the tail): val/loss and evaluate
    # None: $LLMCTL_CACHE_DIR, else ~/.cache/llmctl
    cache_dir: Optional[str] = None
    # a tokenizer.json, a Hugging Face model directory / fsspec URL holding one (its
    # tokenizer_config.json names the end-of-text token and chat template), or a tiktoken BPE file;
    # None: a byte-level BPE of data.vocab_size trained on data.source, or with model.init_from the
    # checkpoint's own tokenizer
    tokenizer: Optional[str] = None


@dataclass
class DpoCfg:
    """``train.objective=dpo``: the preference loss (TRL's ``DPOConfig`` names and defaults)."""

    beta: float = 0.1  # how far the policy may move from the reference (the KL penalty's inverse weight)
    loss: DpoLoss = DpoLoss.sigmoid  # TRL's loss_type
    label_smoothing: float = 0.0  # loss=robust: the share of pairs assumed mislabelled, in [0, 0.5)
    reference: DpoReference = DpoReference.auto  # the reference model (DpoReference)


@dataclass
class TrainCfg:
    """Optimisation. ``batch_size`` is the global batch in sequences per optimizer step."""

    steps: int = 200  # optimizer steps
    # lm: next-token cross-entropy; dpo: preference pairs (data.format=preference, train.dpo.*), where
    # batch_size and micro_batch_size count pairs (two sequences each), as TRL's batch sizes do
    objective: Objective = Objective.lm
    dpo: DpoCfg = field(default_factory=DpoCfg)  # train.objective=dpo: its loss, beta and reference
    batch_size: int = 16  # global batch in sequences per optimizer step, split over data-parallel ranks
    # sequences per device per forward/backward; the step accumulates gradients over
    # batch_size / (micro_batch_size x data-parallel ranks) of them. None: the whole local batch at once
    micro_batch_size: Optional[int] = None
    seq_len: int = 128  # tokens per sequence
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the learning rate at the schedule's horizon, as a fraction of lr
    warmup_steps: int = 10  # linear warmup from 0 to lr
    schedule: Schedule = Schedule.cosine  # the decay after warmup (schedule.py)
    # the step the decay ends at (None: train.steps); a resume that changes train.steps pins the
    # run's horizon here so the learning rate never jumps (schedule.py, docs/resume.md)
    schedule_steps: Optional[int] = None
    decay_fraction: float = 0.2  # wsd: the decay takes this fraction of the post-warmup steps
    weight_decay: float = 0.1  # AdamW's decoupled weight decay (not on norms and biases)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # global gradient-norm clip; 0: off
    seed: int = 0  # initial weights and data order: the same seed, the same curve at any world size
    # compute dtype; bf16: FSDP2 bf16 parameters over fp32 master weights; auto: bf16 on CUDA (TF32 for the
    # remaining fp32 matmuls), fp32 on CPU
    dtype: DType = DType.auto
    # FP8 linears on an FP8 GPU (compute capability >= 8.9), over train.dtype=bf16 (docs/scale.md)
    fp8: Fp8 = Fp8.none
    log_every: int = 10  # steps between train/* metric logs
    val_every: int = 50  # steps between val/loss passes; 0: only at the start and the end
    val_batches: int = 4  # batches per validation pass (a fixed set: values compare across runs)


@dataclass
class ParallelCfg:
    """Device-mesh degrees. ``dp_shard=-1`` takes every device the other degrees leave."""

    dp_replicate: int = 1  # replicated data-parallel groups (HSDP when > 1 with dp_shard > 1)
    dp_shard: int = -1  # FSDP2 shard degree; -1: every process the other degrees leave
    tp: int = 1  # tensor-parallel degree (sequence parallel, vocab-parallel loss); divides the heads
    ac: ActivationCheckpointing = ActivationCheckpointing.none  # activation checkpointing per block
    grad_sync: GradSync = GradSync.auto  # FSDP with micro-batches: reduce per step or per micro-batch
    collective_timeout_s: float = 600.0  # after the first step: a longer collective wait (a host gone) ends the job


@dataclass
class CheckpointCfg:
    """Distributed checkpoints. ``dir`` is any fsspec URL; None (under llmctl) puts them beside the run."""

    dir: Optional[str] = None  # any fsspec URL; None: no checkpoints (llmctl sets one beside the run)
    every: int = 0  # steps between saves; 0: only the final one
    keep: int = 2  # complete checkpoints kept; older ones go once a newer one completes
    async_save: bool = False  # save in the background while training continues
    preempt_grace_s: float = 20.0  # SIGTERM/SIGUSR1: emergency save only if it can finish within this (docs/resume.md)


@dataclass
class EvalCfg:
    """``python -m workloads.pretrain.evaluate`` (``llmctl eval``): held-out metrics and samples."""

    # prompts for the greedy and sampled completions
    prompts: List[str] = field(default_factory=lambda: ["The ", "def ", "Return a"])
    max_new_tokens: int = 32  # tokens generated per prompt
    temperature: float = 0.8  # the sampled completion; a greedy one is always made too
    top_k: Optional[int] = 50  # top-k sampling; None: off
    seed: int = 0  # the sampling seed
    # None: train.val_batches (the fixed set training's val/loss uses, so the numbers agree)
    val_batches: Optional[int] = None
    # None: the newest complete checkpoint
    step: Optional[int] = None
    # Another data set (fsspec URL/glob, like data.source), tokenized with the run's tokenizer;
    # None: the held-out split. ``llmctl eval RUN data.source=...`` sets this.
    source: Optional[str] = None
    text_field: str = "text"  # the text of a record of eval.source (like data.text_field)
    # lm-evaluation-harness tasks (names, groups or tags) scored during training at checkpoint steps,
    # logged as eval/<task>/<metric> at those steps (components/task_scores.py); []: none
    tasks: List[str] = field(default_factory=list)
    # score eval.tasks every N steps (a multiple of checkpoint.every: the checkpoint is what is
    # scored) and at the last step; None: at every checkpoint
    every: Optional[int] = None
    include_path: Optional[str] = None  # lm-eval --include_path: a directory of your own task YAMLs
    num_fewshot: Optional[int] = None  # lm-eval --num_fewshot; None: each task's own
    limit: Optional[int] = None  # lm-eval --limit: the first N examples of each task; None: all
    batch_size: str = "1"  # lm-eval --batch_size: a number, or auto


@dataclass
class TrainerCfg:
    """Everything the trainer reads. A resolved YAML may carry more sections (a launcher's own,
    see ``LAUNCHER_SECTIONS``); the trainer ignores those and refuses any other unknown key."""

    model: ModelCfg = field(default_factory=ModelCfg)  # the decoder's shape and kernels
    data: DataCfg = field(default_factory=DataCfg)  # training text and its tokenizer
    train: TrainCfg = field(default_factory=TrainCfg)  # optimisation
    parallel: ParallelCfg = field(default_factory=ParallelCfg)  # the device mesh
    checkpoint: CheckpointCfg = field(default_factory=CheckpointCfg)  # distributed checkpoints
    eval: EvalCfg = field(default_factory=EvalCfg)  # evaluate.py: held-out metrics and samples


# Sections a launcher writes beside the trainer's in the same resolved YAML (llmctl: where the job
# runs, where it is tracked, which program runs, whom it tells). Named here so the trainer can skip
# exactly these and still refuse a typo.
LAUNCHER_SECTIONS = ("infra", "tracking", "workload", "notify")
