"""The Hugging Face export as something to ship: from a DCP checkpoint, shard by shard, with the
source tokenizer's real BOS/EOS, chat template and generation config.

Oracles nobody here wrote: transformers (``AutoModelForCausalLM`` on the shards and index,
``AutoTokenizer`` and ``apply_chat_template`` on the export against the same calls on the source).
The logits test for the state-dict path and its dtypes is ``test_generate_export.py``.
"""

from __future__ import annotations

import json
import warnings
import weakref
from pathlib import Path

import pytest
import torch

VOCAB = 512
BOS, END, EOT_ID = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
SPECIAL = [BOS, END, "<|start_header_id|>", "<|end_header_id|>", EOT_ID]
TEMPLATE = (  # Llama 3's chat template, shortened
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is a tuple?"},
    {"role": "assistant", "content": "An immutable sequence."},
    {"role": "user", "content": "And a set?"},
]
SHARD = 40_000  # bytes: the tiny model below fills several shards


@pytest.fixture(scope="module")
def trained_bpe() -> str:
    """tokenizer.json text: a byte-level BPE with Llama 3's named special tokens and a
    post-processor that puts <|begin_of_text|> before text, as Llama 3's tokenizer.json does."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [topics[k] for k in sorted(topics)][:300],
        trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok.to_str()


def _source(root: Path, text: str, template_in: str) -> Path:
    """A Llama-3-Instruct-like Hugging Face directory: tokenizer saved by transformers (its chat
    template in ``chat_template.jinja``, as 5.x writes it, or in ``tokenizer_config.json``, as 4.x
    did), config.json and generation_config.json stopping at end-of-text or end-of-turn."""
    import transformers
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(text)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOT_ID)
    hf.chat_template = TEMPLATE
    out = root / f"source-{template_in}"
    hf.save_pretrained(str(out))
    if template_in == "tokenizer_config":
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
        (out / "chat_template.jinja").unlink(missing_ok=True)
    assert (out / "chat_template.jinja").is_file() == (template_in == "jinja")
    ids = {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": [tok.token_to_id(END), tok.token_to_id(EOT_ID)]}
    (out / "config.json").write_text(json.dumps({"model_type": "llama", **ids}))
    (out / "generation_config.json").write_text(json.dumps({**ids, "do_sample": True, "temperature": 0.6}))
    return out


def _cfg(tmp_path: Path, tokenizer: Path, rope_layout: str = "interleaved"):
    from conftest import tiny_cfg

    text = tmp_path / "text.txt"
    text.write_text("A short document about tuples and sets.\n" * 50)
    return tiny_cfg(
        **{
            "model.vocab_size": VOCAB,
            "model.rope_layout": rope_layout,
            "data.source": str(text),
            "data.tokenizer": str(tokenizer),
            "data.cache_dir": str(tmp_path / "cache"),
        }
    )


def _checkpoint(tmp_path: Path, model_cfg) -> tuple[torch.nn.Module, Path]:
    """A trainer-style DCP checkpoint (model and optimizer state) of a random tiny model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from workloads.pretrain.model.transformer import build_model

    torch.manual_seed(0)
    model = build_model(model_cfg).eval()
    step_dir = tmp_path / "ck" / "step-2"
    state = {"model": get_model_state_dict(model), "optim": {"state": {"x": torch.ones(3)}}}
    with warnings.catch_warnings():  # one process, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(step_dir), no_dist=True)
    (step_dir / ".complete").write_text("{}")
    return model, step_dir


def test_dcp_checkpoint_exports_in_bf16_shards_with_the_sources_tokens(trained_bpe: str, tmp_path: Path) -> None:
    """The trainer's export mode (no model built: DCP read tensor by tensor) writes bf16 shards and
    an index that transformers loads with nothing missing; its logits are the native model's with
    its weights rounded to bf16 (both in fp32). The tokenizer is the source's: its BOS (not the
    EOS), EOS, chat template, config ids and generation config."""
    transformers = pytest.importorskip("transformers")
    from workloads.pretrain.evaluate import run

    source = _source(tmp_path, trained_bpe, "jinja")
    cfg = _cfg(tmp_path, source)
    model, step_dir = _checkpoint(tmp_path, cfg.model)
    out = tmp_path / "hf"
    result = run(cfg, str(step_dir), export_dir=str(out), run_id="r1", export_max_shard_size=SHARD)
    assert (result["step"], result["dtype"]) == (2, "bf16")

    shards = sorted(p.name for p in out.glob("*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) >= 3 and set(index["weight_map"].values()) == set(shards), shards
    assert json.loads((out / "llmctl_export.json").read_text())["dtype"] == "bf16"
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert hf.dtype == torch.bfloat16 and hf.config.dtype == torch.bfloat16
    hf = hf.float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
        tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(4))
        # fp32 tolerance: the same bf16 weights, different kernels/association order
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=2e-5, rtol=1e-4)

    src, tok = (
        transformers.AutoTokenizer.from_pretrained(str(source)),
        transformers.AutoTokenizer.from_pretrained(str(out)),
    )
    assert (tok.bos_token, tok.eos_token) == (BOS, EOT_ID) and tok.bos_token_id != tok.eos_token_id
    assert (tok.bos_token_id, tok.eos_token_id) == (src.bos_token_id, src.eos_token_id)
    assert tok("a tuple")["input_ids"] == src("a tuple")["input_ids"] and tok("a")["input_ids"][0] == src.bos_token_id
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(BOS + "<|start_header_id|>system")
    assert rendered == src.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == src.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    source_ids = json.loads((source / "config.json").read_text())
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (source_ids["bos_token_id"], source_ids["eos_token_id"])
    assert hf.generation_config.eos_token_id == source_ids["eos_token_id"]  # stops at end-of-text and end-of-turn
    assert hf.generation_config.temperature == 0.6


