"""The memory plan (``memory_plan``, stdlib) against torch's tracker (``tests/oracles/memory_tracker.py``),
and its contract.

Every case of ``memory_tracker.CASES`` (the list ``benchmarks/memory_plan.py`` prints) must plan within
15% of ``FSDPMemTracker`` / ``MemTracker`` over real training steps of the real model on fake tensors
(measured: within 1%), or within a case's own tighter ``tolerance`` where the case checks one
modelling choice. The tracker runs in this process on a fake process group it tears down again; a
few seconds a case, no real memory. Where torch's tracker needs real tensors (torch < 2.13: the
torch 2.11 step), the cases above the oracle's compute budget are marked slow (``slow_here``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from oracles.memory_tracker import CASES, slow_here

from workloads.planner.memory_plan import PARTS, MemoryPlan, plan_memory
from workloads.protocol.config import typed

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 0.15


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, id=case["name"].replace(" ", "-"), marks=[pytest.mark.slow] if slow_here(case) else [])
        for case in CASES
    ],
)
def test_plan_within_tolerance_of_tracker(case):
    from oracles.memory_tracker import compare

    plan, tracked, err = compare(case)
    detail = {p: (getattr(plan, p) >> 20, tracked.get(p, 0) >> 20) for p in PARTS}
    assert abs(err) <= case.get("tolerance", TOLERANCE), (
        f"{case['name']}: plan {plan.total >> 20} MiB vs tracker {tracked['total'] >> 20} MiB "
        f"({err:+.1%}); (plan, tracker) MiB by part: {detail}; plan's peak: {plan.phase}"
    )
    # the static parts are exact: the same shards, the same AdamW states
    assert plan.optimizer == tracked["optimizer"]


def test_cases_cover_the_layouts_and_modes():
    """The benchmark/test cases span world 1, FSDP, TP, FSDP+TP, every AC mode and micro-batching."""
    assert len(CASES) >= 6
    layouts = {plan_memory(typed(c["cfg"]), c["world_size"], device="cpu").layout["tp"] > 1 for c in CASES}
    assert layouts == {True, False}
    assert {c["cfg"]["parallel"].get("ac", "none") for c in CASES} == {"none", "selective", "full"}
    assert {c["world_size"] for c in CASES} >= {1, 2, 4, 8}
    micro_batched = [c for c in CASES if c["world_size"] > 1 and c["cfg"]["train"].get("micro_batch_size")]
    assert {c["cfg"]["parallel"].get("grad_sync", "auto") for c in micro_batched} >= {"step", "micro_batch"}
    assert any(c["world_size"] > 1 and c["cfg"]["parallel"].get("tp", 1) == 1 for c in CASES)  # FSDP only
    assert any(c["world_size"] > c["cfg"]["parallel"].get("tp", 1) > 1 for c in CASES)  # FSDP + TP


def test_cases_affordable_on_real_tensors_still_cover_each_mechanism():
    """Where the oracle computes for real (torch < 2.13: the torch 2.11 step), the cases under its
    budget (``slow_here``) still exercise one process and FSDP, TP, bf16 on one and on several ranks,
    LoRA, QLoRA and DPO: what moves between torch releases is the tracker's hooks on each of these."""
    from oracles.memory_tracker import over_real_tensor_budget

    kept = [c for c in CASES if not c["slow"] and not over_real_tensor_budget(c)]
    assert len(kept) < len([c for c in CASES if not c["slow"]])  # the budget does leave some out
    bf16 = [c for c in kept if c["cfg"]["train"].get("dtype") == "bf16"]
    assert {c["world_size"] > 1 for c in bf16} == {True, False}
    assert any(c["cfg"]["parallel"].get("tp", 1) > 1 for c in kept)
    assert any(c["world_size"] > 1 and c["cfg"]["parallel"].get("tp", 1) == 1 for c in kept)
    assert any(c["cfg"]["model"].get("lora", {}).get("quantize_base") for c in kept)
    assert any(c["cfg"]["model"].get("lora") and not c["cfg"]["model"]["lora"].get("quantize_base") for c in kept)
    assert {c["world_size"] > 1 for c in kept if c["cfg"]["train"].get("objective") == "dpo"} == {True, False}


