"""The memory plan's oracle: torch's own memory tracker over real training steps, on fake tensors.

``tracked_peak(cfg, world_size)`` builds the workload's model with the workload's own code
(``Transformer`` on ``meta`` -> ``parallelize``: TP -> AC -> FSDP2, as ``train.py`` does), joins a
*fake* process group of ``world_size`` ranks (collectives are no-ops; this process plays rank 0),
materialises the parameters as ``FakeTensor``s (no memory, no FLOPs) and runs two optimizer steps
the way ``train.train`` runs them (``train.step_loss``, micro-batches with gradient sync on the last
one only, ``loss_parallel`` under TP, the trainer's autocast (none: FSDP's bf16 parameters, on a
1-rank mesh for one process), grad clipping, the trainer's own ``optim.build_optimizer``,
``zero_grad``) under ``torch.distributed._tools``' tracker:
``FSDPMemTracker`` when the model is FSDP-sharded (with its hooks kept grouped for a unit of
several modules, ``_grouped_mem_tracker``), else ``MemTracker``. The second step counts (AdamW's
states exist by then): its peak, in bytes per category.

Recipe and its pitfalls: TP and ``fully_shard`` run on ``meta`` *outside* fake
mode; ``to_empty``, the optimizer and the steps inside ``FakeTensorMode(allow_non_fake_inputs=True)``.
And one fix of ours (``_private_propagation_fake_mode``): DTensor's sharding propagation must not
run in *our* fake mode, or the tracker counts global-shape tensors that never exist. With it,
fake and real tensors give byte-identical peaks (``fake=False`` runs the same step on real tensors;
checked on TP, FSDP, FSDP+TP, micro-batches, AC, bf16) and AdamW fused / foreach / single-tensor
all count correctly (an apparent foreach inflation was this effect).

What neither this nor the plan counts: the CUDA context, cuBLAS/NCCL workspaces and the caching
allocator's rounding and fragmentation (the plan's RESERVE stands in for them on a GPU).

DPO (``train.objective=dpo``) runs the trainer's own DPO step (``components.dpo.DpoObjective``: the
reference's no-grad forward, then the policy's over the pair micro-batch's chosen and rejected rows)
with the trainer's reference (``train.build_reference``'s: the policy with its adapters off under
LoRA, else a frozen copy built by ``parallelize(frozen=True)``, its FSDP units instrumented like
the policy's). The copy's shards and buffers, which the tracker counts as parameters, are reported
as the ``reference`` part, as the plan reports them.

``CASES`` is the shared list of configurations the benchmark (``benchmarks/memory_plan.py``) and
the test (``tests/trainer/test_memory_plan.py``) hold the plan against; ``compare`` does one.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from typing import Any, Callable

import torch

from workloads.pretrain.parallel.fake_world import fake_process_group

# The trackers' categories folded into the plan's parts (``memory_plan.PARTS``), so the benchmark
# can print them side by side. The tracker has no "logits" part: the loss's buffers are
# "Activation" in the forward and "Temp" in the backward. BUFFER (RoPE tables) goes with the
# parameters, the token ids (INP / OTH) with the activations, as in the plan.
_PARTS = {
    "Sharded Param": "params",
    "Parameter": "params",
    "Buffer": "params",
    "Sharded Grad": "grads",
    "Gradient": "grads",
    "OptState": "optimizer",
    "Optstate": "optimizer",
    "Unsharded Param": "unsharded",
    "Unsharded Grad": "unsharded",
    "Activation": "activations",
    "Inputs": "activations",
    "Other": "activations",
    "Temp": "temporaries",
    "All Gather": "comm",
    "Reduce Scatter": "comm",
}
TRACKER_PARTS = ("params", "reference", "grads", "optimizer", "unsharded", "activations", "temporaries", "comm")


def trainer_cfg(cfg: Any):
    """The trainer's typed config (``contract.config.typed``, the plan's converter too):
    ``schema.TrainerCfg``'s defaults under ``cfg`` (a nested dict, an OmegaConf config or a
    ``TrainerCfg``); a launcher's sections (``infra``, ``tracking``) are dropped. What
    ``Transformer`` and ``parallelize`` read."""
    from workloads.protocol.config import typed

    return typed(cfg)


@contextmanager
def _private_propagation_fake_mode():
    """Keep DTensor's sharding propagation out of the tracker's books.

    To learn an op's output shape, DTensor runs the op on *global*-shape fake tensors
    (``ShardingPropagator._propagate_tensor_meta_non_cached``) in ``detect_fake_mode() or
    FakeTensorMode()``. In a real run that is a private fake mode, which the tracker recognises
    and skips. Under our ``FakeTensorMode`` it is *our* mode, so the tracker counts every DTensor
    op's global-shape arguments and output as allocations (and with fake mode on, DTensor also
    skips its propagation cache, so this happens on every op of every step): a TP step then peaks
    at an unsharded [tokens, vocab] log-softmax that never exists (+2 x 250 MiB on a 32k vocab at
    tp 2), and an FSDP optimizer step counts global-shape copies of each parameter. Propagating in
    a fresh fake mode, as a real run does, removes exactly those tensors (fake == real afterwards).
    """
    from torch.distributed.tensor import _sharding_prop

    saved = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = saved


def _train_step(
    model, optimizer, micro_batches, dims, autocast, grad_clip: float, grad_sync: Any, tracker, objective=None
) -> None:
    """One optimizer step as ``train.Trainer.train_step`` runs it (same helpers, same order);
    ``objective``: DPO's (``components.dpo.DpoObjective``), else the LM's ``step_loss``."""
    from workloads.pretrain.parallel.parallelize import gradient_sync_due, loss_context, set_gradient_sync
    from workloads.pretrain.train import step_loss

    if objective is not None:
        step_loss = objective.step_loss
    for i, micro in enumerate(micro_batches):
        tracker.reset_mod_stats()  # module stats only: each forward is an "iteration" to the tracker
        set_gradient_sync(model, gradient_sync_due(i, len(micro_batches), grad_sync))
        with loss_context(dims)():
            with autocast():
                loss, _ = step_loss(model, micro, dims.dp)
            loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _grouped_mem_tracker(*also):
    """``FSDPMemTracker`` that keeps a grouped unit's forward hooks grouped (``apply_fsdp``'s
    ``fully_shard([norm, output])``).

    torch's tracker (2.11-2.13) swaps each FSDP state's forward hooks for one pair per module, so a
    group runs its post-forward after each module and its post-backward after each module's
    backward: under the tracker, [norm, head] reshards after the head's backward, is gathered again
    for the norm's and reduce-scatters twice, which a run without the tracker never does (one
    post-backward, after the norm's). Here single-module units are instrumented as torch does it; a
    group gets torch's group hooks (``_register_group_forward_hooks``) around the tracker's
    wrappers, its backward methods wrapped once, and its group hooks back on exit. ``also``: more
    FSDP models instrumented the same way (DPO's reference copy).
    """
    import inspect

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType, _SavedFSDPMethods
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks

    def group_hooks(state, pre: Callable, post: Callable):
        extra = {}  # torch 2.13 also casts the outputs of a group's other modules
        if "cast_output_dtype" in inspect.signature(_register_group_forward_hooks).parameters:
            extra["cast_output_dtype"] = state._cast_output_dtype
        return _register_group_forward_hooks(state._modules, pre, post, state._modules_to_run_forward, **extra)

    def remove_hooks(state) -> None:
        state._pre_forward_hook_handle.remove()
        if state._post_forward_hook_handle is not state._pre_forward_hook_handle:
            state._post_forward_hook_handle.remove()

    class GroupedFSDPMemTracker(FSDPMemTracker):
        def _instrument_fsdp_module(self) -> None:
            states = []
            for module in (m for root in (self._root_mod, *also) for m in root.modules()):
                state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
                if state is not None and state._fsdp_param_group and state not in states:
                    states.append(state)
            for state in states:
                group, modules = state._fsdp_param_group, tuple(state._modules)
                remove_hooks(state)
                self._instrument_fsdp_sharded_params_grads(group)
                # the tracker's wrappers, its statistics under the unit's first module (torch 2.11's
                # group hooks run the pre-forward on the first module only, 2.13's on each)
                pre = self._fsdp_state_pre_forward(modules[0], state._pre_forward)
                post = self._fsdp_state_post_forward(modules[0], state._post_forward)
                if len(modules) == 1:
                    state._pre_forward_hook_handle = modules[0].register_forward_pre_hook(
                        pre, prepend=True, with_kwargs=True
                    )
                    state._post_forward_hook_handle = modules[0].register_forward_hook(
                        post, prepend=False, always_call=True
                    )
                else:
                    handle = group_hooks(state, pre, post)
                    state._pre_forward_hook_handle = state._post_forward_hook_handle = handle
                self._fsdp_mod_to_saved_methods[modules[0]] = _SavedFSDPMethods(group.pre_backward, group.post_backward)
                group.pre_backward = self._fsdp_param_group_pre_backward(modules[0], group.pre_backward)
                group.post_backward = self._fsdp_param_group_post_backward(modules[0], group.post_backward)
            for buffer in (b for root in (self._root_mod, *also) for b in root.buffers()):
                self._update_and_maybe_create_winfos(buffer, _FSDPRefType.BUFFER)

        def _deregister_module_and_optimizer_hooks(self) -> None:
            for module, saved in self._fsdp_mod_to_saved_methods.items():
                state = module._get_fsdp_state()
                remove_hooks(state)
                if len(state._modules) == 1:  # as ``FSDPState.init`` registers them
                    state._pre_forward_hook_handle = module.register_forward_pre_hook(
                        state._pre_forward, prepend=True, with_kwargs=True
                    )
                    state._post_forward_hook_handle = module.register_forward_hook(state._post_forward, prepend=False)
                else:
                    handle = group_hooks(state, state._pre_forward, state._post_forward)
                    state._pre_forward_hook_handle = state._post_forward_hook_handle = handle
                state._fsdp_param_group.pre_backward = saved.pre_backward
                state._fsdp_param_group.post_backward = saved.post_backward
            self._fsdp_mod_to_saved_methods.clear()
            super()._deregister_module_and_optimizer_hooks()  # the optimizer's hooks

    return GroupedFSDPMemTracker


def fake_tensors_tracked() -> bool:
    """Whether this torch's ``FSDPMemTracker`` reads FSDP2 training on fake tensors right: torch 2.11's
    does not (it counts the sharded AdamW state many times over and misses the unsharded parameters
    and the activations), while on real tensors it agrees with torch 2.13's fake-tensor reading part
    by part; so on torch < 2.13 the oracle runs on real tensors (slower, same numbers)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 13)


