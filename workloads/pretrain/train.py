"""Entry point: ``python -m workloads.pretrain`` or ``torchrun --nproc_per_node=N -m workloads.pretrain``.

Config: ``--config resolved.yaml`` (llmctl writes one per run; ``llmctl config show ... > run.yaml``
writes one by hand) with optional ``key=value`` overrides after it, read once into a
``schema.TrainerCfg`` instance and checked by ``validate`` (``config.load``); everything below reads
that object. The trainer imports nothing from llmctl and does
not compose presets: it runs under plain torchrun with its own dependencies.

Order of work, top to bottom in ``Trainer``: layout validation -> devices, process group and
DeviceMesh -> data -> model (built on meta, materialised, initialised from ``train.seed``, the
same on every rank) -> ``parallelize`` (FP8 -> TP -> AC -> compile -> FSDP2) -> optimizer -> resume from
the newest complete checkpoint -> loop (val at step 0, every ``val_every`` and at the end; logs
every ``log_every``; checkpoints every ``checkpoint.every`` and at the end).

Nothing here exists for tests: the faults and traces they ask of the trainer (a failure at step N,
a file of full-precision losses, slow saves) are injected from outside (tests/inject/sitecustomize.py)
at the seams ``Trainer.train_step``, ``MetricSink.log`` and ``Checkpointer._write_marker``.

Exit status: 0 on success, 1 on an exception (traceback on stderr), 130 on SIGINT, 75 when preempted:
SIGTERM/SIGUSR1 finish the current step, write an emergency checkpoint within
``checkpoint.preempt_grace_s`` and tag the run ``llmctl.preempted`` (``preempt.py``, docs/resume.md).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from workloads.planner.hardware import cpu_threads
from workloads.pretrain.checkpoint.dcp import Checkpointer
from workloads.pretrain.components import preempt, system_metrics, task_scores
from workloads.pretrain.components.budget import BudgetGuard
from workloads.pretrain.components.dataset_input import log_training_corpus
from workloads.pretrain.components.metrics import MetricSink, format_train_line, peak_memory_gib, peak_tflops
from workloads.pretrain.components.optim import build_optimizer, lr_factor
from workloads.pretrain.data import Sampler, prepare_corpus, val_batches
from workloads.pretrain.data.preference import PreferencePairs
from workloads.pretrain.model import transformer
from workloads.pretrain.model.transformer import Transformer
from workloads.pretrain.parallel import fp8
from workloads.pretrain.parallel.parallelize import (
    ParallelDims,
    autocast_context,
    gradient_sync_due,
    local_loss,
    loss_context,
    parallelize,
    set_gradient_sync,
)
from workloads.protocol import shape
from workloads.protocol.config import parse_args
from workloads.protocol.run_contract import EXIT_CONFIG, EXIT_PREEMPTED
from workloads.protocol.schema import TrainerCfg
from workloads.protocol.validate import ConfigError

# ----------------------------------------------------------------------------- config


def load_config(argv: list[str] | None = None) -> TrainerCfg:
    """Parse ``--config PATH [key=value ...]`` into the typed, validated config (``config.load``)."""
    parser = argparse.ArgumentParser(prog="python -m workloads.pretrain", description=__doc__.splitlines()[0])
    return parse_args(parser, argv)[1]


# ----------------------------------------------------------------------------- devices


@dataclass
class DistEnv:
    """Where this process sits: its rank, the validated mesh degrees and the DeviceMesh."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    dims: ParallelDims
    mesh: Any  # DeviceMesh, or None for one process

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        return self.dims.dp


