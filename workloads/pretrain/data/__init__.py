"""Training data, one job per module:

sources    the bundled corpus and the user's files (fsspec: .txt/.jsonl/.parquet, globs)
tokenizer  the byte-level BPE trained for a corpus
cache      the tokenized corpus on disk, built once and shared (``prepare_corpus``)
sampler    resumable random training windows and the fixed validation batches
"""

from workloads.pretrain.data.cache import Corpus, cache_key, prepare_corpus
from workloads.pretrain.data.sampler import Sampler, Windows, val_batches
from workloads.pretrain.data.sources import BUILTIN_SOURCE, list_source_files, load_texts
from workloads.pretrain.data.tokenizer import EOT, train_tokenizer

__all__ = [
    "BUILTIN_SOURCE",
    "EOT",
    "Corpus",
    "Sampler",
    "Windows",
    "cache_key",
    "list_source_files",
    "load_texts",
    "prepare_corpus",
    "train_tokenizer",
    "val_batches",
]