# Where the oracle must compute for real (torch < 2.13, ``fake_tensors_tracked``), what one case may
# cost: the FLOPs of its steps on rank 0, bf16 counted ``BF16_EMULATED`` times over (CPUs without
# AVX512-BF16 emulate bf16 matmuls; measured on CI's machine: docs/benchmarks.md, ``ci_run``). A case
# above it is marked slow there (the torch 2.11 step runs ``-m "not slow"``); small bf16 cases keep
# that step's bf16 coverage. On fake tensors every case computes nothing and runs.
REAL_TENSOR_FLOPS = 1.4e12
BF16_EMULATED = 20


def real_tensor_flops(case: dict[str, Any], steps: int = 2) -> float:
    """FLOPs ``tracked_peak`` computes on real tensors for ``case`` (rank 0's share of ``steps``
    training steps, DPO's reference forward included), bf16 weighted by ``BF16_EMULATED``."""
    from workloads.pretrain.parallel.parallelize import ParallelDims
    from workloads.protocol.shape import flops_per_token, reference_flops_per_token, sequences_per_step

    cfg = trainer_cfg(case["cfg"])
    dims = ParallelDims.from_config(cfg, case["world_size"])
    seq = int(cfg.train.seq_len)
    per_token = flops_per_token(cfg.model, seq)
    if cfg.train.objective == "dpo":
        per_token += reference_flops_per_token(cfg.model, seq)
    tokens = sequences_per_step(cfg.train) // dims.dp * seq
    weight = BF16_EMULATED if cfg.train.dtype.on("cpu") == "bf16" else 1
    return steps * tokens * per_token / dims.tp * weight


