"""Tokenize ``data.source`` into the token cache ahead of training (``llmctl data prepare``).

``python -m workloads.pretrain.prepare [--config resolved.yaml] [key=value ...]`` takes the same
config as the trainer (e.g. ``data.source='s3://b/c/*.jsonl'``; ``llmctl data prepare`` composes it),
builds the cache entry the trainer will look up (or finds it already there) and prints its path.
The trainer then starts with a cache hit; with a remote ``data.cache_dir`` other nodes download
the entry instead of tokenizing again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from workloads.pretrain.data import Corpus, prepare_corpus
from workloads.protocol.config import parse_args
from workloads.protocol.schema import DataCfg, TrainerCfg


def check_pairs(cfg: TrainerCfg, corpus: Corpus) -> None:
    """Preference pairs: a prompt longer than ``train.seq_len`` refused now, naming its line (the
    split the trainer makes raises it), so ``llmctl launch`` refuses it before a run exists."""
    if cfg.data.format == "preference":
        corpus.sequences(float(cfg.data.val_fraction), cfg.train.seq_len)


def prepare(data_cfg: DataCfg) -> Path:
    """Build (or find) the token cache for ``data_cfg`` (a DataCfg); returns its directory."""
    return prepare_corpus(data_cfg).path


def _load_config(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="python -m workloads.pretrain.prepare", description=__doc__.splitlines()[0])
    return parse_args(parser, argv)[1]


def _count(meta: dict) -> str:
    if meta.get("format") == "preference":
        return f"{meta['pairs']:,} preference pairs ({meta['target_tokens']:,} answer tokens)"
    if meta.get("format") == "sft":
        return f"{meta['examples']:,} examples ({meta['target_tokens']:,} target tokens)"
    return f"{meta['documents']:,} documents"


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    try:
        cfg = _load_config(argv)
        corpus = prepare_corpus(cfg.data)
        check_pairs(cfg, corpus)
    except (ValueError, FileNotFoundError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    meta = json.loads((corpus.path / "meta.json").read_text())
    n_files = len(meta.get("files") or []) or "builtin"
    print(
        f"prepare | data {cfg.data.name}: {cfg.data.source} | {n_files} files, {_count(meta)}, "
        f"{meta['tokens']:,} tokens, vocab {corpus.vocab_size} | {corpus.origin} in {time.perf_counter() - t0:.1f}s"
    )
    print(corpus.path)
    return 0


if __name__ == "__main__":
    from workloads.protocol.process_exit import exit_process

    exit_process(main())
