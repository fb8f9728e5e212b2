"""``data.tokenizer=<tiktoken BPE file>`` (Meta's Llama 3 ``tokenizer.model`` format): converted to a
``tokenizers`` BPE that encodes exactly as tiktoken does. tiktoken is the oracle: a BPE trained here
with its own educational trainer, saved in its file format, loaded by both."""

from __future__ import annotations

import base64
import contextlib
import io
from pathlib import Path

import pytest

EDGE = [
    "héllo wörld 12345 ’quote’ <|eot_id|> tab\tx  \n\n  y",
    "  leading spaces",
    "a" * 50,
    "<|begin_of_text|>x<|end_of_text|>",
    "emoji 🐍🐍 and CJK 蛇",
    "1234567 digits",
]


@pytest.fixture(scope="module")
def tiktoken_bpe(tmp_path_factory: pytest.TempPathFactory):
    """(path of a tiktoken BPE file, the tiktoken Encoding that reads it as Llama 3 does)."""
    tiktoken = pytest.importorskip("tiktoken")
    from pydoc_data.topics import topics

    from tiktoken._educational import bpe_train

    from workloads.pretrain.data.tokenizer import LLAMA3_PATTERN, LLAMA3_SPECIAL

    with contextlib.redirect_stdout(io.StringIO()):  # the educational trainer prints its merges
        ranks = bpe_train("".join(topics[k] for k in sorted(topics))[:40000], 400, LLAMA3_PATTERN)
    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.model"
    path.write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1]))
    )
    special = {t: len(ranks) + i for i, t in enumerate(LLAMA3_SPECIAL)}
    return path, tiktoken.Encoding("llama3-test", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special)


def test_encodes_exactly_as_tiktoken(tiktoken_bpe) -> None:
    from pydoc_data.topics import topics

    from workloads.pretrain.data.tokenizer import load_pretrained

    path, enc = tiktoken_bpe
    tok, eos, _ = load_pretrained(str(path))
    assert eos == "<|end_of_text|>" and tok.token_to_id(eos) == enc.encode(eos, allowed_special="all")[0]
    texts = [topics[k] for k in sorted(topics)] + EDGE
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == enc.encode(text, allowed_special="all"), text[:80]
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("x").ids[0] == enc.encode("<|begin_of_text|>", allowed_special="all")[0]  # BOS, as Llama 3
    assert sum(len(t) for t in texts) > 400_000  # a real corpus, not a few words


def test_corpus_built_with_a_tiktoken_file(tiktoken_bpe, tmp_path: Path) -> None:
    """Each document of the cached corpus is <|begin_of_text|> + tiktoken's ids + <|end_of_text|>."""
    from dataclasses import replace

    from workloads.pretrain.data import prepare_corpus
    from workloads.pretrain.data.sources import builtin_pydoc_texts
    from workloads.protocol.schema import DataCfg

    path, enc = tiktoken_bpe
    data = DataCfg(name="pydoc", source="builtin:pydoc", vocab_size=0, cache_dir=str(tmp_path), tokenizer=str(path))
    corpus = prepare_corpus(data)
    bos, eos = (enc.encode(t, allowed_special="all")[0] for t in ("<|begin_of_text|>", "<|end_of_text|>"))
    docs = builtin_pydoc_texts()
    want = [i for doc in docs[:3] for i in [bos, *enc.encode(doc), eos]]
    assert corpus.tokens[: len(want)].tolist() == want and corpus.eos_token == "<|end_of_text|>"
    bad = path.with_name("bad.tiktoken")
    bad.write_text("not base64 at all\n")
    with pytest.raises(ValueError, match=r"bad.tiktoken:1: not a tiktoken BPE file"):
        prepare_corpus(replace(data, tokenizer=str(bad)))
