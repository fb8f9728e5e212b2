"""Generation (KV cache vs full recompute) and the Hugging Face export (logits match transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workloads.pretrain.checkpoint.hf_export import export
from workloads.pretrain.model.generate import generate
from workloads.pretrain.model.transformer import build_model
from workloads.protocol.schema import ModelCfg, RopeLayout


def _model(tie: bool = False, kv_heads: int = 2, seed: int = 0, rope_layout: str = "interleaved") -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelCfg(
        name="t",
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=kv_heads,
        vocab_size=300,
        max_seq_len=96,
        tie_embeddings=tie,
        rope_theta=500000.0,
        rope_layout=RopeLayout(rope_layout),
    )
    return build_model(cfg).eval(), cfg


@pytest.mark.parametrize(
    "kv_heads, rope_layout", [(4, "interleaved"), (2, "interleaved"), (1, "interleaved"), (2, "half")]
)
def test_kv_cache_greedy_equals_full_recompute(kv_heads: int, rope_layout: str) -> None:
    """Also for Hugging Face's RoPE layout (``init_from`` models): the cache rotates as the model does."""
    model, _ = _model(kv_heads=kv_heads, rope_layout=rope_layout)
    prompt = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(1))
    cached = generate(model, prompt, max_new_tokens=40, use_cache=True)
    full = generate(model, prompt, max_new_tokens=40, use_cache=False)
    assert cached.shape == (2, 40)
    assert torch.equal(cached, full)


@pytest.mark.parametrize("rope_layout", ["interleaved", "half"])
def test_kv_cache_logits_equal_the_full_forward(rope_layout: str) -> None:
    """Token by token through the cache, each position's logits are the full forward's (fp32);
    attention weights are scaled up so that RoPE visibly matters."""
    from workloads.pretrain.model.generate import KVCache, _next_logits_cached

    model, _ = _model(rope_layout=rope_layout)
    with torch.no_grad():
        for block in model.layers.values():
            block.attention.wq.weight.mul_(30)
            block.attention.wk.weight.mul_(30)
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens).float()
        cache = KVCache()
        stepped = [_next_logits_cached(model, tokens[:, :5], cache)]
        stepped += [_next_logits_cached(model, tokens[:, i : i + 1], cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.stack(stepped, dim=1), full[:, 4:], atol=1e-5, rtol=1e-5)


def test_temperature_sampling_is_seeded_and_differs_from_greedy() -> None:
    model, _ = _model()
    prompt = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(2))
    a = generate(model, prompt, 30, temperature=1.5, generator=torch.Generator().manual_seed(3))
    b = generate(model, prompt, 30, temperature=1.5, generator=torch.Generator().manual_seed(3))
    greedy = generate(model, prompt, 30)
    assert torch.equal(a, b)
    assert not torch.equal(a, greedy)


def test_generation_refuses_to_run_past_max_seq_len() -> None:
    model, _ = _model()
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, torch.zeros(1, 90, dtype=torch.long), max_new_tokens=10)


@pytest.mark.parametrize(
    "tie, dtype, shard_bytes",
    [(False, "fp32", None), (True, "fp32", 40_000), (False, "bf16", 40_000), (True, "fp16", None)],
)
def test_hf_export_matches_native_logits(tie: bool, dtype: str, shard_bytes: int | None, tmp_path: Path) -> None:
    """transformers' logits on the export equal the native model's whose weights are rounded to the
    export's dtype, both computed in fp32: the export is exactly the weights, rounded once, in the
    one file or the shards (with an index) that ``save_pretrained`` would write."""
    import json

    transformers = pytest.importorskip("transformers")
    from workloads.pretrain.checkpoint.hf_export import DTYPES

    model, cfg = _model(tie=tie)
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    out = export(model.state_dict(), cfg, tmp_path / "hf", dtype=dtype, **kwargs)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    if shard_bytes:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(shards) >= 3 and set(index["weight_map"].values()) == set(shards), shards
        assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    else:
        assert shards == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    written = json.loads((out / "config.json").read_text())
    assert written["torch_dtype"] == written["dtype"] == str(DTYPES[dtype]).removeprefix("torch.")
    with torch.no_grad():  # the weights as the export holds them, computed in fp32 like transformers
        for p in model.parameters():
            p.copy_(p.to(DTYPES[dtype]).float())
    tokens = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    # fp32 tolerance: same math, different kernels/association order
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-4)


def _tokenizer(tmp_path: Path) -> Path:
    """A byte-level BPE with the end-of-text token, trained on stdlib text (what runs export)."""
    from pydoc_data.topics import topics

    from workloads.pretrain.data import EOT, train_tokenizer

    tok = train_tokenizer([topics[k] for k in sorted(topics)][:200], 300)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert tok.token_to_id(EOT) is not None
    return path