def init_distributed(cfg: TrainerCfg) -> DistEnv:
    """Validate the layout, pick the device, size the CPU thread pool, join torchrun's group (or
    make a 1-rank one for a single process: the mesh, and so FSDP's bf16 recipe, exists at every size).

    Multi-node needs nothing else: torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR ...)
    is all ``init_process_group`` reads. gloo on CPU, nccl on GPU.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dims = ParallelDims.from_config(cfg, world)  # before any process-group work

    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        torch.set_num_threads(cpu_threads(local_world))  # processes sharing a CPU would otherwise thrash
    if not dist.is_initialized():
        if world > 1:
            dist.init_process_group(backend, timeout=START_TIMEOUT)
        else:  # one process, with or without torchrun: a 1-rank group for the 1-rank FSDP mesh
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=START_TIMEOUT)
    # Always a mesh, 1-rank for one process: ``parallelize`` then applies FSDP2 at every world
    # size, so one process and many train with the same bf16 recipe (``apply_fsdp``).
    mesh = dims.build_mesh(device.type)
    return DistEnv(rank, world, local_rank, local_world, device, dims, mesh)


# The collective timeout while starting: a checkpoint load from object storage (every rank waits
# at DCP's barriers for the slowest reader) and the first step's torch.compile can each outlast
# torch's 10-minute NCCL default, which would then kill a healthy job. After the first step
# ``parallel.collective_timeout_s`` applies (``steady_timeouts``), so a rank or a host that went
# silent (a lost node: no connection reset, the peers just wait) ends the job within it.
START_TIMEOUT = timedelta(minutes=45)


def steady_timeouts(env: DistEnv, timeout_s: float) -> None:
    """Every rank, after the first step: the default group's and the mesh's groups' timeout set to
    ``timeout_s``. Best-effort (``_set_pg_timeout`` is torch's private API, which torchtitan uses
    the same way): if it is missing, the longer start timeout simply stays."""
    if env.world_size == 1 or not dist.is_initialized():
        return
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        groups = [None] + ([env.mesh.get_group(i) for i in range(env.mesh.ndim)] if env.mesh is not None else [])
        for group in groups:
            _set_pg_timeout(timedelta(seconds=timeout_s), group)
    except Exception as e:
        print(f"warning: collective timeout stays {START_TIMEOUT} ({type(e).__name__}: {e})", file=sys.stderr)


# ----------------------------------------------------------------------------- loop


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: list, autocast, env: DistEnv, micro_batch_size: int | None = None
) -> float:
    """Loss over every target of the fixed validation batches (all ranks): their exact mean."""
    model.eval()
    total = torch.zeros((), device=env.device)
    with loss_context(env.dims)():
        for b in (micro for batch in batches for micro in batch.split(micro_batch_size)):
            with autocast():
                total += local_loss(model(b.inputs, b.targets, **b.model_kwargs(), reduction="sum")).float()
    model.train()
    return _sum_over_dp(total, env) / sum(b.global_targets for b in batches)


def _sum_over_dp(value: torch.Tensor, env: DistEnv) -> float:
    """Sum of ``value`` over the data-parallel ranks (tp ranks hold equal values)."""
    if env.world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= env.dims.tp
    return value.item()


def step_loss(model: torch.nn.Module, batch: Any, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(what to backpropagate, this rank's share of the reported loss) for one batch.

    The loss is the sum over this rank's targets divided by the global batch's count of targets,
    so the shares of all ranks (and micro-batches) add up to the exact mean over the global batch,
    masks and padding included. FSDP averages gradients over the data-parallel ranks, hence the
    factor ``dp_size`` in what is backpropagated.
    """
    share = local_loss(model(batch.inputs, batch.targets, **batch.model_kwargs(), reduction="sum"))
    share = share / batch.global_targets
    return share * dp_size, share.detach()


def _accumulation(cfg: TrainerCfg, env: DistEnv) -> str:
    tc = cfg.train
    local = tc.batch_size // env.dp_size
    if not tc.micro_batch_size or tc.micro_batch_size >= local:
        return ""
    n = local // tc.micro_batch_size
    sync = ""
    if env.dims.dp_enabled:
        each = gradient_sync_due(0, n, cfg.parallel.grad_sync)  # the first of several: only if after each
        sync = ", gradients reduced after each" if each else ", gradients reduced once"
    return f" ({n} micro-batches of {tc.micro_batch_size} per rank{sync})"


