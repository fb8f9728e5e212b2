"""``data.document_mask``: pretraining windows whose tokens attend only inside their own document.

Oracle nobody here wrote: transformers' ``LlamaForCausalLM``, given the same weights (our export)
and each document of a window alone, must produce the logits and the loss that our model produces
for the whole window under the mask. Without the mask it must not (so the comparison can fail).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import loss_env

from workloads.pretrain.data import Windows
from workloads.pretrain.data.sampler import documents

EOS = 3


def test_documents_give_each_token_its_position_and_document() -> None:
    """An end-of-text token ends its document (it is the document's last token); a row always starts one."""
    inputs = torch.tensor([[5, EOS, 7, 8, EOS, EOS, 9], [EOS, 4, 4, 4, 4, 4, EOS]])
    positions, doc_ids = documents(inputs, EOS)
    assert doc_ids.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]


def test_windows_carry_documents_only_when_asked() -> None:
    tokens = np.array([1, 2, EOS, 4, 5, 6, EOS, 8, 9], dtype=np.uint16)
    plain = Windows(tokens, 4).batch([0, 1], 8, "cpu")
    masked = Windows(tokens, 4, eos_id=EOS).batch([0, 1], 8, "cpu")
    assert plain.model_kwargs() == {}
    assert torch.equal(plain.inputs, masked.inputs) and torch.equal(plain.targets, masked.targets)
    assert masked.doc_ids.tolist() == [[0, 0, 0, 1], [0, 0, 0, 1]]  # windows 1 2 EOS 4 | 5 6 EOS 8
    assert masked.positions.tolist() == [[0, 1, 2, 0], [0, 1, 2, 0]]


def _hf_alone(hf, inputs: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor):
    """transformers' logits and summed loss, each document of each row run by itself."""
    logits, nats = torch.empty(*inputs.shape, hf.config.vocab_size), 0.0
    for row in range(inputs.shape[0]):
        for d in doc_ids[row].unique().tolist():
            at = (doc_ids[row] == d).nonzero().flatten()
            out = hf(input_ids=inputs[row, at][None]).logits[0].float()
            logits[row, at] = out
            nats += float(F.cross_entropy(out, targets[row, at], reduction="sum"))
    return logits, nats


@pytest.mark.parametrize("kernels", ["reference", "fused"])
def test_masked_windows_compute_what_transformers_computes_per_document(
    make_tiny_cfg, tmp_path: Path, kernels: str
) -> None:
    transformers = pytest.importorskip("transformers")
    from workloads.pretrain.checkpoint.hf_export import export
    from workloads.pretrain.model.transformer import build_model

    vocab, seq = 256, 48
    cfg = make_tiny_cfg(**{"model.kernels": kernels, "model.vocab_size": vocab})
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(export(model.state_dict(), cfg.model, tmp_path / "hf", dtype="fp32"))
    ).eval()

    rng = np.random.default_rng(0)
    tokens = rng.integers(EOS + 1, vocab, 4 * seq + 1).astype(np.uint16)
    tokens[rng.choice(len(tokens), 14, replace=False)] = EOS  # documents of 1 to ~40 tokens, some cut by windows
    masked = Windows(tokens, seq, eos_id=EOS)
    batch = masked.batch(range(len(masked)), masked.targets_in(range(len(masked))), "cpu")
    assert int(batch.doc_ids.max()) >= 3, batch.doc_ids  # several documents per window
    with torch.no_grad():
        ours = model(batch.inputs, **batch.model_kwargs())
        ours_nats = float(model(batch.inputs, batch.targets, **batch.model_kwargs(), reduction="sum"))
        unmasked = model(batch.inputs)
        theirs, theirs_nats = _hf_alone(hf, batch.inputs, batch.targets, batch.doc_ids)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)
    assert abs(ours_nats - theirs_nats) < 1e-3 * batch.inputs.numel() ** 0.5, (ours_nats, theirs_nats)
    later = batch.doc_ids > 0  # tokens after a document boundary: without the mask they see the earlier text
    assert (unmasked[later] - theirs[later]).abs().max() > 1e-2