def test_hf_export_is_complete_for_transformers(tmp_path: Path) -> None:
    """No missing or unexpected weights; special-token ids from the tokenizer in config.json and
    generation_config.json, so generate() stops at end-of-text; the tokenizer round-trips text.
    llmctl's own BPE has an end-of-text token and no BOS: the export has none either (not the
    end-of-text token twice, nor LlamaConfig's default id 1)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from workloads.pretrain.data import EOT

    model, cfg = _model()
    tok_file = _tokenizer(tmp_path)
    out = export(model.state_dict(), cfg, tmp_path / "hf", tokenizer_file=tok_file, eos_token=EOT)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert info["missing_keys"] in ([], set()) and info["unexpected_keys"] in ([], set()), info
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    eos = tok.convert_tokens_to_ids(EOT)
    assert tok.eos_token == EOT and hf.config.eos_token_id == hf.generation_config.eos_token_id == eos
    assert tok.bos_token is None and tok.bos_token_id is None
    assert hf.config.bos_token_id is None and hf.generation_config.bos_token_id is None
    assert tok("Return a")["input_ids"] == Tokenizer.from_file(str(tok_file)).encode("Return a").ids  # nothing added
    text = "def f(x):\n    return x  # naïve, but fine"
    assert tok.decode(tok(text)["input_ids"]) == text

    class EndAtThird(transformers.LogitsProcessor):  # the model "says" end-of-text as its third token
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if input_ids.shape[1] == prompt.shape[1] + 2:
                scores = torch.full_like(scores, -1e9)
                scores[:, eos] = 0
            return scores

    prompt = torch.tensor([tok("Return a")["input_ids"]])
    generated = hf.generate(prompt, max_new_tokens=20, do_sample=False, logits_processor=[EndAtThird()])
    assert generated.shape[1] == prompt.shape[1] + 3 and generated[0, -1].item() == eos  # stopped there


def test_hf_export_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    from workloads.pretrain.checkpoint.tensor_source import StateDictSource

    model, cfg = _model()
    tok_file = _tokenizer(tmp_path)
    with pytest.raises(ValueError, match="no token"):  # a bad tokenizer fails before any weight is written
        export(model.state_dict(), cfg, tmp_path / "hf", tokenizer_file=tok_file, eos_token="<|no such token|>")
    assert list(tmp_path.iterdir()) == [tok_file]

    class FailsLast(StateDictSource):  # the checkpoint becomes unreadable after some shards were written
        def read(self, name: str) -> torch.Tensor:
            if name == "output.weight":
                assert len(list(tmp_path.glob(".hf.tmp-*/model-*.safetensors"))) >= 2
                raise OSError("connection reset")
            return super().read(name)

    with pytest.raises(OSError, match="connection reset"):
        export(FailsLast(model.state_dict()), cfg, tmp_path / "hf", tok_file, "<|endoftext|>", max_shard_size=40_000)
    assert list(tmp_path.iterdir()) == [tok_file]  # no directory, no leftovers
    first = export(model.state_dict(), cfg, tmp_path / "hf", tokenizer_file=tok_file, eos_token="<|endoftext|>")
    other, _ = _model(seed=1)
    again = export(other.state_dict(), cfg, tmp_path / "hf", tok_file, "<|endoftext|>", dtype="fp32")
    assert again == first and sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tokenizer.json"]
    from safetensors.torch import load_file

    weights = load_file(str(again / "model.safetensors"))
    assert torch.equal(weights["model.embed_tokens.weight"], other.state_dict()["tok_embeddings.weight"])


def test_hf_export_refuses_fp16_for_weights_beyond_its_range(tmp_path: Path) -> None:
    """fp16 tops out at 65504: a weight beyond it would be written as inf. Refused, naming the
    tensor and the fix, and nothing is left behind; bf16 (the default) holds it."""
    model, cfg = _model()
    with torch.no_grad():
        model.layers["1"].feed_forward.w2.weight[0, 0] = 1e5
    with pytest.raises(ValueError, match=r"layers\.1\.feed_forward\.w2\.weight holds 1e\+05.*--dtype bf16"):
        export(model.state_dict(), cfg, tmp_path / "hf", dtype="fp16")
    assert list(tmp_path.iterdir()) == []
    export(model.state_dict(), cfg, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_hf_export_needs_no_transformers(tmp_path: Path) -> None:
    """In a process where importing transformers fails, the export is written all the same."""
    import subprocess
    import sys

    poisoned = tmp_path / "poisoned" / "transformers"
    poisoned.mkdir(parents=True)
    (poisoned / "__init__.py").write_text("raise ImportError('export imported transformers')\n")
    tok_file = _tokenizer(tmp_path)
    code = (
        "import sys, torch; from workloads.protocol.schema import ModelCfg;"
        "from workloads.pretrain.model.transformer import build_model; "
        "from workloads.pretrain.checkpoint.hf_export import export;"
        "cfg = ModelCfg(name='t', dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, max_seq_len=96);"
        f"export(build_model(cfg).state_dict(), cfg, {str(tmp_path / 'hf')!r}, tokenizer_file={str(tok_file)!r},"
        " eos_token='<|endoftext|>'); print('transformers' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": f"{poisoned.parent}:{root}"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False" and (tmp_path / "hf" / "tokenizer_config.json").is_file()
