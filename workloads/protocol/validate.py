"""Checks the schema cannot express: value ranges and how the parts of a trainer config fit.

Stdlib only, on the typed config (``schema.TrainerCfg``: ``config.load`` makes one, ``config.typed``
one from a plain mapping). The trainer runs them before any process-group work, so a bad layout
fails in a second with a message naming the key and the fix, not in NCCL; llmctl runs the same
functions when it composes a config, before anything is created.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workloads.protocol.schema import TrainerCfg


class ConfigError(ValueError):
    """A trainer config the user can fix; the message names the key and the fix."""


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"Bad value for '{key}': {message}")


def validate(cfg: TrainerCfg) -> None:
    """Value ranges and cross-key consistency of the trainer's sections of a config."""
    model, data, train = cfg.model, cfg.data, cfg.train
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len", "multiple_of"):
        value = getattr(model, key)
        _require(value > 0, f"model.{key}", f"must be a positive integer, got {value}. Fix: model.{key}=<n > 0>")
    _require(
        model.dim % model.n_heads == 0,
        "model.dim",
        f"{model.dim} is not divisible by model.n_heads={model.n_heads}",
    )
    _require(
        model.n_heads % model.n_kv_heads == 0,
        "model.n_kv_heads",
        f"model.n_heads={model.n_heads} must be a multiple of n_kv_heads={model.n_kv_heads}",
    )
    _require(
        model.hidden_dim is None or model.hidden_dim > 0,
        "model.hidden_dim",
        "must be a positive integer, or null for Llama's rule",
    )
    scaling = model.rope_scaling
    keys = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    _require(
        not scaling or (scaling.get("rope_type") == "llama3" and all(k in scaling for k in keys)),
        "model.rope_scaling",
        f"only Llama 3.1's scaling is supported: null or {{{', '.join(keys)}}} with rope_type=llama3",
    )
    for key in ("steps", "batch_size", "seq_len", "log_every", "val_batches"):
        value = getattr(train, key)
        _require(value > 0, f"train.{key}", f"must be a positive integer, got {value}. Fix: train.{key}=<n > 0>")
    _require(train.val_every >= 0, "train.val_every", "must be >= 0 (0: validate only at the start and the end)")
    _require(train.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
    _require(train.lr > 0, "train.lr", f"must be > 0, got {train.lr}. Fix: train.lr=3e-4")
    _require(0 <= train.min_lr_ratio <= 1, "train.min_lr_ratio", "must lie in [0, 1]")
    _require(train.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")
    timeout = cfg.parallel.collective_timeout_s
    _require(timeout > 0, "parallel.collective_timeout_s", f"must be > 0 seconds, got {timeout}. Fix: e.g. 600")
    _require(
        train.seq_len <= model.max_seq_len,
        "train.seq_len",
        f"{train.seq_len} exceeds model.max_seq_len={model.max_seq_len} of model '{model.name}'",
    )
    _require(
        bool(data.source),
        "data.source",
        "no text to train on. Fix: data.source=<fsspec URL or glob>, e.g. data.source='s3://bucket/corpus/*.jsonl'",
    )
    _require(0 < data.val_fraction < 1, "data.val_fraction", f"must lie in (0, 1), got {data.val_fraction}")
    _require(
        data.format != "sft" or data.source != "builtin:pydoc",
        "data.format",
        "sft reads your fine-tuning records, not the bundled corpus. Fix: data.source=<.jsonl of "
        '{"messages": [...]} or {"prompt": ..., "completion": ...} records> (or data=sft)',
    )
    if not data.tokenizer:  # a BPE of data.vocab_size trained here (a given one is checked when loaded)
        _require(
            2 <= data.vocab_size <= model.vocab_size,
            "data.vocab_size",
            f"the tokenizer's {data.vocab_size} tokens must fit model.vocab_size={model.vocab_size}",
        )
        _require(
            data.vocab_size <= 65535 or data.source != "builtin:pydoc",
            "data.vocab_size",
            "the bundled corpus supports at most 65535 tokens",
        )
    if model.loss_kernel == "liger":  # where Liger would not run, asking for it is a mistake, not a fallback
        _require(
            model.kernels == "fused",
            "model.loss_kernel",
            "liger is the fused kernels' loss, but model.kernels=reference computes full logits."
            " Fix: model.kernels=fused, or model.loss_kernel=auto",
        )
        _require(
            cfg.parallel.tp == 1,
            "model.loss_kernel",
            f"under tensor parallelism (parallel.tp={cfg.parallel.tp}) the loss is vocab-parallel cross-entropy,"
            " not liger. Fix: model.loss_kernel=auto, or parallel.tp=1",
        )
    if train.fp8 != "none":
        _require(
            train.dtype in ("bf16", "auto"),  # auto is bf16 on CUDA, the only place FP8 runs
            "train.fp8",
            f"{train.fp8.value} runs the matmuls in FP8 over bf16 parameters, but train.dtype={train.dtype.value}."
            " Fix: add train.dtype=bf16",
        )
        _require(
            cfg.parallel.tp == 1,
            "train.fp8",
            f"FP8 with tensor parallelism (parallel.tp={cfg.parallel.tp}) is not supported yet. "
            "Fix: parallel.tp=1 (FSDP shards any size), or train.fp8=none",
        )
    check_lora(cfg)
    check_dpo(cfg)
    ckpt = cfg.checkpoint
    _require(ckpt.every >= 0, "checkpoint.every", "must be >= 0 (0 saves only at the end)")
    _require(ckpt.keep >= 1, "checkpoint.keep", "must keep at least 1 checkpoint")
    check_static_layout(cfg)
    check_fp8_tokens(cfg)
    check_eval_tasks(cfg)


def check_eval_tasks(cfg: TrainerCfg) -> None:
    """``eval.*``'s lm-eval settings: their ranges, and ``eval.every`` on checkpoint steps (what is scored)."""
    ev, ckpt = cfg.eval, cfg.checkpoint
    _require(ev.limit is None or ev.limit >= 1, "eval.limit", f"examples per task, at least 1 (got {ev.limit})")
    _require(ev.num_fewshot is None or ev.num_fewshot >= 0, "eval.num_fewshot", "shots per example, 0 or more")
    size = str(ev.batch_size)
    _require(size == "auto" or (size.isdigit() and int(size) >= 1), "eval.batch_size", f"{size}: a number or auto")
    if not ev.tasks:
        _require(ev.every is None, "eval.every", "scores eval.tasks, and none is set. Fix: eval.tasks=[task,...]")
        return
    if ev.every is not None:
        _require(
            ev.every >= 1 and ckpt.every >= 1 and ev.every % ckpt.every == 0,
            "eval.every",
            f"{ev.every}: the tasks score a checkpoint, saved every {ckpt.every} steps."
            f" Fix: eval.every=<a multiple of checkpoint.every>, or leave it out to score every checkpoint",
        )


def check_dpo(cfg: TrainerCfg) -> None:
    """``train.objective=dpo`` and ``data.format=preference`` go together; ``train.dpo.*`` ranges."""
    dpo, preference = cfg.train.objective == "dpo", cfg.data.format == "preference"
    _require(
        dpo or not preference,
        "data.format",
        "preference pairs train with the DPO objective, but train.objective=lm. Fix: train.objective=dpo",
    )
    _require(
        preference or not dpo,
        "train.objective",
        f"dpo trains on preference pairs, but data.format={cfg.data.format.value}. Fix: data=preference"
        " data.source=<.jsonl of prompt/chosen/rejected records>",
    )
    if not dpo:
        return
    opts = cfg.train.dpo
    _require(opts.beta > 0, "train.dpo.beta", f"must be > 0, got {opts.beta}. Fix: train.dpo.beta=0.1")
    if opts.loss == "robust":
        _require(
            0 <= opts.label_smoothing < 0.5,
            "train.dpo.label_smoothing",
            f"the robust loss's share of flipped pairs must lie in [0, 0.5), got {opts.label_smoothing}."
            " Fix: train.dpo.label_smoothing=0.1",
        )
    else:
        _require(
            opts.label_smoothing == 0,
            "train.dpo.label_smoothing",
            f"only train.dpo.loss=robust reads it (train.dpo.loss={opts.loss.value}). Fix: train.dpo.loss=robust,"
            " or train.dpo.label_smoothing=0",
        )
    _require(
        not (opts.reference == "copy" and cfg.model.lora.rank),
        "train.dpo.reference",
        "copy keeps a second model, but under LoRA the frozen base with the adapters off is the reference"
        " already. Fix: train.dpo.reference=auto",
    )
    _require(
        cfg.train.fp8 == "none",
        "train.fp8",
        "FP8 with train.objective=dpo is not supported yet. Fix: train.fp8=none",
    )


def check_lora(cfg: TrainerCfg) -> None:
    """``model.lora.*``: ranges, target names, and what LoRA / QLoRA cannot run with."""
    from workloads.protocol.schema import LORA_TARGETS
    from workloads.protocol.shape import NF4_BLOCK, NF4_SCALER_BLOCK, target_linears

    lora, par = cfg.model.lora, cfg.parallel
    rank = lora.rank
    _require(rank >= 0, "model.lora.rank", f"must be >= 0 (0: no adapters), got {rank}. Fix: model.lora.rank=16")
    nf4 = lora.quantize_base == "nf4"
    _require(
        not nf4 or lora.rank > 0,
        "model.lora.quantize_base",
        "nf4 quantizes the frozen base under LoRA adapters, but model.lora.rank=0 trains every weight."
        " Fix: model.lora.rank=16 (or another rank > 0), or model.lora.quantize_base=none",
    )
    if not lora.rank:
        return
    _require(lora.alpha > 0, "model.lora.alpha", f"must be > 0, got {lora.alpha}. Fix: model.lora.alpha=16")
    _require(
        0 <= lora.dropout < 1,
        "model.lora.dropout",
        f"must lie in [0, 1), got {lora.dropout}. Fix: model.lora.dropout=0.05",
    )
    unknown = [t for t in lora.targets if t not in LORA_TARGETS]
    _require(
        not unknown and bool(lora.targets),
        "model.lora.targets",
        f"{unknown or 'an empty list'}: name the model's linears, some of {', '.join(LORA_TARGETS)} (PEFT's"
        " q_proj, k_proj, v_proj, o_proj, gate_proj, down_proj, up_proj are wq, wk, wv, wo, w1, w2, w3)."
        f" Fix: model.lora.targets=[{','.join(LORA_TARGETS)}]",
    )
    _require(
        cfg.train.fp8 == "none",
        "train.fp8",
        "FP8 with LoRA (model.lora.rank > 0) is not supported yet. Fix: train.fp8=none, or model.lora.rank=0",
    )
    _require(
        lora.dropout == 0 or par.ac == "none",
        "model.lora.dropout",
        f"parallel.ac={par.ac.value} recomputes each block in backward without replaying its random state, so the"
        " adapters' dropout would draw another mask there. Fix: model.lora.dropout=0, or parallel.ac=none",
    )
    if not nf4:
        return
    group = NF4_BLOCK * NF4_SCALER_BLOCK
    for name, (fan_in, fan_out) in target_linears(cfg.model).items():
        _require(
            name not in lora.targets or (fan_in * fan_out) % group == 0,
            "model.lora.quantize_base",
            f"nf4 quantizes weights in groups of {group} ({NF4_BLOCK} x {NF4_SCALER_BLOCK}), but {name} holds"
            f" {fan_in} x {fan_out} = {fan_in * fan_out} weights of model '{cfg.model.name}'. Fix: a model whose"
            f" linears are multiples of {group} weights, leave {name} out of model.lora.targets,"
            " or model.lora.quantize_base=none",
        )
        # TP splits the rows of wq wk wv w1 w3 (``nf4.TensorParallelNF4Linear``): each rank's rows
        # must be whole scale groups of the one-process quantization; wo and w2 stay whole
        colwise = name not in ("wo", "w2")
        _require(
            name not in lora.targets or not colwise or (fan_in * fan_out // group) % par.tp == 0,
            "parallel.tp",
            f"{par.tp} TP ranks cannot split {name}'s NF4 weight ({fan_in * fan_out // group} groups of {group}"
            " weights) into whole groups. Fix: a parallel.tp that divides it, or model.lora.quantize_base=none",
        )


def check_lora_layout(cfg: TrainerCfg, dp_shard: int) -> None:
    """QLoRA under FSDP: each of ``dp_shard`` ranks keeps whole rows and whole NF4 groups of every
    target weight, so the shards gather back into the tensor quantized in one process."""
    from workloads.protocol.shape import NF4_BLOCK, NF4_SCALER_BLOCK, target_linears

    lora = cfg.model.lora
    if not lora.rank or lora.quantize_base != "nf4" or dp_shard == 1:
        return
    _require(
        cfg.parallel.tp == 1,
        "parallel.dp_shard",
        f"nf4 under tensor parallelism (parallel.tp={cfg.parallel.tp}) keeps the 4-bit base out of FSDP, which"
        f" cannot also shard it over {dp_shard} ranks. Fix: parallel.dp_shard=1 (parallel.dp_replicate for more"
        " data parallelism), parallel.tp=1 (FSDP shards the 4-bit base), or model.lora.quantize_base=none",
    )
    group = NF4_BLOCK * NF4_SCALER_BLOCK
    for name, (fan_in, fan_out) in target_linears(cfg.model).items():
        _require(
            name not in lora.targets or (fan_out % dp_shard == 0 and (fan_in * fan_out // group) % dp_shard == 0),
            "parallel.dp_shard",
            f"{dp_shard} FSDP ranks cannot split {name}'s NF4 weight ({fan_out} rows, {fan_in * fan_out // group}"
            f" groups of {group} weights) evenly. Fix: a parallel.dp_shard that divides both, or"
            " model.lora.quantize_base=none",
        )


def check_static_layout(cfg: TrainerCfg) -> None:
    """Layout rules that hold whatever the world size."""
    model, par, train = cfg.model, cfg.parallel, cfg.train
    tp, rep, shard = par.tp, par.dp_replicate, par.dp_shard
    _require(tp >= 1, "parallel.tp", f"must be >= 1, got {tp}")
    _require(rep >= 1, "parallel.dp_replicate", f"must be >= 1, got {rep}")
    _require(shard >= 1 or shard == -1, "parallel.dp_shard", f"must be >= 1 or -1 (all remaining devices), got {shard}")
    for key in ("n_heads", "n_kv_heads"):
        heads = getattr(model, key)
        _require(
            heads % tp == 0, "parallel.tp", f"tp={tp} must divide model.{key}={heads}; choose a divisor of {heads}"
        )
    dp = rep * (shard if shard > 0 else 1)
    _require(
        train.batch_size % dp == 0,
        "train.batch_size",
        f"{train.batch_size} sequences cannot be split over {dp} data-parallel ranks; use a multiple of {dp}",
    )
    micro = train.micro_batch_size
    if micro is not None:
        _require(micro > 0, "train.micro_batch_size", f"must be a positive integer or null, got {micro}")
        local = train.batch_size // dp
        _require(
            local % micro == 0,
            "train.micro_batch_size",
            f"{micro} does not divide the {local} sequences each of {dp} data-parallel rank(s) takes per "
            f"step (train.batch_size={train.batch_size}); use a divisor of {local}",
        )


def check_fp8_tokens(cfg: TrainerCfg, dp: int | None = None) -> None:
    """FP8 on CUDA: ``_scaled_mm`` needs every dimension a multiple of 16, and in the weight
    gradient's GEMM the inner one is the micro-batch's tokens (CPU skips the check, so only a GPU
    run would crash, in its first backward). ``dp``: data-parallel ranks (None: the fixed degrees,
    ``dp_shard=-1`` counted as 1, as ``check_static_layout`` counts them)."""
    train, par = cfg.train, cfg.parallel
    if train.fp8 == "none":
        return
    if dp is None:
        dp = par.dp_replicate * (par.dp_shard if par.dp_shard > 0 else 1)
    micro = train.micro_batch_size or max(1, train.batch_size // max(1, dp))
    tokens = micro * train.seq_len
    _require(
        tokens % 16 == 0,
        "train.seq_len",
        f"train.fp8={train.fp8.value} needs the tokens per micro-batch (sequences per rank per micro-batch x"
        f" train.seq_len = {micro} x {train.seq_len} = {tokens}) divisible by 16. Fix: a train.seq_len"
        " (or train.micro_batch_size / train.batch_size) that makes it a multiple of 16, or train.fp8=none",
    )


def resolve_layout(cfg: TrainerCfg, world_size: int) -> dict[str, int]:
    """Concrete mesh degrees for ``world_size`` processes; fills ``dp_shard=-1``."""
    par = cfg.parallel
    tp, rep, shard = par.tp, par.dp_replicate, par.dp_shard
    if shard == -1:
        _require(
            world_size % (rep * tp) == 0,
            "parallel.dp_shard",
            f"{world_size} processes cannot be split into dp_replicate={rep} x tp={tp}",
        )
        shard = world_size // (rep * tp)
    _require(
        rep * shard * tp == world_size,
        "parallel",
        f"dp_replicate={rep} x dp_shard={shard} x tp={tp} = {rep * shard * tp}"
        f" but the job has {world_size} processes; make the product equal the process count",
    )
    layout = {"dp_replicate": rep, "dp_shard": shard, "tp": tp}
    check_static_layout(
        dataclasses.replace(cfg, parallel=dataclasses.replace(par, dp_replicate=rep, dp_shard=shard, tp=tp))
    )
    check_fp8_tokens(cfg, rep * shard)
    check_lora_layout(cfg, shard)
    return layout