def truncation_warning(train_seqs: Any, val_seqs: Any, seq_len: int) -> str:
    """A line of its own when fine-tuning examples are cut to ``train.seq_len`` (their ends, often
    the answer, are never learned), with the length that keeps all of them; "" when none is."""
    if not hasattr(train_seqs, "truncated"):
        return ""
    cut = train_seqs.truncated + val_seqs.truncated
    if not cut:
        return ""
    if isinstance(train_seqs, PreferencePairs):  # a pair is cut when either answer is
        total = len(train_seqs) + len(val_seqs)
        longest = max(train_seqs.longest, val_seqs.longest)
        return (
            f"pretrain | warning: {cut:,} of {total:,} preference pairs ({cut / total:.0%}) have an answer longer "
            f"than train.seq_len={seq_len}, cut there, its end not compared; train.seq_len={longest} keeps every one"
        )
    total = len(train_seqs.starts) + len(val_seqs.starts)
    longest = max(train_seqs.longest, val_seqs.longest)
    return (
        f"pretrain | warning: {cut:,} of {total:,} examples ({cut / total:.0%}) are longer than "
        f"train.seq_len={seq_len} and are cut there, their ends not learned; train.seq_len={longest} keeps every one"
    )


def _describe(train_seqs: Any, val_seqs: Any) -> str:
    """What the trainer reads: windows of the token stream, packed fine-tuning examples, or pairs."""
    if isinstance(train_seqs, PreferencePairs):
        cut = train_seqs.truncated + val_seqs.truncated
        return f"{len(train_seqs):,} train / {len(val_seqs):,} val preference pairs, two rows each" + (
            f", {cut} with an answer cut to seq_len" if cut else ""
        )
    if not hasattr(train_seqs, "bins"):
        masked = ", attention within documents" if train_seqs.eos_id is not None else ""
        return f"{len(train_seqs.tokens):,} train / {len(val_seqs.tokens):,} val tokens{masked}"
    cut = (
        f", {train_seqs.truncated + val_seqs.truncated} truncated to seq_len"
        if train_seqs.truncated + val_seqs.truncated
        else ""
    )
    return (
        f"{len(train_seqs.starts):,} train / {len(val_seqs.starts):,} val examples packed into "
        f"{len(train_seqs):,} / {len(val_seqs):,} sequences ({train_seqs.fill:.0%} filled{cut})"
    )


def init_sharded(cfg: TrainerCfg, env: DistEnv, frozen: bool = False) -> torch.nn.Module:
    """meta → parallelize → materialise empty → initial weights (``init``): the same values as one
    process would draw, for any layout, with no rank ever holding more than its shards and one
    parameter. Deterministic given ``torch.manual_seed``. ``frozen``: no gradients, held in the
    compute dtype (DPO's reference copy, ``parallelize``)."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model = parallelize(model, env.dims, env.mesh, cfg, frozen=frozen)
    model.to_empty(device=env.device)
    model.init_weights(buffer_device=env.device)
    return model


def load_pretrained(cfg: TrainerCfg, env: DistEnv, frozen: bool = False) -> torch.nn.Module:
    """``model.init_from``: meta → parallelize → materialise empty → RoPE tables → the checkpoint's
    weights (``hf_checkpoint``): no rank ever holds more than its shards. With LoRA the checkpoint
    is the frozen base (NF4 with QLoRA, quantized as it is read); the adapters, which it lacks,
    start from ``train.seed`` as PEFT starts them (B = 0: step 0 computes the base model).
    ``frozen``: as ``init_sharded``'s."""
    from workloads.pretrain.checkpoint import hf_load as hf_checkpoint
    from workloads.pretrain.data.cache import cache_root

    with torch.device("meta"):
        model = Transformer(cfg.model)
    model = parallelize(model, env.dims, env.mesh, cfg, frozen=frozen)
    model.to_empty(device=env.device)
    model.init_rope(env.device)
    hf_checkpoint.load(model, str(cfg.model.init_from), cache_root(cfg.data))
    if cfg.model.lora.rank and not frozen:
        from workloads.pretrain.model import lora

        lora.init_adapters(model, cfg.train.seed)
    return model


def build_reference(cfg: TrainerCfg, env: DistEnv, policy: torch.nn.Module):
    """DPO's reference (``components.dpo.Reference``): under LoRA the policy with its adapters off,
    else a frozen copy of the starting weights (``model.init_from``, or ``train.seed``'s initial
    weights: the policy's step 0 on every start and resume)."""
    from workloads.pretrain.components.dpo import Reference

    if cfg.model.lora.rank:
        return Reference(policy)
    if cfg.model.init_from:
        return Reference(policy, load_pretrained(cfg, env, frozen=True))
    torch.manual_seed(cfg.train.seed)
    return Reference(policy, init_sharded(cfg, env, frozen=True))


