"""DPO in the trainer (``train.objective=dpo``, ``data.format=preference``): what a pair batch holds,
what is refused, the reference, and that every layout computes one process's losses.

The loss and its gradients are held to TRL's ``DPOTrainer`` in test_dpo_trl.py; here the trainer's
own plumbing around them: a batch is TRL's concatenated one (chosen rows, then the rejected rows of
the same pairs; targets on the answers only), micro-batches keep pairs whole, a prompt that leaves
no answer token in ``train.seq_len`` is refused naming its line, the full fine-tune's reference is a
frozen copy of the starting weights in the compute dtype, and FSDP over 2 ranks, TP over 2 and
micro-batches reproduce one process's losses (full fine-tune and LoRA) while the loss falls and the
held-out reward accuracy rises.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import loss_env, write_pairs

from workloads.pretrain.model.losses import IGNORE_INDEX


def _corpus(source: Path, cache_dir: Path):
    from workloads.pretrain.data import prepare_corpus
    from workloads.protocol.schema import DataCfg, DataFormat

    return prepare_corpus(
        DataCfg(
            name="pairs", source=str(source), format=DataFormat.preference, vocab_size=400, cache_dir=str(cache_dir)
        )
    )


def test_a_pair_batch_is_chosen_rows_then_rejected_rows_with_answer_targets(tmp_path: Path, cache_dir: Path) -> None:
    corpus = _corpus(write_pairs(tmp_path / "pairs.jsonl", n=16), cache_dir)
    train, val = corpus.sequences(0.25, 32)
    assert (len(train), len(val)) == (12, 4)
    batch = train.batch([3, 0, 5], 6, "cpu")
    assert batch.inputs.shape == batch.targets.shape == (6, 32) and batch.global_targets == 6
    decode = corpus.tokenizer.decode
    for i in range(3):
        chosen, rejected = batch.targets[i], batch.targets[3 + i]
        answer = [int(t) for t in chosen if t != IGNORE_INDEX]
        assert answer[-1] == corpus.eos_id and decode(answer[:-1]).startswith(" yes"), decode(answer)
        assert decode(answer[:-1]).endswith(" indeed"), decode(answer)
        assert decode([int(t) for t in rejected if t != IGNORE_INDEX]).startswith(" no")
        first = int((chosen != IGNORE_INDEX).nonzero()[0])  # the prompt's last input predicts the answer
        assert first == int((rejected != IGNORE_INDEX).nonzero()[0])
        assert torch.equal(batch.inputs[i, : first + 1], batch.inputs[3 + i, : first + 1])  # one prompt
        assert "Q:" in decode(batch.inputs[i, : first + 1].tolist())
    # micro-batches of 2 pairs: each again chosen rows then their rejected rows, pairs whole
    first_two, last = batch.split(2)
    assert torch.equal(first_two.inputs, batch.inputs[[0, 1, 3, 4]]) and first_two.pairs == 2
    assert torch.equal(last.inputs, batch.inputs[[2, 5]]) and last.global_targets == 6


def test_a_prompt_longer_than_seq_len_is_refused_naming_its_line(tmp_path: Path, cache_dir: Path) -> None:
    from workloads.pretrain.data.chat import ExampleError

    source = write_pairs(tmp_path / "pairs.jsonl", n=16, long_prompt_at=3)
    corpus = _corpus(source, cache_dir)
    with pytest.raises(ExampleError) as info:
        corpus.sequences(0.25, 32)
    message = str(info.value)
    assert message.startswith(f"{source}:3: the prompt is ") and "longer than train.seq_len=32" in message, message
    assert "(1 pair(s) like it). Fix: train.seq_len=" in message
    corpus.sequences(0.25, 256)  # long enough: every prompt fits


def test_the_full_fine_tunes_reference_is_a_frozen_copy_of_the_start_in_the_compute_dtype(
    one_process, make_tiny_cfg
) -> None:
    from workloads.pretrain.train import build_reference, init_distributed, init_sharded

    cfg = make_tiny_cfg(**{"train.objective": "dpo", "data.format": "preference", "train.dtype": "bf16"})
    env = init_distributed(cfg)
    torch.manual_seed(cfg.train.seed)
    policy = init_sharded(cfg, env)
    with torch.no_grad():  # the policy moves on; the reference is its step 0 again
        for p in policy.parameters():
            p.add_(1.0)
    reference = build_reference(cfg, env, policy)
    copy = reference.copy
    assert copy is not None and reference.kind == "frozen copy of the starting weights"
    torch.manual_seed(cfg.train.seed)
    start = dict(init_sharded(cfg, env).named_parameters())
    for name, param in copy.named_parameters():
        assert param.dtype == torch.bfloat16 and not param.requires_grad, name
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        want = start[name].full_tensor() if hasattr(start[name], "full_tensor") else start[name]
        assert torch.equal(full, want.detach().to(torch.bfloat16)), name


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_loss_falls_and_fsdp_tp_or_micro_batches_reproduce_one_process(
    lora: bool, workload, tmp_path: Path, cache_dir: Path
) -> None:
    """Every step's train and val DPO loss of FSDP on 2 ranks, TP on 2 and 2 micro-batches of 4 pairs
    equal one process's within 1e-5: a micro-batch's share is its pairs' summed loss over the global
    batch's pairs. The loss falls from log 2 and the held-out pairs' reward accuracy rises."""
    from omegaconf import OmegaConf

    source = write_pairs(tmp_path / "pairs.jsonl")
    cfg = tmp_path / "dpo.yaml"
    overrides = {
        "data.cache_dir": str(cache_dir),
        "data.source": str(source),
        "data.format": "preference",
        "data.name": "pairs",
        "data.vocab_size": 400,
        "data.val_fraction": 0.25,
        "train.objective": "dpo",
        "train.steps": 8,
        "train.batch_size": 8,
        "train.seq_len": 32,
        "train.log_every": 1,
        "train.val_every": 4,
        "train.lr": 1e-2 if lora else 2e-3,
        "train.warmup_steps": 2,
    }
    if lora:
        overrides["model.lora.rank"] = 4
    OmegaConf.save(workload.cfg(**overrides), cfg)
    layouts = {
        "one": ([], None),
        "fsdp": (["parallel.dp_shard=2"], 2),
        "tp": (["parallel.tp=2", "parallel.dp_shard=1"], 2),
        "micro": (["train.micro_batch_size=4"], None),
    }
    if lora:
        del layouts["micro"]  # the micro-batch split is the same code with or without adapters
    for name, (extra, nproc) in layouts.items():
        launcher = workload.torchrun(nproc) if nproc else None
        out = workload.run(["--config", str(cfg), *extra], loss_env(tmp_path / f"{name}.jsonl"), launcher=launcher)
        assert out.returncode == 0, (name, out.stderr[-4000:])
        reference = "the base with adapters off" if lora else "frozen copy of the starting weights"
        assert f"objective dpo: sigmoid loss, beta 0.1 | reference {reference}" in out.stdout, out.stdout
    ref = workload.loss_file(tmp_path / "one.jsonl")
    assert sorted(ref["train"]) == list(range(1, 9)) and sorted(ref["val"]) == [0, 4, 8]
    assert abs(ref["val"][0] - 0.693147) < 1e-5  # step 0: the policy is the reference, every pair log 2
    for name in layouts:
        got = workload.loss_file(tmp_path / f"{name}.jsonl")
        for kind in ("train", "val"):
            diffs = {step: abs(got[kind][step] - loss) for step, loss in ref[kind].items()}
            assert max(diffs.values()) <= 1e-5, (name, kind, diffs)
    assert ref["val"][8] < ref["val"][0] - 0.1, ref["val"]
    logs = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    val = {rec["step"]: rec for rec in logs if "val/loss" in rec}
    assert val[0]["val/rewards/accuracies"] == 0.0 and val[8]["val/rewards/accuracies"] >= 0.75, val
    assert val[8]["val/rewards/margins"] > 0
    train = [rec for rec in logs if "train/loss" in rec]
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"} <= set(train[0])
