"""DPO (``train.objective=dpo``): TRL's ``DPOTrainer`` is the oracle for llmctl's loss.

Two tiny Llama checkpoints of test_hf_init's shape are saved: the reference and the policy (the
reference's weights plus noise, so the log-ratios are far from 0 and the loss is not log 2). TRL
builds its trainer on transformers' models of them (``DPOConfig``: ``loss_type``, ``beta``,
``label_smoothing``), tokenizes three prompt/chosen/rejected records with its own pipeline and
collates them (chosen rows first); llmctl's trainer code loads the same checkpoints
(``model.init_from``) and reads the same token ids: its targets are the next tokens where TRL's
``completion_mask`` is 1. Then, in fp32, ``pair_losses(...).mean()`` from ``sequence_logps`` of
the policy and of the reference (full fine-tuning: a second, frozen copy) equals TRL's own
``compute_loss`` to 1e-5 and every parameter's gradient to rtol 1e-4 / atol 1e-6, as test_lora
compares with PEFT (the sums run in another order, nothing else differs); the rewards, margins,
accuracies and mean log-probabilities TRL logs are llmctl's, for ``sigmoid``, ``ipo`` and
``robust``. LoRA: llmctl's reference is the base with the adapters off (``adapters_off``), TRL's
the PEFT model it wraps from ``peft_config`` with its adapter disabled; the adapters hold
llmctl's values (every B nonzero) and their gradients agree.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lora_worker import set_b
from test_hf_init import COMMON, _hf_tokenizer, _save
from test_lora import ALL, GRAD_ATOL, GRAD_RTOL, LOSS_TOL, PEFT_NAMES, _full, _load, _peft_name

# (prompt, chosen, rejected): answers of unequal lengths, so rows pad and IPO's per-token
# averages differ between the chosen and rejected answer of a pair
RECORDS = [
    ("The module", " defines names.", " is a file"),
    ("Import a", " module by name", " cat"),
    ("A class is", " a type", " never used in the code at all"),
]
NOISE = 0.05  # the policy: the reference's weights + N(0, NOISE)
LORA_B = 0.5  # set_b's scale: the adapters move the log-probabilities by nats, not hundredths
METRIC_TOL = 1e-5  # TRL's logged means (rewards: beta x log-ratios; log-probabilities of ~-40)
# loss, beta, label_smoothing
LOSSES = {
    "sigmoid": ("sigmoid", 0.1, 0.0),
    "ipo": ("ipo", 0.5, 0.0),
    "robust": ("robust", 0.1, 0.1),
}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    root = tmp_path_factory.mktemp("dpo")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    reference = _save(model, root / "reference")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * NOISE)
    policy = _save(model, root / "policy")
    prompt, chosen, rejected = (list(column) for column in zip(*RECORDS))
    records = datasets.Dataset.from_dict({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return SimpleNamespace(root=root, reference=reference, policy=policy, records=records, tokenizer=_hf_tokenizer())


def _hf(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def _trl(oracle: SimpleNamespace, loss: str, model, ref_model=None, peft_config=None):
    """TRL's trainer for ``LOSSES[loss]`` over ``model`` and one batch of all the records, tokenized
    and collated by TRL itself. fp32 on the CPU without gradient checkpointing, where DPOConfig's
    defaults are bf16 (refused on a machine without a GPU unless ``use_cpu``) and checkpointing."""
    import trl

    loss_type, beta, smoothing = LOSSES[loss]
    args = trl.DPOConfig(
        output_dir=str(oracle.root / f"trl-{loss}"),
        loss_type=loss_type,
        beta=beta,
        label_smoothing=smoothing,
        report_to=[],
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
    )
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=oracle.records,
        processing_class=oracle.tokenizer,
        peft_config=peft_config,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(RECORDS))])
    return trainer, batch


def _trl_loss(trainer, batch) -> torch.Tensor:
    """TRL's loss of ``batch``, its gradients accumulated into the trainer's model."""
    trainer.model.train()  # TRL logs a training batch's metrics under "train"
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach()


def _ours(batch):
    """llmctl's batch of TRL's rows: inputs and next-token targets, IGNORE_INDEX off the answers."""
    from workloads.pretrain.data.sampler import Batch
    from workloads.pretrain.model.losses import IGNORE_INDEX

    ids, answer = batch["input_ids"], batch["completion_mask"]
    assert not answer[:, 0].any()  # every row has a prompt: the shifted answer mask loses no token
    targets = ids[:, 1:].masked_fill(answer[:, 1:] == 0, IGNORE_INDEX)
    return Batch(ids[:, :-1], targets, int((targets != IGNORE_INDEX).sum()))


def _dpo(policy, reference_logps, batch, loss: str):
    """llmctl's DPO loss of ``batch`` (backpropagated into ``policy``) and its PairLosses and log-probabilities.
    ``reference_logps``: a function of the batch, called without gradients."""
    from workloads.pretrain.model.preference import pair_losses, sequence_logps
    from workloads.protocol.schema import DpoCfg, DpoLoss

    loss_type, beta, smoothing = LOSSES[loss]
    logps, counts = sequence_logps(policy, batch)
    with torch.no_grad():
        ref_logps = reference_logps(batch)
    out = pair_losses(logps, ref_logps, counts, DpoCfg(beta=beta, loss=DpoLoss(loss_type), label_smoothing=smoothing))
    total = out.losses.mean()
    total.backward()
    return total.detach(), out, logps.detach(), counts


def _grads(model, which) -> dict[str, torch.Tensor]:
    from workloads.pretrain.model.init_weights import canonical_name

    out = {}
    for fqn, param in model.named_parameters():
        name = canonical_name(fqn)
        if which(name):
            grad = param.grad
            out[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return out


def _same_metrics(trainer, batch, ours, logps, counts, loss: str) -> None:
    """TRL's logged rewards and log-probabilities are llmctl's, and the policy is far enough from
    the reference that the comparison means something: some pair's log-ratio margin passes half a nat."""
    margins = (ours.chosen_rewards - ours.rejected_rewards) / LOSSES[loss][1]
    assert margins.abs().max() > 0.5, margins
    logged = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    chosen_logps, rejected_logps = logps.chunk(2)
    want = {
        "rewards/chosen": ours.chosen_rewards.mean(),
        "rewards/rejected": ours.rejected_rewards.mean(),
        "rewards/margins": (ours.chosen_rewards - ours.rejected_rewards).mean(),
        "rewards/accuracies": (ours.chosen_rewards > ours.rejected_rewards).float().mean(),
        "logps/chosen": chosen_logps.mean(),
        "logps/rejected": rejected_logps.mean(),
    }
    # TRL's IPO divides by the answer tokens of its unshifted completion mask: llmctl's counts
    assert torch.equal(counts, batch["completion_mask"].sum(dim=1)), (counts, batch["completion_mask"].sum(dim=1))
    for key, value in want.items():
        tol = METRIC_TOL * max(1.0, abs(float(value)))
        assert abs(logged[key] - float(value)) <= tol, (key, logged[key], float(value))