def test_plan_module_imports_no_torch():
    """llmctl imports the plan in its fast CLI: no torch, no numpy, not even indirectly."""
    code = (
        "import sys, workloads.planner.memory_plan as m; "
        "from workloads.protocol.config import typed; "
        "m.plan_memory(typed({'model': {'dim': 256}, 'train': {'batch_size': 8}, 'parallel': {}}), 8).describe(); "
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'numpy', 'omegaconf')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_config_forms_agree():
    """Nested dicts, an OmegaConf config and what ``config.load`` makes are one ``TrainerCfg`` to
    ``typed`` (defaults fill gaps), so they plan the same."""
    from omegaconf import OmegaConf

    from workloads.protocol.schema import TrainerCfg

    cfg = CASES[-1]["cfg"]
    structured = OmegaConf.merge(OmegaConf.structured(TrainerCfg), cfg)
    as_object = OmegaConf.to_object(structured)
    forms = [typed(c) for c in (cfg, structured, as_object)]
    assert forms[0] == forms[1] == forms[2] and isinstance(forms[0], TrainerCfg)
    assert typed(as_object) is as_object
    plans = [plan_memory(c, 2) for c in forms]
    assert plans[0] == plans[1] == plans[2]


def test_parameter_shards_match_the_model_count():
    """World 1: fp32 parameters are 4 bytes x shape.num_params (+ the RoPE tables); FSDP over 8
    ranks keeps an eighth (rounded up per parameter), AdamW twice that."""
    from workloads.protocol.schema import ModelCfg
    from workloads.protocol.shape import num_params

    model = {"dim": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2, "vocab_size": 8000, "max_seq_len": 1024}
    cfg = {"model": model, "train": {"batch_size": 8, "seq_len": 256}, "parallel": {}}
    n = num_params(ModelCfg(**model), exclude_embedding=False)
    rope = 4 * 1024 * 64
    one = plan_memory(typed(cfg), 1)
    assert one.params == 4 * n + rope
    assert one.optimizer == pytest.approx(8 * n, rel=1e-3)  # + a scalar step count per tensor
    eight = plan_memory(typed(cfg), 8)
    assert eight.params - rope == pytest.approx((one.params - rope) / 8, rel=1e-3)


def test_plan_moves_the_right_way():
    """More checkpointing, smaller micro-batches, more TP or FSDP ranks: never more memory."""
    base = {
        "model": {"dim": 1024, "n_layers": 8, "n_heads": 16, "n_kv_heads": 4, "vocab_size": 32000, "max_seq_len": 4096},
        "train": {"batch_size": 16, "seq_len": 2048, "dtype": "bf16"},
        "parallel": {},
    }

    def plan(world=8, **over):
        cfg = {k: dict(v) for k, v in base.items()}
        for key, value in over.items():
            section, name = key.split("__")
            cfg[section][name] = value
        return plan_memory(typed(cfg), world)

    def total(world=8, **over):
        return plan(world, **over).total

    assert total(parallel__ac="none") > total(parallel__ac="selective") > total(parallel__ac="full")
    assert total(world=1) > total(world=1, train__micro_batch_size=4) > total(world=1, train__micro_batch_size=1)
    assert total(world=8) > total(world=16, train__batch_size=32)  # same per-rank batch, half the shards
    # tp 2 at the same data parallelism: half the blocks' activations (but the vocab-parallel loss
    # keeps [tokens, vocab/2] fp32 log-probs where the fused loss keeps one chunk)
    fsdp, fsdp_tp = plan(world=8), plan(world=16, parallel__tp=2)
    assert fsdp_tp.activations < fsdp.activations and fsdp_tp.logits > fsdp.logits
    # FSDP with micro-batches keeps every gradient gathered (fp32) until the last one reduces them ...
    assert plan(train__micro_batch_size=1).unsharded > plan().unsharded
    # ... unless it reduces after each (parallel.grad_sync=micro_batch): sharded gradients, less memory
    each = plan(train__micro_batch_size=1, parallel__grad_sync="micro_batch")
    once = plan(train__micro_batch_size=1, parallel__grad_sync="step")
    assert each.unsharded < once.unsharded and each.grads > once.grads == 0 and each.total < once.total
    assert plan(train__micro_batch_size=1, parallel__grad_sync="auto").total == once.total  # unresolved: once
    assert plan(parallel__grad_sync="micro_batch").total == plan().total  # one micro-batch: nothing to choose


def test_describe_is_a_short_table():
    plan = plan_memory(
        typed(
            {
                "model": {
                    "dim": 4096,
                    "n_layers": 32,
                    "n_heads": 32,
                    "n_kv_heads": 8,
                    "vocab_size": 128256,
                    "hidden_dim": 14336,
                    "max_seq_len": 8192,
                },
                "train": {"batch_size": 64, "seq_len": 8192, "dtype": "bf16", "micro_batch_size": 1},
                "parallel": {"ac": "full"},
            }
        ),
        64,
    )
    assert isinstance(plan, MemoryPlan)
    text = plan.describe()
    assert "total" in text and "GiB" in text and plan.phase in text
    assert len(text.splitlines()) <= 14
    # Llama 3.1 8B over 64 GPUs, full AC, 1 x 8k tokens per GPU: a few GiB of shards, the rest the step's
    assert 4 * 2**30 < plan.total < 40 * 2**30
