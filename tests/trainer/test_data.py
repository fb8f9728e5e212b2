"""Bundled corpus, tokenizer cache (built once, safely under concurrency) and the sampler."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from workloads.pretrain.contract.schema import DataCfg
from workloads.pretrain.data import Sampler, cache_key, load_texts, prepare_corpus, val_batches

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(cache_dir: Path):
    return prepare_corpus(DataCfg(cache_dir=str(cache_dir)))


def test_builtin_corpus_is_real_english(corpus):
    import json

    meta = json.loads((corpus.path / "meta.json").read_text())
    assert meta["documents"] > 1000 and meta["chars"] > 1_000_000
    text = corpus.tokenizer.decode(corpus.tokens[:20_000].tolist())
    assert " the " in text and "<|endoftext|>" not in text  # EOT separators are special tokens


def test_missing_file_source_is_a_clear_error(tmp_path):
    # File sources are covered in test_prepare.py; a glob matching nothing names data.source.
    with pytest.raises(ValueError, match=r"data\.source=.*matched nothing"):
        list(load_texts(DataCfg(name="files", source=str(tmp_path / "*.jsonl"))))


def test_tokenizer_round_trips_text(corpus):
    tok = corpus.tokenizer
    for text in ["The quick brown fox.", "def f(x):\n\treturn x ** 2  # naïve café ✓", "  leading spaces\n\n"]:
        assert tok.decode(tok.encode(text).ids) == text
    assert corpus.vocab_size == 4096
    assert len(tok.encode("The module provides functions for the interpreter.").ids) < 15  # real merges


def test_cached_tokens_and_split(corpus):
    assert corpus.tokens.dtype == np.uint16 and len(corpus.tokens) > 400_000
    assert int(corpus.tokens.max()) < corpus.vocab_size
    train, val = corpus.split(0.05)
    assert len(val) == int(len(corpus.tokens) * 0.05) and len(train) + len(val) == len(corpus.tokens)
    assert np.array_equal(val[-10:], corpus.tokens[-10:])


def test_second_prepare_is_a_cache_hit(corpus, cache_dir):
    files = {p.name: p.stat().st_mtime_ns for p in corpus.path.iterdir()}
    again = prepare_corpus(DataCfg(cache_dir=str(cache_dir)))
    assert again.cache_hit and again.path == corpus.path
    assert {p.name: p.stat().st_mtime_ns for p in again.path.iterdir()} == files
    assert set(files) == {"tokenizer.json", "tokens.npy", "meta.json"}
    assert cache_key(DataCfg(vocab_size=1024)) != cache_key(DataCfg())


def test_concurrent_builders_build_once(tmp_path):
    """Two processes starting together (as two ranks do): one builds, the other waits and loads."""
    script = textwrap.dedent(f"""
        import hashlib
        from workloads.pretrain.contract.schema import DataCfg
        from workloads.pretrain.data import prepare_corpus
        c = prepare_corpus(DataCfg(vocab_size=300, cache_dir={str(tmp_path)!r}))
        print(c.cache_hit, hashlib.sha256(c.tokens.tobytes()).hexdigest())
    """)
    procs = [
        subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(o[0] for o in outs) == ["False", "True"]  # exactly one built
    assert outs[0][1] == outs[1][1]
    assert [p.name for p in tmp_path.iterdir()] == [cache_key(DataCfg(vocab_size=300))]  # no tmp/lock left


# ----------------------------------------------------------------------------- sampler

TOKENS = np.arange(10_000, dtype=np.uint16)


def take(sampler: Sampler, n: int) -> list[torch.Tensor]:
    return [sampler.next_batch().inputs for _ in range(n)]


def test_batches_are_next_token_windows():
    b = Sampler(TOKENS, seq_len=16, global_batch_size=4, seed=0).next_batch()
    x, y = b.inputs, b.targets
    assert b.global_targets == 4 * 16 and b.positions is None and b.doc_ids is None
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert all(int(row[0]) % 16 == 0 for row in x)  # window starts are multiples of seq_len


def test_sampler_is_deterministic_per_seed():
    a = take(Sampler(TOKENS, 16, 4, seed=0), 5)
    b = take(Sampler(TOKENS, 16, 4, seed=0), 5)
    c = take(Sampler(TOKENS, 16, 4, seed=1), 5)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not all(torch.equal(p, q) for p, q in zip(a, c))


@pytest.mark.parametrize("world", [2, 4])
def test_global_batch_is_independent_of_world_size(world):
    single = take(Sampler(TOKENS, 16, 8, seed=0), 4)
    ranks = [take(Sampler(TOKENS, 16, 8, seed=0, dp_rank=r, dp_size=world), 4) for r in range(world)]
    for step in range(4):
        assert torch.equal(torch.cat([ranks[r][step] for r in range(world)]), single[step])


def test_resume_from_state_dict_continues_exactly():
    full = take(Sampler(TOKENS, 16, 8, seed=0), 10)
    first = Sampler(TOKENS, 16, 8, seed=0)
    take(first, 4)
    state = first.state_dict()
    resumed = Sampler(TOKENS, 16, 8, seed=0)
    resumed.load_state_dict(state)
    assert all(torch.equal(p, q) for p, q in zip(take(resumed, 6), full[4:]))
    with pytest.raises(ValueError):
        Sampler(TOKENS, 32, 8, seed=0).load_state_dict(state)


def test_an_epoch_visits_every_window_once_then_reshuffles():
    s = Sampler(TOKENS, 100, 3, seed=0)  # 99 windows
    starts = torch.cat(take(s, 33))[:, 0].tolist()
    assert sorted(starts) == [i * 100 for i in range(99)]
    assert s.epoch == 1.0
    assert torch.cat(take(s, 33))[:, 0].tolist() != starts


def test_global_batch_must_split_evenly():
    with pytest.raises(ValueError, match="divisible"):
        Sampler(TOKENS, 16, 6, seed=0, dp_size=4)


def test_val_batches_are_fixed_and_sliced_per_rank():
    full = val_batches(TOKENS, 16, 8, n_batches=3)
    assert len(full) == 3 and full[0].inputs[0, 0] == 0  # the first windows, in order
    halves = [val_batches(TOKENS, 16, 8, 3, dp_rank=r, dp_size=2) for r in range(2)]
    for b in range(3):
        assert torch.equal(torch.cat([halves[0][b].inputs, halves[1][b].inputs]), full[b].inputs)
    assert len(val_batches(TOKENS[:200], 16, 4, n_batches=10)) == 3  # clipped to what exists
    with pytest.raises(ValueError, match="val_fraction"):
        val_batches(TOKENS[:50], 16, 8, 1)