@pytest.mark.parametrize(
    "loss, kernels",
    [("sigmoid", "fused"), ("ipo", "fused"), ("robust", "fused"), ("sigmoid", "reference")],
    ids=["sigmoid", "ipo", "robust", "sigmoid-reference-kernels"],
)
def test_full_fine_tuning_computes_trls_loss_gradients_and_rewards(
    oracle, one_process, loss: str, kernels: str
) -> None:
    """The reference: a second, frozen copy of the starting weights (TRL's ``ref_model``). Both
    ``model.kernels``: the fused path's per-token losses (chunked, recomputed in backward) and the
    reference path's plain cross-entropy."""
    from workloads.pretrain.checkpoint.hf_load import hf_name
    from workloads.pretrain.model.preference import sequence_logps

    trainer, batch = _trl(oracle, loss, _hf(oracle.policy), ref_model=_hf(oracle.reference))
    theirs = _trl_loss(trainer, batch)

    x = _ours(batch)
    _, policy = _load(oracle.policy, f"model.kernels={kernels}")
    _, reference = _load(oracle.reference, f"model.kernels={kernels}")
    ours, out, logps, counts = _dpo(policy, lambda b: sequence_logps(reference, b)[0], x, loss)

    assert abs(float(ours) - theirs.item()) <= LOSS_TOL, (float(ours), theirs.item())
    _same_metrics(trainer, batch, out, logps, counts, loss)
    grads = _grads(policy, lambda name: True)
    assert len(grads) == len(list(trainer.model.parameters())) == 2 * 9 + 3
    for name, grad in grads.items():
        hf_grad = trainer.model.get_parameter(hf_name(name)).grad
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grad, hf_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)
    assert all(p.grad is None for p in reference.parameters())  # the reference is frozen
    assert all(p.grad is None for p in trainer.ref_model.parameters())


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_lora_against_the_base_computes_trls_loss_and_adapter_gradients(oracle, one_process, loss: str) -> None:
    """The reference is the base (adapters off): TRL's when it wraps the model in PEFT itself
    (``peft_config``); a ``PeftModel`` handed to TRL 1.16 would instead get a frozen copy of its
    adapter (``"ref"``) as the reference."""
    import peft

    from workloads.pretrain.model.lora import adapters_off, is_adapter
    from workloads.pretrain.model.preference import sequence_logps

    _, policy = _load(
        oracle.reference, "model.lora.rank=4", "model.lora.alpha=8", f"model.lora.targets=[{','.join(ALL)}]"
    )
    set_b(policy, LORA_B)
    names = [PEFT_NAMES[k].split(".")[1] for k in PEFT_NAMES]
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=names, bias="none")
    trainer, batch = _trl(oracle, loss, _hf(oracle.reference), peft_config=config)
    assert trainer.ref_model is None and list(trainer.model.peft_config) == ["default"]
    with torch.no_grad():
        for fqn, value in _full(policy, is_adapter).items():
            trainer.model.get_parameter(_peft_name(fqn, "A" if ".lora_a." in fqn else "B")).copy_(value)
    theirs = _trl_loss(trainer, batch)

    def base_logps(b):
        with adapters_off(policy):
            return sequence_logps(policy, b)[0]

    ours, out, logps, counts = _dpo(policy, base_logps, _ours(batch), loss)
    assert abs(float(ours) - theirs.item()) <= LOSS_TOL, (float(ours), theirs.item())
    _same_metrics(trainer, batch, out, logps, counts, loss)
    grads = _grads(policy, is_adapter)
    assert len(grads) == 2 * len(ALL) * 2  # A and B of each target, 2 layers
    for fqn, grad in grads.items():
        peft_grad = trainer.model.get_parameter(_peft_name(fqn, "A" if ".lora_a." in fqn else "B")).grad
        assert grad.abs().max() > 0, fqn
        torch.testing.assert_close(grad, peft_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=fqn)
    assert all(p.grad is None for n, p in policy.named_parameters() if not is_adapter(n))