def over_real_tensor_budget(case: dict[str, Any]) -> bool:
    """Whether ``case`` costs more than ``REAL_TENSOR_FLOPS`` where the oracle computes for real."""
    return real_tensor_flops(case) > REAL_TENSOR_FLOPS


def slow_here(case: dict[str, Any]) -> bool:
    """Whether the test marks ``case`` slow under this torch: its own ``slow``, or, where the oracle
    computes on real tensors, over the budget (``over_real_tensor_budget``)."""
    return case.get("slow", False) or (not fake_tensors_tracked() and over_real_tensor_budget(case))


def tracked_peak(
    cfg: Any,
    world_size: int,
    device: str = "cpu",
    steps: int = 2,
    fake: bool | None = None,
    before_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Peak bytes on one device (rank 0) during the last of ``steps`` training steps of ``cfg`` at
    ``world_size`` processes, by torch's tracker.

    Returns ``{part: bytes}`` over ``TRACKER_PARTS`` (the plan's parts, less ``logits``), ``total``,
    and the tracker's own categories under ``raw``. ``device``: the device type the fake tensors
    claim; "cpu" works anywhere ("cuda" needs a GPU present). ``fake=False`` runs the same steps
    on real tensors (small configurations only: it allocates and computes for real).
    ``fake=None``: fake tensors where torch's tracker reads them right (``fake_tensors_tracked``).
    ``before_step(i)`` runs before step ``i`` (0-based): ``benchmarks/memory_plan_cuda.py`` resets
    the CUDA allocator's peak there, so its peak covers the same step as the tracker's.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from workloads.pretrain.components.optim import build_optimizer
    from workloads.pretrain.data.preference import PairBatch
    from workloads.pretrain.data.sampler import Batch
    from workloads.pretrain.model.transformer import Transformer
    from workloads.pretrain.parallel.parallelize import ParallelDims, autocast_context, parallelize

    if fake is None:
        fake = fake_tensors_tracked()
    cfg = trainer_cfg(cfg)
    tc = cfg.train
    dims = ParallelDims.from_config(cfg, world_size)
    local_batch, seq, vocab = int(tc.batch_size) // dims.dp, int(tc.seq_len), int(cfg.model.vocab_size)
    dpo = tc.objective == "dpo"
    rows = 2 * local_batch if dpo else local_batch  # a pair is two rows: chosen, rejected
    with fake_process_group(world_size):
        mesh = dims.build_mesh(device)  # 1-rank for one process, as the trainer builds it
        with torch.device("meta"):
            model = Transformer(cfg.model)
        model = parallelize(model, dims, mesh, cfg)  # on meta, outside fake mode: see the recipe above
        ref_copy = None
        if dpo and not cfg.model.lora.rank:  # the frozen reference copy, as ``train.build_reference`` makes it
            with torch.device("meta"):
                ref_copy = Transformer(cfg.model)
            ref_copy = parallelize(ref_copy, dims, mesh, cfg, frozen=True)
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext(), _private_propagation_fake_mode():
            for m in (model, ref_copy) if ref_copy is not None else (model,):
                m.to_empty(device=device)
                if fake:
                    m.tie_weights()
                    _fill_nf4(m)
                else:
                    m.init_weights(buffer_device=torch.device(device), seed=0)
            optimizer = build_optimizer(model, tc)
            reference = _reference_bytes(ref_copy)  # now, while every unit of the copy is sharded
            inputs = torch.randint(0, vocab, (rows, seq), device=device)
            targets = torch.randint(0, vocab, (rows, seq), device=device)
            packed = {}
            if cfg.data.format == "sft" or cfg.data.document_mask:  # block mask
                packed = {"positions": torch.zeros_like(inputs), "doc_ids": torch.zeros_like(inputs)}
            autocast = autocast_context(model, cfg, device)  # the trainer's: none under FSDP
            objective = None
            if dpo:
                from workloads.pretrain.components.dpo import DpoObjective, Reference

                objective = DpoObjective(tc.dpo, Reference(model, ref_copy), torch.device(device))
                batch = PairBatch(inputs, targets, int(tc.batch_size), pairs=local_batch)
            else:
                batch = Batch(inputs, targets, int(tc.batch_size) * seq, **packed)
            micro_batches = batch.split(tc.micro_batch_size)
            if isinstance(model, FSDPModule):
                tracker = _grouped_mem_tracker(*([ref_copy] if ref_copy is not None else []))(model, optimizer)
                tracker.track_inputs((inputs, targets))
            else:
                tracker = MemTracker()
                tracker.track_external(model, optimizer, inputs, targets, ref_copy)
            for i in range(steps):
                if before_step is not None:
                    before_step(i)
                with tracker:  # entering resets the peak to the current use: the peak of this step
                    _train_step(
                        model,
                        optimizer,
                        micro_batches,
                        dims,
                        autocast,
                        float(tc.grad_clip or 0),
                        cfg.parallel.grad_sync,
                        tracker,
                        objective,
                    )
            return _by_part(tracker.get_tracker_snapshot("peak"), reference)


def _fill_nf4(model) -> None:
    """QLoRA's NF4 weights on fake tensors: ``to_empty`` moves NF4's packed codes and scales but not
    its code table and scale mean, which stay on meta; quantizing a (fake) weight into each, as
    ``init_weights`` does with real values, gives them the device."""
    from workloads.pretrain.model import nf4

    for _, linear in nf4.linears(model):
        nf4.fill(linear, torch.empty(linear.weight.shape, device=nf4.device(linear)))


def _reference_bytes(copy) -> int:
    """Bytes of DPO's reference copy on this rank, before it first runs (FSDP registers a unit's
    gathered parameters while it is gathered): its parameters' local shards and its buffers, each
    storage once (a tied embedding is one). None: no copy, 0."""
    if copy is None:
        return 0
    from torch.distributed.tensor import DTensor

    storages = {}
    for t in (*copy.parameters(), *copy.buffers()):
        st = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        storages[st._cdata] = st.nbytes()
    return sum(storages.values())


def _by_part(snapshot: dict, reference: int = 0) -> dict[str, Any]:
    """The tracker's peak snapshot ({device: {category: bytes, "Total": bytes}}) by plan part;
    ``reference`` bytes (DPO's frozen copy: shards and buffers, counted as parameters) moved from
    the parameters to their own part."""
    (dev_snap,) = snapshot.values()
    raw = {k.value: int(v) for k, v in dev_snap.items() if k != "Total"}  # the tracker's str enums
    parts = dict.fromkeys(TRACKER_PARTS, 0)
    for name, nbytes in raw.items():
        parts[_PARTS.get(name, "temporaries")] += nbytes
    parts["params"] -= reference
    parts["reference"] += reference
    return {**parts, "total": int(dev_snap["Total"]), "raw": raw}


# ----------------------------------------------------------------------------- the cases


def _case(
    name: str,
    world_size: int,
    model: dict,
    train: dict,
    parallel: dict | None = None,
    data: dict | None = None,
    slow: bool = False,
    tolerance: float | None = None,
) -> dict[str, Any]:
    """A case: a trainer config (``max_seq_len`` 4096 unless given) at ``world_size`` processes.
    ``slow``: the test marks it ``pytest.mark.slow`` (10-25 s on a busy 2-core machine).
    ``tolerance``: the test's bound on the plan's relative error, where tighter than its default
    (a case that checks one modelling choice whose error would stay within the default)."""
    cfg = {"model": {"max_seq_len": 4096, **model}, "train": train, "parallel": parallel or {}}
    if data:
        cfg["data"] = data
    case = {"name": name, "world_size": world_size, "cfg": cfg, "slow": slow}
    return {**case, "tolerance": tolerance} if tolerance is not None else case


_D512 = {"dim": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 8192}
_D768 = {"dim": 768, "n_layers": 4, "n_heads": 12, "n_kv_heads": 4, "vocab_size": 16384}
_D1024 = {"dim": 1024, "n_layers": 4, "n_heads": 16, "n_kv_heads": 4, "vocab_size": 32000}
_PAIRS = {"format": "preference", "source": "pairs.jsonl"}  # train.objective=dpo's data

# Shapes, layouts, AC modes and micro-batching the trainer supports, each a few seconds on fake
# tensors (world-1 runs are the slowest: MemTracker follows every module). The names say what varies.
CASES = [
    _case("w1 d512 none fp32", 1, _D512, {"batch_size": 4, "seq_len": 1024}),
    _case(
        "w1 d512 sft selective bf16",
        1,
        {**_D512, "n_layers": 3},
        {"batch_size": 4, "seq_len": 1024, "dtype": "bf16"},
        {"ac": "selective"},
        {"format": "sft", "source": "examples.jsonl"},
    ),
    _case(
        "fsdp8 d1024 selective bf16",
        8,
        _D1024,
        {"batch_size": 8, "seq_len": 2048, "dtype": "bf16"},
        {"ac": "selective"},
    ),
    _case(
        "fsdp4 d1024 full mb1x2",
        4,
        _D1024,
        {"batch_size": 8, "seq_len": 2048, "micro_batch_size": 1},
        {"ac": "full", "grad_sync": "step"},
        slow=True,
    ),
    # bf16 small enough to run where the oracle computes on real tensors (``slow_here``): FSDP's
    # bf16 gathers on two ranks, and autocast-free bf16 on one (the trainer's recipe both ways)
    _case(
        "fsdp2 d256 selective bf16",
        2,
        {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 8192},
        {"batch_size": 4, "seq_len": 512, "dtype": "bf16"},
        {"ac": "selective"},
    ),
    _case(
        "w1 d256 sft none bf16",
        1,
        {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 8192},
        {"batch_size": 2, "seq_len": 512, "dtype": "bf16"},
        data={"format": "sft", "source": "examples.jsonl"},
    ),
    _case(
        "fsdp4 d768 none mb1x4 sync each",
        4,
        _D768,
        {"batch_size": 16, "seq_len": 512, "micro_batch_size": 1},
        {"grad_sync": "micro_batch"},
    ),
    _case("tp4 d1024 full fp32", 4, _D1024, {"batch_size": 4, "seq_len": 1024}, {"ac": "full", "tp": 4}, slow=True),
    _case(
        "dp2xtp2 d768 none bf16 mb2x2",
        4,
        _D768,
        {"batch_size": 8, "seq_len": 1024, "dtype": "bf16", "micro_batch_size": 2},
        {"tp": 2},
    ),
    _case(
        "hsdp2x2xtp2 d1024 selective",
        8,
        _D1024,
        {"batch_size": 8, "seq_len": 1024},
        {"ac": "selective", "tp": 2, "dp_replicate": 2},
    ),
    _case(
        "fsdp2 d512 document mask none",
        2,
        _D512,
        {"batch_size": 4, "seq_len": 1024},
        {"ac": "none"},
        {"document_mask": True},
    ),
    # The embedding and [norm, head] as FSDP units of their own (``apply_fsdp``), at a vocabulary
    # larger than the blocks: one root unit kept both gathered all step; here the embedding is not
    # gathered at the loss, the peak. Replicas with one shard each (dp_shard 1), where no all-gather
    # buffer stands in for the embedding as [norm, head]'s does with dp_shard > 1; one chunk of the
    # fused loss. Held tighter than the rest: planned as one root unit, it falls outside.
    _case(
        "hsdp2x1 d256 v32k untied",
        2,
        {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 32000},
        {"batch_size": 2, "seq_len": 256},
        {"dp_replicate": 2},
        tolerance=0.03,
    ),
    _case(
        "fsdp2 d768 qwen2 tied none",
        2,
        {**_D768, "arch": "qwen2", "tie_embeddings": True, "n_kv_heads": 2},
        {"batch_size": 4, "seq_len": 1024},
    ),
    # LoRA (frozen base, adapters train) under FSDP, and QLoRA (NF4 base, a buffer in one process:
    # the 24 GB-card case); hidden_dim 1536 so every target splits into whole NF4 scale groups.
    # Held tighter: frozen norms save no normalised input, and the first block's attention norm
    # nothing (its input needs no gradient); planned as a full fine-tune's, they fall outside
    _case(
        "fsdp2 d512 lora r16 none",
        2,
        {**_D512, "lora": {"rank": 16}},
        {"batch_size": 4, "seq_len": 1024},
        tolerance=0.03,
    ),
    _case(
        "w1 d512 qlora r16 none",
        1,
        {**_D512, "hidden_dim": 1536, "lora": {"rank": 16, "quantize_base": "nf4"}},
        {"batch_size": 2, "seq_len": 1024},
        tolerance=0.03,
    ),
    # bf16 compute: the frozen base held in bf16 (``lora.hold_frozen_in``), sharded over two ranks and
    # on one (where FSDP copies the unit out of its only shard), the adapters' masters in fp32
    _case(
        "fsdp2 d512 lora r16 none bf16",
        2,
        {**_D512, "lora": {"rank": 16}},
        {"batch_size": 4, "seq_len": 1024, "dtype": "bf16"},
        tolerance=0.03,
    ),
    _case(
        "w1 d512 lora r16 selective bf16",
        1,
        {**_D512, "lora": {"rank": 16, "dropout": 0.05}},
        {"batch_size": 2, "seq_len": 1024, "dtype": "bf16"},
        {"ac": "selective"},
        tolerance=0.03,
    ),
    # QLoRA under TP: colwise targets keep their NF4 rows, wo and w2 the whole NF4 weight per rank
    _case(
        "tp2 d512 qlora r16 none",
        2,
        {**_D512, "hidden_dim": 1536, "lora": {"rank": 16, "quantize_base": "nf4"}},
        {"batch_size": 2, "seq_len": 1024},
        {"tp": 2},
        tolerance=0.03,
    ),
    # DPO (train.objective=dpo, the trainer's DpoObjective step): pairs of rows, the reference's
    # forward first. Without LoRA a frozen copy held in the compute dtype (fp32 on one process, bf16
    # sharded over two with micro-batches, and TP's vocab-parallel loss); with LoRA the base with the
    # adapters off. Held tighter: the copy is 5-8% of each peak, the second row of each pair far more
    _case(
        "w1 d512 dpo none fp32",
        1,
        _D512,
        {"batch_size": 2, "seq_len": 1024, "objective": "dpo"},
        data=_PAIRS,
        tolerance=0.03,
    ),
    _case(
        "fsdp2 d512 dpo selective bf16 mb1x2",
        2,
        _D512,
        {"batch_size": 4, "seq_len": 1024, "objective": "dpo", "dtype": "bf16", "micro_batch_size": 1},
        {"ac": "selective"},
        _PAIRS,
        tolerance=0.03,
    ),
    _case(
        "tp2 d512 dpo none",
        2,
        _D512,
        {"batch_size": 2, "seq_len": 512, "objective": "dpo"},
        {"tp": 2},
        _PAIRS,
        tolerance=0.03,
    ),
    _case(
        "fsdp2 d512 lora r16 dpo bf16",
        2,
        {**_D512, "lora": {"rank": 16}},
        {"batch_size": 4, "seq_len": 1024, "objective": "dpo", "dtype": "bf16"},
        data=_PAIRS,
        tolerance=0.03,
    ),
    # ... where the reference's forward is the peak: under LoRA it all-gathers [norm, head] for the
    # policy, and at a 152k vocabulary over two 512-wide layers that buffer outweighs the activations
    _case(
        "fsdp8 d512 L2 v152k lora r16 dpo reference peak",
        8,
        {**_D512, "n_layers": 2, "vocab_size": 152064, "lora": {"rank": 16}},
        {"batch_size": 8, "seq_len": 256, "objective": "dpo"},
        data=_PAIRS,
        tolerance=0.03,
    ),
]


def compare(case: dict[str, Any]) -> tuple[Any, dict[str, Any], float]:
    """(plan, tracker's peak, relative error of the plan's total) for one of ``CASES``, on CPU."""
    from workloads.planner.memory_plan import plan_memory

    plan = plan_memory(trainer_cfg(case["cfg"]), case["world_size"], device="cpu")
    tracked = tracked_peak(case["cfg"], case["world_size"], device="cpu")
    return plan, tracked, plan.total / tracked["total"] - 1.0
