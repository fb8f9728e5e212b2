"""Training text, its BPE tokenizer, an on-disk token cache, and a resumable sampler.

The bundled corpus needs no download: ``pydoc_data.topics`` (the language reference pydoc
shows) plus the docstrings of the standard library, read from source with ``ast`` so no module
is imported (imports have side effects: ``antigravity`` opens a browser, ``this`` prints).

A byte-level BPE is trained on it with ``tokenizers`` and the tokenized corpus is cached in
``<cache root>/<key>/`` (``tokenizer.json``, ``tokens.npy``, ``meta.json``). The directory is built
in a temp dir and renamed into place, under an ``O_EXCL`` lock file, so concurrent ranks (or
concurrent jobs) build it once and never see a half-written cache.

Other sources (fsspec URLs/globs of .txt/.jsonl/.parquet) plug in at ``load_texts``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import shutil
import socket
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

BUILTIN_SOURCE = "builtin:pydoc"
EOT = "<|endoftext|>"
# Bump when the corpus recipe or the cache layout changes: old caches are then ignored.
CORPUS_VERSION = 1
_MIN_DOC_CHARS = 40
_LOCK_STALE_S = 3600.0


# ----------------------------------------------------------------------------- corpus text


def load_texts(data_cfg: Any) -> Iterable[str]:
    """Documents for ``data.source``. The seam for user data: add URL/glob readers here."""
    if data_cfg.source == BUILTIN_SOURCE:
        return builtin_pydoc_texts()
    raise NotImplementedError(
        f"data.source={data_cfg.source!r}: only {BUILTIN_SOURCE!r} is supported so far "
        "(fsspec URLs/globs of .txt/.jsonl/.parquet files are planned)"
    )


def builtin_pydoc_texts() -> list[str]:
    """pydoc topics + stdlib docstrings, in a fixed shuffled order (so val is like train)."""
    from pydoc_data.topics import topics

    docs = [topics[k] for k in sorted(topics)]
    docs += _stdlib_docstrings()
    docs = [d.strip() for d in docs if len(d.strip()) >= _MIN_DOC_CHARS]
    order = np.random.default_rng(CORPUS_VERSION).permutation(len(docs))
    return [docs[i] for i in order]


def _stdlib_docstrings() -> list[str]:
    """Module, class and function docstrings of stdlib source files, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = sys.stdlib_module_names
    skip_dirs = {"test", "tests", "idle_test", "__pycache__", "site-packages"}
    docs: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        top = Path(dirpath) == root
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and (not top or d in names))
        for fn in sorted(filenames):
            if not fn.endswith(".py") or (top and fn[:-3] not in names):
                continue
            try:
                tree = ast.parse(Path(dirpath, fn).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        docs.append(doc)
    return docs


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenizer): lossless on any text, no unknown tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


# ----------------------------------------------------------------------------- cache


