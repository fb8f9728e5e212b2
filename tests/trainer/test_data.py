"""Bundled corpus, tokenizer cache (built once, safely under concurrency) and the sampler."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from workloads.pretrain.data import Sampler, cache_key, load_texts, prepare_corpus, val_batches
from workloads.protocol.schema import DataCfg

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
        from workloads.protocol.schema import DataCfg
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


def test_a_1t_token_sampler_holds_no_epoch_order_in_memory():
    """1T tokens at seq 8192 (about 1.2e8 windows) on 8 ranks: building each rank's sampler and
    drawing its first 10k windows allocates kilobytes, not the 1 GB a materialised order takes."""
    import tracemalloc

    tokens = np.broadcast_to(np.uint16(0), (10**12,))  # 1T tokens in O(1) memory: only the order counts
    Sampler(TOKENS, 16, 8, seed=0).next_indices()  # lazy imports out of the measurement
    for rank in range(8):
        tracemalloc.start()
        try:
            s = Sampler(tokens, 8192, 1024, seed=0, dp_rank=rank, dp_size=8)
            mine = np.concatenate([s.next_indices()[0] for _ in range(79)])  # 79 x 128 >= 10k
            peak = tracemalloc.get_traced_memory()[1]  # the 80 kB of drawn indices included
        finally:
            tracemalloc.stop()
        assert peak < 1_000_000, f"rank {rank}: peak {peak} bytes"
        assert len(mine) >= 10_000 and s.n_windows == (10**12 - 1) // 8192
        assert mine.min() >= 0 and mine.max() < s.n_windows
        assert len(np.unique(mine)) == len(mine)  # within an epoch no window comes twice


@pytest.mark.parametrize("n", [1, 2, 3, 999, 4096, 5003])
def test_epoch_order_is_a_permutation(n):
    from workloads.pretrain.data.sampler import EpochOrder

    assert sorted(EpochOrder(n, seed=0, epoch=0).take(np.arange(n)).tolist()) == list(range(n))


def test_epoch_order_is_well_mixed_and_differs_per_epoch_and_seed():
    from workloads.pretrain.data.sampler import EpochOrder

    n = 5003
    orders = {(s, e): EpochOrder(n, s, e).take(np.arange(n)) for s in (0, 1) for e in (0, 1)}
    assert len({tuple(o.tolist()) for o in orders.values()}) == 4
    for o in orders.values():
        assert abs(np.corrcoef(np.arange(n), o)[0, 1]) < 0.05  # no trace of the input order
        assert len(set((np.diff(o) % n).tolist())) > n // 2  # not an affine map (one stride)
        assert (o == np.arange(n)).sum() < 10  # about one fixed point, as for a random permutation


def test_every_window_once_per_epoch_across_ranks_and_exact_after_restore():
    """3 ranks, 2001 windows, global batch 24: each epoch is a true permutation of the windows when
    the ranks' slices are put together, epochs differ, and a sampler restored mid-epoch (from the
    saved state, into a new process-free object) draws exactly what the uninterrupted one does."""
    tokens = np.arange(2001 * 8 + 1, dtype=np.int32)
    world, gbs, n = 3, 24, 2001
    steps = 2 * n // gbs + 3  # a bit over two epochs
    ranks = [Sampler(tokens, 8, gbs, seed=7, dp_rank=r, dp_size=world) for r in range(world)]
    drawn = np.concatenate([np.concatenate([s.next_indices()[0] for s in ranks]) for _ in range(steps)])
    first, second = drawn[:n], drawn[n : 2 * n]
    assert sorted(first.tolist()) == list(range(n)) and sorted(second.tolist()) == list(range(n))
    assert not np.array_equal(first, second)
    again = Sampler(tokens, 8, gbs, seed=8).window_indices(0, n)
    assert not np.array_equal(again, first)  # another seed, another order

    interrupted = [Sampler(tokens, 8, gbs, seed=7, dp_rank=r, dp_size=world) for r in range(world)]
    head = [np.concatenate([s.next_indices()[0] for s in interrupted]) for _ in range(40)]  # mid-epoch 0
    states = [s.state_dict() for s in interrupted]
    resumed = [Sampler(tokens, 8, gbs, seed=7, dp_rank=r, dp_size=world) for r in range(world)]
    for s, state in zip(resumed, states):
        s.load_state_dict(state)
    tail = [np.concatenate([s.next_indices()[0] for s in resumed]) for _ in range(steps - 40)]
    assert np.array_equal(np.concatenate(head + tail), drawn)


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