def test_eval_of_a_masked_run_matches_transformers_per_document(make_tiny_cfg, cache_dir: Path, tmp_path: Path) -> None:
    """``llmctl eval``'s batches follow the run's ``data.document_mask``, and the native score of
    them equals the score of its export through transformers (one document at a time)."""
    transformers = pytest.importorskip("transformers")
    from workloads.pretrain.checkpoint.hf_export import export
    from workloads.pretrain.data import prepare_corpus
    from workloads.pretrain.evaluate import eval_batches, score_hf, score_native, token_byte_lengths
    from workloads.pretrain.model.transformer import build_model

    cfg = make_tiny_cfg(
        **{
            "data.cache_dir": str(cache_dir),
            "data.document_mask": True,
            "train.seq_len": 256,
            "train.batch_size": 4,
            "eval.val_batches": 1,
        }
    )
    corpus = prepare_corpus(cfg.data)
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(export(model.state_dict(), cfg.model, tmp_path / "hf", dtype="fp32"))
    ).eval()
    byte_len = torch.from_numpy(token_byte_lengths(corpus.tokenizer))
    (batch,) = eval_batches(cfg, corpus, 0, 1, torch.device("cpu"))
    assert batch.doc_ids is not None and int(batch.doc_ids.max()) >= 1, "pydoc windows of 256 tokens cross documents"
    native, through_hf = score_native(model, [batch], byte_len, nullcontext), score_hf(hf, [batch], byte_len)
    assert native["tokens"] == through_hf["tokens"] == batch.targets.numel()
    assert abs(native["val_loss"] - through_hf["val_loss"]) < 1e-5, (native, through_hf)
    cfg.data.document_mask = False
    (plain,) = eval_batches(cfg, corpus, 0, 1, torch.device("cpu"))
    assert plain.doc_ids is None and torch.equal(plain.inputs, batch.inputs)


@pytest.mark.slow
def test_trainer_masks_documents_alike_on_one_process_and_under_tensor_parallel(
    workload, tmp_path: Path, cache_dir: Path
) -> None:
    """The trainer reads ``data.document_mask``: it says so, its losses differ from the unmasked
    run's from the first step on, and 2 tensor-parallel ranks (heads split, the mask broadcast over
    them) reproduce the single process's train and val losses within 1e-5."""

    from omegaconf import OmegaConf

    def run(name: str, *extra: str, launcher=None):
        cfg = tmp_path / "cfg.yaml"
        OmegaConf.save(
            workload.cfg(
                **{
                    "data.cache_dir": str(cache_dir),
                    "train.steps": 4,
                    "train.seq_len": 256,
                    "train.batch_size": 4,
                    "train.log_every": 1,
                    "train.val_every": 2,
                }
            ),
            cfg,
        )
        env = loss_env(tmp_path / f"{name}.jsonl")
        out = workload.run(["--config", str(cfg), *extra], env, launcher=launcher)
        assert out.returncode == 0, out.stderr[-4000:]
        return out.stdout, workload.loss_file(tmp_path / f"{name}.jsonl")

    log, masked = run("masked", "data.document_mask=true")
    assert "val tokens, attention within documents, vocab" in log, log
    _, tp = run("tp", "data.document_mask=true", "parallel.tp=2", launcher=workload.torchrun(2))
    plain_log, plain = run("plain")
    assert "attention within documents" not in plain_log
    for kind in ("train", "val"):
        assert sorted(tp[kind]) == sorted(masked[kind]) and masked[kind], kind
        assert max(abs(tp[kind][s] - masked[kind][s]) for s in masked[kind]) <= 1e-5, (kind, tp[kind], masked[kind])
    assert abs(plain["train"][1] - masked["train"][1]) > 1e-4, (plain["train"], masked["train"])