@pytest.mark.parametrize("template_in", ["jinja", "tokenizer_config", "none"])
def test_chat_template_and_bos_come_from_where_the_source_had_them(
    trained_bpe: str, template_in: str, tmp_path: Path
) -> None:
    """A template in chat_template.jinja or in tokenizer_config.json is carried over and renders as
    the source's; a bare tokenizer.json (no directory: no template) still gets its real BOS, the
    token its post-processor puts first."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from workloads.pretrain.checkpoint.hf_export import export
    from workloads.pretrain.checkpoint.hf_tokenizer import source_dir
    from workloads.pretrain.model.transformer import build_model

    source = _source(tmp_path, trained_bpe, "jinja" if template_in == "none" else template_in)
    spec = str(source / "tokenizer.json") if template_in == "none" else str(source)
    cfg = _cfg(tmp_path, Path(spec))
    eos = END if template_in == "none" else EOT_ID  # a bare tokenizer.json: the first known end-of-text
    out = export(
        build_model(cfg.model).state_dict(),
        cfg.model,
        tmp_path / "hf",
        tokenizer_file=source / "tokenizer.json",
        eos_token=eos,
        tokenizer_source=source_dir(cfg.data.tokenizer),
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = Tokenizer.from_str(trained_bpe)
    assert (tok.bos_token, tok.eos_token) == (BOS, eos)
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    if template_in == "none":
        assert tok.chat_template is None
        assert config["bos_token_id"] == generation["bos_token_id"] == ids.token_to_id(BOS)
        assert config["eos_token_id"] == generation["eos_token_id"] == ids.token_to_id(END)
        return
    src = transformers.AutoTokenizer.from_pretrained(str(source))
    for prompt in (True, False):
        want = src.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)
        assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt) == want


def test_export_holds_about_one_shard_not_the_model(tmp_path: Path) -> None:
    """Counted, not sampled from RSS: every tensor the export reads from the checkpoint is tracked
    until it is freed; at no point are more than ``max_shard_size`` + one tensor's bytes alive, while
    the model is several times that. (fp32 and HF's RoPE layout: the tensors read are the ones
    written, no conversion copies to miss.)"""
    from safetensors.torch import load_file

    from workloads.pretrain.checkpoint.hf_export import export
    from workloads.pretrain.checkpoint.tensor_source import DcpSource

    cfg = _cfg(tmp_path, tmp_path / "unused", rope_layout="half")
    model, step_dir = _checkpoint(tmp_path, cfg.model)

    class Counted(DcpSource):
        alive = peak = 0

        def read(self, name: str) -> torch.Tensor:
            t = super().read(name)
            n = t.numel() * t.element_size()
            Counted.alive += n
            Counted.peak = max(Counted.peak, Counted.alive)
            weakref.finalize(t, Counted._freed, n)
            return t

        @staticmethod
        def _freed(n: int) -> None:
            Counted.alive -= n

    source = Counted(str(step_dir))
    sizes = [s.numel * 4 for s in source.specs().values()]
    out = export(source, cfg.model, tmp_path / "hf", dtype="fp32", max_shard_size=SHARD)
    assert Counted.alive == 0 and 0 < Counted.peak <= SHARD + max(sizes), (Counted.peak, SHARD, max(sizes))
    assert sum(sizes) > 3 * (SHARD + max(sizes))  # holding the model would break the bound
    written = {}
    for shard in out.glob("model-*.safetensors"):
        written.update(load_file(str(shard)))
    from workloads.pretrain.checkpoint.hf_export import to_hf_state_dict

    want = to_hf_state_dict(model.state_dict(), cfg.model)
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)


def test_source_ids_for_another_vocabulary_give_way_to_the_tokenizers(trained_bpe: str, tmp_path: Path) -> None:
    """A source directory whose config.json / generation_config.json carry LlamaConfig's default ids
    (1 and 2: a model saved beside a tokenizer it was not configured for) does not make the export
    stop at token 2: the tokenizer's own EOS (and its BOS) are written instead."""
    from tokenizers import Tokenizer

    from workloads.pretrain.checkpoint.hf_tokenizer import tokenizer_export

    source = _source(tmp_path, trained_bpe, "jinja")
    for name in ("config.json", "generation_config.json"):
        (source / name).write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    got = tokenizer_export(source / "tokenizer.json", EOT_ID, 96, str(source))
    ids = Tokenizer.from_str(trained_bpe)
    want = {"bos_token_id": ids.token_to_id(BOS), "eos_token_id": ids.token_to_id(EOT_ID)}
    assert got.token_ids == got.generation_config == want and 2 not in want.values()