class Trainer:
    """One training process, torchtitan's shape: ``__init__`` sets up (devices and mesh, data, model,
    optimizer, resume, tracking), ``train_step`` runs one optimizer step, ``validate`` measures the
    held-out loss, ``after_step`` logs, validates, checkpoints, scores and answers a preemption,
    ``fit`` runs the loop. The order of work is the module docstring's."""

    def __init__(self, cfg: TrainerCfg) -> None:
        self.cfg, self.tc, self.mc = cfg, cfg.train, cfg.model
        self.env = env = init_distributed(cfg)
        preempt.begin(env.is_main, env.world_size)  # before anything that can fail: this start is the newest
        self.say = (lambda *a: print(*a, flush=True)) if env.is_main else (lambda *a: None)
        self._resolve_kernels()
        self._setup_data()
        self._setup_model()
        self._setup_tracking()
        # global: the batch is split over dp ranks; a DPO pair is two sequences
        self.tokens_per_step = self.tc.batch_size * self.tc.seq_len * (2 if self.objective else 1)
        self.log_every = max(1, int(self.tc.log_every))
        self.val_every = max(0, int(self.tc.val_every))  # 0: start/end only
        self.loss_sum = torch.zeros((), device=env.device)
        self.loss_count = 0
        self.grad_norm = torch.zeros(())
        self.first_val: float | None = None
        self.final_val: float | None = None

    def _resolve_kernels(self) -> None:
        """dtype, FP8 recipe and loss kernel: refused here (config errors), before data or model work."""
        tc, mc, env = self.tc, self.mc, self.env
        self.dtype = tc.dtype.on(env.device.type)  # auto: bf16 on CUDA, fp32 on CPU
        if env.device.type == "cuda" and tc.dtype == "auto":
            # the matmuls autocast leaves in fp32 run on TF32 tensor cores; an explicit
            # train.dtype=fp32 stays exact fp32 (the precise reference on a GPU, MFU against its peak)
            torch.backends.cuda.matmul.fp32_precision = "tf32"
        self.fp8_recipe = fp8.recipe(self.cfg)
        fp8.check_device(self.fp8_recipe, env.device)  # an FP8 GPU and torchao, before data or model work
        # model.loss_kernel=liger that cannot run: a config error here, before data or model work
        self.loss_kernel = (
            transformer.loss_kernel(mc.loss_kernel, env.device.type) if mc.kernels == "fused" else "reference"
        )

    def _setup_data(self) -> None:
        cfg, tc, env = self.cfg, self.tc, self.env
        self.corpus = corpus = prepare_corpus(cfg.data)
        if corpus.vocab_size > self.mc.vocab_size:
            raise ValueError(f"tokenizer has {corpus.vocab_size} tokens but model.vocab_size={self.mc.vocab_size}")
        self.train_seqs, self.val_seqs = corpus.sequences(
            float(cfg.data.val_fraction), tc.seq_len, bool(cfg.data.document_mask)
        )
        self.sampler = Sampler(self.train_seqs, tc.seq_len, tc.batch_size, tc.seed, env.dp_rank, env.dp_size)
        self.val_set = val_batches(
            self.val_seqs, tc.seq_len, tc.batch_size, tc.val_batches, env.dp_rank, env.dp_size, env.device
        )

    def _setup_model(self) -> None:
        cfg, tc, mc, env = self.cfg, self.tc, self.mc, self.env
        # which SDPA kernel torch picks for this model's q/k/v, asked before the model takes the memory
        micro_seqs = (tc.micro_batch_size or tc.batch_size // env.dp_size) * (2 if tc.objective == "dpo" else 1)
        seqs = self.train_seqs  # packed examples, or document_mask: a mask; pairs: causal rows, padding last
        masked = hasattr(seqs, "bins") or (not isinstance(seqs, PreferencePairs) and seqs.eos_id is not None)
        attn_dtype = torch.bfloat16 if self.dtype == "bf16" else torch.float32
        self.attention = transformer.attention_backend(
            mc, micro_seqs, tc.seq_len, attn_dtype, env.device, masked, env.dims.tp
        )
        self.flops_per_token = shape.flops_per_token(mc, tc.seq_len)
        self.n_params = shape.num_params(mc)
        if mc.init_from:  # built on meta, sharded, then each rank reads only its slices of the checkpoint
            self.model = load_pretrained(cfg, env)
        else:  # built on meta, sharded, materialised empty, then each rank initialises only its shards
            torch.manual_seed(tc.seed)
            self.model = init_sharded(cfg, env)
        self.optimizer = build_optimizer(self.model, tc)
        self.checkpointer = Checkpointer(cfg, env, self.model, self.optimizer, self.sampler)
        self.start_step = self.checkpointer.load()
        self.objective = None  # train.objective=lm: next-token cross-entropy (``step_loss``)
        if tc.objective == "dpo":
            from workloads.pretrain.components.dpo import DpoObjective

            self.objective = DpoObjective(tc.dpo, build_reference(cfg, env, self.model), env.device)
        self.step_context = loss_context(env.dims)
        self.autocast = autocast_context(self.model, cfg, env.device.type)  # none: FSDP's bf16 params are the recipe

    def _setup_tracking(self) -> None:
        cfg, mc, env = self.cfg, self.mc, self.env
        self.peak = peak_tflops(env.device, self.dtype)
        self.no_mfu = "cpu" if env.device.type == "cpu" else f"no peak for {torch.cuda.get_device_name(env.device)}"
        self.sink = MetricSink(enabled=env.is_main)
        loss_name = transformer.LOSS_KERNEL_NAMES.get(
            self.loss_kernel, "full logits + F.cross_entropy (reference kernels)"
        )
        if env.dims.tp > 1 and mc.kernels == "fused":
            loss_name = "vocab-parallel F.cross_entropy (tensor parallel)"
        elif self.objective is not None and mc.kernels == "fused":  # DPO needs each row's sum: per token
            loss_name = "per-token chunked CE (a chunk's logits at a time, recomputed in backward)"
        self.loss_name = loss_name
        # what model.loss_kernel / train.dtype=auto resolved to and which SDPA kernel torch picked:
        # the run's params, so runs compare like with like
        self.sink.log_params(
            {"trainer.loss_kernel": loss_name, "trainer.attention": self.attention, "trainer.dtype": self.dtype}
        )
        self.sink.skip_upto = preempt.on_start(env.is_main, self.start_step, env.world_size)  # no step logged twice
        if env.is_main:
            log_training_corpus(str(cfg.data.name), self.corpus.path)  # the run's Datasets: source, digest, tokens
        self.tasks = task_scores.scorer(cfg, env, self.sink, self.corpus)  # eval.tasks: lm-eval at checkpoint steps

    def describe(self) -> None:
        """The run's header lines: model, kernels, data, batch, mesh, checkpoints, resume."""
        cfg, tc, mc, env, say = self.cfg, self.tc, self.mc, self.env, self.say
        say(
            f"pretrain | model {mc.name}: {self.n_params / 1e6:.2f}M params (non-embedding), {mc.n_layers} layers, "
            f"dim {mc.dim}, {mc.n_heads}/{mc.n_kv_heads} heads, {mc.kernels.value} kernels, {self.dtype}"
            f"{f', fp8 {self.fp8_recipe}' if self.fp8_recipe != 'none' else ''}"
            f"{', compiled' if mc.compile else ''}"
        )
        if mc.lora.rank:
            from workloads.pretrain.model import lora

            say(lora.describe(self.model, mc.lora))
        say(f"pretrain | loss {self.loss_name} | attention {self.attention}")
        if self.objective is not None:
            say(self.objective.describe())
        say(
            f"pretrain | data {cfg.data.name}: {_describe(self.train_seqs, self.val_seqs)}, "
            f"vocab {self.corpus.vocab_size} ({'cached' if self.corpus.cache_hit else 'built'} {self.corpus.path}) | "
            f"{tc.batch_size} x {tc.seq_len} = {self.tokens_per_step:,} tokens/step{_accumulation(cfg, env)}"
            f" | world {env.world_size} on "
            f"{env.device.type}" + (f" ({torch.get_num_threads()} threads/proc)" if env.device.type == "cpu" else "")
        )
        cut = truncation_warning(self.train_seqs, self.val_seqs, tc.seq_len)
        if cut:
            say(cut)
        d = env.dims
        say(
            f"pretrain | mesh dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x tp {d.tp} | "
            f"ac {cfg.parallel.ac.value} | checkpoints {cfg.checkpoint.dir or 'off (checkpoint.dir unset)'}"
        )
        if self.start_step:
            say(f"pretrain | resumed from step {self.start_step} ({cfg.checkpoint.dir})")

    def validate(self, step: int) -> float:
        """The held-out loss at ``step``, logged (with its time: cost calibration) and printed."""
        t0 = time.perf_counter()
        if self.objective is None:
            metrics = {
                "val/loss": evaluate(self.model, self.val_set, self.autocast, self.env, self.tc.micro_batch_size)
            }
        else:
            env = self.env
            metrics = self.objective.evaluate(
                self.model,
                self.val_set,
                self.autocast,
                self.step_context,
                env.world_size > 1,
                env.dims.tp,
                self.tc.micro_batch_size,
            )
        loss = metrics["val/loss"]
        self.sink.log({**metrics, "time/val_s": time.perf_counter() - t0}, step)
        self.sink.flush()
        self.say(f"val step {step} | val/loss {loss:.4f}")
        return loss

    def train_step(self, step: int) -> float:
        """One optimizer step over the step's micro-batches; the loss adds up on the device (read at
        the next log). Returns the step's learning rate."""
        tc, env, model, optimizer = self.tc, self.env, self.model, self.optimizer
        lr = float(tc.lr) * lr_factor(step, tc)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = self.sampler.next_batch(env.device).split(tc.micro_batch_size)
        for i, micro in enumerate(micro_batches):
            set_gradient_sync(model, gradient_sync_due(i, len(micro_batches), self.cfg.parallel.grad_sync))
            with self.step_context():  # loss_parallel under TP; FSDP reduce-scatters grads inside backward
                with self.autocast():
                    if self.objective is None:
                        loss, share = step_loss(model, micro, env.dp_size)
                    else:
                        loss, share = self.objective.step_loss(model, micro, env.dp_size)
                loss.backward()
            self.loss_sum += share.float()
        max_norm = float(tc.grad_clip) if tc.grad_clip and tc.grad_clip > 0 else math.inf
        self.grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        fp8.after_optimizer_step(model, self.fp8_recipe, fsdp=env.dims.dp_enabled)
        optimizer.zero_grad(set_to_none=True)
        self.loss_count += 1
        return lr

    def log_interval(self, step: int, lr: float, steps: int, elapsed: float) -> None:
        """The interval's mean loss (summed over data-parallel ranks), speed and memory: logged, printed."""
        env = self.env
        train_loss = _sum_over_dp(self.loss_sum / self.loss_count, env)  # syncs the device too
        tok_s = steps * self.tokens_per_step / elapsed
        tok_s_dev = tok_s / env.world_size
        tflops = self.flops_per_token * tok_s_dev / 1e12
        gn = self.grad_norm.full_tensor() if hasattr(self.grad_norm, "full_tensor") else self.grad_norm
        m = {
            "train/loss": train_loss,
            "train/lr": lr,
            "train/grad_norm": gn.item(),
            "perf/tokens_per_s": tok_s,
            "perf/tokens_per_s_per_device": tok_s_dev,
            "perf/tflops": tflops,
            "perf/mfu": tflops / self.peak if self.peak else None,
            "perf/peak_mem_gib": peak_memory_gib(env.device),
        }
        if self.objective is not None:
            m.update(self.objective.interval_metrics(env.world_size > 1, env.dims.tp))
        self.sink.log(m, step)
        self.sink.flush()
        self.say(format_train_line(step, self.tc.steps, m, self.no_mfu))
        self.loss_sum.zero_()
        self.loss_count = 0

    def after_step(self, step: int, last: bool, agree: bool) -> float:
        """Validation, checkpoint, lm-eval scores and a preemption's stop after ``step``. Returns the
        seconds spent on validation and scoring (kept out of the throughput figures)."""
        cfg = self.cfg
        aside = 0.0
        if (self.val_every and step % self.val_every == 0) or last:
            t_val = time.perf_counter()
            self.final_val = self.validate(step)
            aside += time.perf_counter() - t_val
        self.checkpointer.maybe_save(step, last=last)
        if self.tasks is not None and self.tasks.due(step, last):  # lm-eval on the checkpoint just saved
            t_tasks = time.perf_counter()
            self.tasks.score(step, self.checkpointer)
            aside += time.perf_counter() - t_tasks
        if not last:  # SIGTERM/SIGUSR1 on any rank: every rank stops after this same step
            grace = float(cfg.checkpoint.preempt_grace_s)
            save = preempt.PREEMPTION.check(self.env.device, grace, self.checkpointer.emergency_save_s(), agree)
            if save is not None:
                raise preempt.stop(self.checkpointer, step, save)
        return aside

    def fit(self) -> dict:
        """The loop from the resumed step to ``train.steps`` (or a budget stop). Returns the val losses and speed."""
        cfg, tc, env = self.cfg, self.tc, self.env
        self.describe()
        t_start = time.perf_counter()
        guard = BudgetGuard.from_env()  # --max-cost: stop after a checkpoint before the spend passes it
        self.sink.log({"time/startup_s": time.time() - guard.billing_start}, self.start_step)
        if self.start_step == 0:
            self.first_val = self.final_val = self.validate(0)
        t_interval, steps_in_interval = time.perf_counter(), 0
        for step in range(self.start_step + 1, tc.steps + 1):
            lr = self.train_step(step)
            steps_in_interval += 1
            if step == self.start_step + 1:
                steady_timeouts(env, self.cfg.parallel.collective_timeout_s)  # loading, first step behind us
            # the ranks compare flags (budget, preemption) only on agreed steps: no sync every step
            agree = preempt.agreement_due(step, int(cfg.checkpoint.every), env.world_size)
            stop = guard.should_stop(env.device, agree)  # every rank gets the same answer
            last = step == tc.steps or stop
            if step % self.log_every == 0 or last:
                self.log_interval(step, lr, steps_in_interval, time.perf_counter() - t_interval)
                t_interval, steps_in_interval = time.perf_counter(), 0
            t_interval += self.after_step(step, last, agree)  # eval and scoring: not training's throughput
            if stop:
                guard.record_stop(step, env.is_main, checkpoint=bool(cfg.checkpoint.dir))
                break
        else:  # no budget stop: every step ran; once the final checkpoint is committed, say so (a stop
            # after this is no failure: torchrun exits 1 when signalled although every worker ends 0)
            self.checkpointer.close()
            self.sink.flush()
            preempt.record_completed(tc.steps, self.checkpointer.last_committed, env.is_main)
        self.checkpointer.close()
        self.sink.flush()
        wall = time.perf_counter() - t_start
        first_s = f"{self.first_val:.4f}" if self.first_val is not None else "n/a (resumed)"
        final_s = f"{self.final_val:.4f}" if self.final_val is not None else "n/a"
        self.say(f"final val/loss {final_s} (first {first_s}) | {tc.steps - self.start_step} steps in {wall:.1f}s")
        return {"first_val_loss": self.first_val, "final_val_loss": self.final_val, "steps": tc.steps, "wall_s": wall}


def train(cfg: TrainerCfg) -> dict:
    """Train per ``cfg``. Returns the val losses and final speed."""
    return Trainer(cfg).fit()


# ----------------------------------------------------------------------------- process


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    """Run training; map success / error / signal to an exit status and always leave the group."""
    signal.signal(signal.SIGINT, _raise_interrupted)
    preempt.PREEMPTION.install()  # SIGTERM, SIGUSR1: stop after the step, with a checkpoint
    monitor = None
    try:
        cfg = load_config(argv)
        monitor = system_metrics.start()  # one per node, labelled by node
        train(cfg)
        return 0
    except ConfigError as e:
        print(f"pretrain: config error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except preempt.Preempted as e:
        preempt.record(e, int(os.environ.get("RANK", "0")) == 0)
        return EXIT_PREEMPTED
    except Interrupted as e:
        print(f"pretrain: {e}, exiting", file=sys.stderr, flush=True)
        return 128 + e.signum
    except SystemExit as e:  # argparse --help / usage errors
        return e.code if isinstance(e.code, int) else 2
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    finally:
        system_metrics.stop(monitor)
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