def cache_root(data_cfg: Any) -> Path:
    """``data.cache_dir``, else ``$LLMCTL_CACHE_DIR``, else ``~/.cache/llmctl``."""
    root = getattr(data_cfg, "cache_dir", None) or os.environ.get("LLMCTL_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "llmctl"


def cache_key(data_cfg: Any) -> str:
    """What the cached tokens depend on. The builtin corpus is fixed per Python version."""
    ident = {
        "source": data_cfg.source,
        "vocab_size": int(data_cfg.vocab_size),
        "corpus_version": CORPUS_VERSION,
        "python": platform.python_version() if data_cfg.source == BUILTIN_SOURCE else None,
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return f"{data_cfg.name}-v{int(data_cfg.vocab_size)}-{digest}"


@dataclass
class Corpus:
    """A cached tokenized corpus. ``tokens`` is a read-only memmap of the whole corpus."""

    path: Path
    tokens: np.ndarray
    tokenizer: Any
    cache_hit: bool

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def split(self, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """(train, val): val is the last ``val_fraction`` of tokens, never seen in training."""
        n_val = int(len(self.tokens) * val_fraction)
        if n_val <= 0:
            raise ValueError(f"data.val_fraction={val_fraction} leaves no validation tokens")
        return self.tokens[:-n_val], self.tokens[-n_val:]


def prepare_corpus(data_cfg: Any, *, timeout_s: float = 1800.0) -> Corpus:
    """Load the cached corpus for ``data_cfg``, building it first if no process has yet."""
    from tokenizers import Tokenizer

    final = cache_root(data_cfg) / cache_key(data_cfg)
    built = _build_once(final, lambda tmp: _build(data_cfg, tmp), timeout_s)
    return Corpus(
        path=final,
        tokens=np.load(final / "tokens.npy", mmap_mode="r"),
        tokenizer=Tokenizer.from_file(str(final / "tokenizer.json")),
        cache_hit=not built,
    )


def _build(data_cfg: Any, out: Path) -> None:
    t0 = time.time()
    texts = list(load_texts(data_cfg))
    tok = train_tokenizer(texts, int(data_cfg.vocab_size))
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    dtype = np.uint16 if tok.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.uint32
    np.save(out / "tokens.npy", np.asarray(ids, dtype=dtype))
    tok.save(str(out / "tokenizer.json"))
    meta = {
        "source": data_cfg.source,
        "vocab_size": tok.get_vocab_size(),
        "documents": len(texts),
        "chars": sum(map(len, texts)),
        "tokens": len(ids),
        "text_sha256": hashlib.sha256("\x00".join(texts).encode()).hexdigest(),
        "corpus_version": CORPUS_VERSION,
        "build_seconds": round(time.time() - t0, 2),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))


def _build_once(final: Path, build, timeout_s: float) -> bool:
    """Run ``build(tmp_dir)`` and rename tmp_dir to ``final`` unless it exists; True if built here.

    Whoever creates the lock file (O_CREAT|O_EXCL) builds; the others poll for ``final``. A lock
    left by a dead process on this host (or older than an hour) is broken.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    lock = final.with_name(final.name + ".lock")
    deadline = time.monotonic() + timeout_s
    while not final.is_dir():
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if _lock_is_stale(lock):
                lock.unlink(missing_ok=True)
            elif time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f}s for another process to build {final} (lock {lock})")
            else:
                time.sleep(0.2)
            continue
        try:
            os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
            os.close(fd)
            if final.is_dir():  # finished by someone else between our check and the lock
                return False
            tmp = final.with_name(f"{final.name}.tmp-{socket.gethostname()}-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            try:
                build(tmp)
                os.rename(tmp, final)  # atomic: readers see all files or none
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return True
        finally:
            lock.unlink(missing_ok=True)
    return False


def _lock_is_stale(lock: Path) -> bool:
    try:
        host, pid = lock.read_text().split()
        age = time.time() - lock.stat().st_mtime
    except (OSError, ValueError):
        return False  # being written right now, or just removed
    if host == socket.gethostname():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
    return age > _LOCK_STALE_S


# ----------------------------------------------------------------------------- sampling


def _window(tokens: np.ndarray, index: int, seq_len: int) -> np.ndarray:
    start = index * seq_len
    return tokens[start : start + seq_len + 1]


def _to_xy(windows: list[np.ndarray], device) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.from_numpy(np.stack(windows).astype(np.int64))
    return batch[:, :-1].to(device), batch[:, 1:].to(device)


class Sampler:
    """Random windows of ``seq_len + 1`` tokens (targets never overlap), resumable exactly.

    The k-th sequence of training is window ``perm_e[k mod n]`` with ``e = k // n`` and ``perm_e``
    a permutation seeded by (seed, e). A global batch is ``global_batch_size`` consecutive k's, so
    it depends only on (seed, sequences consumed), never on the world size; data-parallel rank r
    takes the contiguous slice [r * local, (r + 1) * local). ``state_dict`` is that one counter.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch_size: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1):
        if global_batch_size % dp_size:
            raise ValueError(f"train.batch_size={global_batch_size} is not divisible by {dp_size} data-parallel ranks")
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"{len(tokens)} training tokens is less than one window of seq_len={seq_len}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.consumed = 0
        self._perms: dict[int, np.ndarray] = {}

    def _window_index(self, k: int) -> int:
        epoch, i = divmod(k, self.n_windows)
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        return int(self._perms[epoch][i])

    def next_batch(self, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets), each [local_batch, seq_len] int64; advances one step."""
        first = self.consumed + self.dp_rank * self.local_batch_size
        ks = range(first, first + self.local_batch_size)
        self.consumed += self.global_batch_size
        return _to_xy([_window(self.tokens, self._window_index(k), self.seq_len) for k in ks], device)

    @property
    def epoch(self) -> float:
        return self.consumed / self.n_windows

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seq_len", self.seq_len) != self.seq_len or state.get("seed", self.seed) != self.seed:
            raise ValueError(f"sampler state {state} does not match seq_len={self.seq_len}, seed={self.seed}")
        self.consumed = int(state["consumed"])


def val_batches(tokens: np.ndarray, seq_len: int, global_batch_size: int, n_batches: int,
                dp_rank: int = 0, dp_size: int = 1, device="cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation set: the first ``n_batches * global_batch_size`` windows, in order.

    Returns this rank's slice of each batch. Fewer batches are used if the split is short.
    """
    n_windows = (len(tokens) - 1) // seq_len
    n = min(n_batches, n_windows // global_batch_size)
    if n < 1:
        raise ValueError(
            f"validation split has {n_windows} windows of seq_len={seq_len}: fewer than one batch of "
            f"{global_batch_size}; raise data.val_fraction or lower train.batch_size"
        )
    local = global_batch_size // dp_size
    out = []
    for b in range(n):
        first = b * global_batch_size + dp_rank * local
        out.append(_to_xy([_window(tokens, k, seq_len) for k in range(first, first + local)], device))
    return out
