"""A LoRA run's checkpoint and exports, against oracles nobody here wrote.

The checkpoint of a LoRA model holds the adapters and their optimizer state, no base weight. From
it: the PEFT export (``lora_export.export_peft``) loaded by ``peft.PeftModel.from_pretrained`` on
transformers' model of the same Hugging Face base computes llmctl's logits; the merged HF export
(``MergedSource`` + ``hf_export``) loaded by transformers does too; QLoRA's merged export computes
what the QLoRA model computes (its NF4-dequantized base). fp32 throughout; logits to atol 2e-5 /
rtol 1e-4, as test_hf_init compares llmctl's model with transformers' (only summation order differs;
merging ``W + s B A`` into one matrix reorders sums too).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lora_worker import set_b
from test_hf_init import _batch, _hf_tokenizer, _save
from test_lora import ALL, COMMON, NF4_SHAPE, PEFT_NAMES, _load

ATOL, RTOL = 2e-5, 1e-4


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("lora-export")
    torch.manual_seed(0)
    out = {
        "llama": _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)), root / "llama"),
        "llama-256": _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**NF4_SHAPE)), root / "llama-256"),
    }
    _hf_tokenizer().save_pretrained(str(out["llama"]))
    return out


def _trained(path: Path, ckpt: Path, *overrides: str):
    """The LoRA model of ``path`` with nonzero B, one optimizer step taken, saved by the trainer's
    Checkpointer as ``ckpt/step-1``; returns (cfg, model)."""
    from workloads.pretrain.checkpoint.dcp import Checkpointer
    from workloads.pretrain.components.optim import build_optimizer
    from workloads.pretrain.data import Sampler

    cfg, model = _load(path, f"checkpoint.dir={ckpt}", *overrides)
    set_b(model)
    optimizer = build_optimizer(model, cfg.train)
    x, y = _batch()
    model(x, y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = np.random.default_rng(0).integers(0, 512, 5_000).astype(np.uint16)
    sampler = Sampler(tokens, cfg.train.seq_len, cfg.train.batch_size, cfg.train.seed)
    Checkpointer(cfg, SimpleNamespace(rank=0, world_size=1), model, optimizer, sampler).save(1)
    return cfg, model


def test_checkpoint_holds_adapters_and_their_optimizer_state_only(bases, one_process, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from workloads.pretrain.checkpoint.tensor_source import DcpSource
    from workloads.pretrain.model.lora import is_adapter

    cfg, model = _trained(bases["llama"], tmp_path / "ck", "model.lora.rank=4")
    step = tmp_path / "ck" / "step-1"
    saved = DcpSource(str(step)).specs()
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(saved) == adapters and len(saved) == 2 * len(ALL) * 2 and all(is_adapter(n) for n in saved)
    keys = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    optim = {k for k in keys if k.startswith("optim.state.")}
    assert optim and all(is_adapter(k) for k in optim), sorted(optim)[:5]
    assert not any(k.startswith("model.") and not is_adapter(k) for k in keys)
    # what the model part takes in the files: the adapters (plus DCP's per-tensor framing), not the base
    written = sum(v.length for k, v in FileSystemReader(str(step)).read_metadata().storage_data.items())
    model_part = sum(
        v.length for k, v in FileSystemReader(str(step)).read_metadata().storage_data.items() if k.fqn[:6] == "model."
    )
    adapter_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if p.requires_grad)
    base_bytes = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    assert adapter_bytes <= model_part < 3 * adapter_bytes < base_bytes, (model_part, adapter_bytes, base_bytes)
    assert written < base_bytes  # adapters, their Adam moments, sampler and RNG: less than the base alone


def test_peft_and_merged_exports_compute_llmctls_logits(bases, one_process, tmp_path: Path) -> None:
    import peft
    import transformers

    from workloads.pretrain.checkpoint.hf_export import export
    from workloads.pretrain.checkpoint.lora_export import (
        ADAPTER_CONFIG,
        MergedSource,
        base_source,
        export_peft,
        merged_model,
    )
    from workloads.pretrain.checkpoint.tensor_source import DcpSource

    path = bases["llama"]
    cfg, model = _trained(path, tmp_path / "ck", "model.lora.rank=4", "model.lora.alpha=8")
    adapters = DcpSource(str(tmp_path / "ck" / "step-1"))
    x, _ = _batch()
    with torch.no_grad():
        want = model(x)

    export_peft(adapters, cfg, tmp_path / "peft")
    conf = json.loads((tmp_path / "peft" / ADAPTER_CONFIG).read_text())
    hf_targets = sorted(name.split(".")[1] for name in PEFT_NAMES.values())
    assert (conf["peft_type"], conf["task_type"], conf["r"], conf["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8.0)
    assert conf["target_modules"] == hf_targets and conf["base_model_name_or_path"] == str(path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys and len(keys) == 2 * 7 * 2
    base = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, want, atol=ATOL, rtol=RTOL)

    export(MergedSource(base_source(cfg), adapters, cfg), cfg.model, tmp_path / "hf", dtype="fp32")
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(input_ids=x).logits, want, atol=ATOL, rtol=RTOL)
        # what ``llmctl eval`` scores: the merged model, built in memory
        torch.testing.assert_close(merged_model(cfg, str(tmp_path / "ck" / "step-1"))(x), want, atol=ATOL, rtol=RTOL)
        plain = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        assert (plain(input_ids=x).logits - want).abs().max() > 1e-3  # the adapters changed the model


def test_qlora_merges_into_the_dequantized_base(bases, one_process, tmp_path: Path) -> None:
    import transformers

    from workloads.pretrain.checkpoint.hf_export import export
    from workloads.pretrain.checkpoint.lora_export import MergedSource, base_source
    from workloads.pretrain.checkpoint.tensor_source import DcpSource

    path = bases["llama-256"]
    cfg, model = _trained(path, tmp_path / "ck", "model.lora.rank=4", "model.lora.quantize_base=nf4")
    adapters = DcpSource(str(tmp_path / "ck" / "step-1"))
    assert all(".lora_" in name for name in adapters.specs())  # no NF4 base in the checkpoint
    export(MergedSource(base_source(cfg), adapters, cfg), cfg.model, tmp_path / "hf", dtype="fp32")
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    x, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, model(x), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("trained", ["bf16", "fp32"])
def test_a_qlora_merge_is_the_same_whether_the_exporting_process_sees_cuda(
    bases, one_process, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trained: str
) -> None:
    """A QLoRA checkpoint's marker records the dtype its run computed in, and its merge de-quantizes
    the NF4 base in that dtype whether the exporting process sees CUDA or not. The export is given
    ``train.dtype=auto``, as a GPU run's config says (bf16 where CUDA is seen, fp32 elsewhere):
    before the marker said it, one checkpoint merged into a bf16- or an fp32-de-quantized base
    depending on the machine that exported it."""
    from workloads.pretrain.checkpoint.lora_export import MergedSource, base_source
    from workloads.pretrain.checkpoint.tensor_source import DcpSource
    from workloads.protocol.checkpoint_layout import read_marker
    from workloads.protocol.config import with_values

    qlora = ("model.lora.rank=4", "model.lora.quantize_base=nf4", f"train.dtype={trained}")
    cfg, _ = _trained(bases["llama-256"], tmp_path / "ck", *qlora)
    step = str(tmp_path / "ck" / "step-1")
    assert read_marker(step)["compute_dtype"] == trained
    auto = with_values(cfg, "train", dtype="auto")
    merged, dtypes = {}, {}
    for cuda in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        source = MergedSource(base_source(auto), DcpSource(step), auto, step)
        merged[cuda], dtypes[cuda] = {name: source.read(name) for name in source.specs()}, source.dtype
    assert dtypes[True] == dtypes[False] == (torch.bfloat16 if trained == "bf16" else torch.float32)
    assert merged[True].keys() == merged[False].keys()
    assert all(torch.equal(merged[True][k], merged[False][k]) for k in merged[True])


def test_a_run_without_lora_has_no_peft_export(tmp_path: Path) -> None:
    from workloads.pretrain.checkpoint.lora_export import export_peft
    from workloads.pretrain.checkpoint.tensor_source import StateDictSource
    from workloads.protocol.config import load

    cfg = load(None, [])
    with pytest.raises(ValueError, match=r"model.lora.rank=0"):
        export_peft(StateDictSource({}), cfg, tmp_path / "peft")
    assert not (tmp_path / "peft").exists()
