"""Training text, its BPE tokenizer, an on-disk token cache, and a resumable sampler.

The bundled corpus needs no download: ``pydoc_data.topics`` (the language reference pydoc
shows) plus the docstrings of the standard library, read from source with ``ast`` so no module
is imported (imports have side effects: ``antigravity`` opens a browser, ``this`` prints).

A byte-level BPE is trained on it with ``tokenizers`` and the tokenized corpus is cached in
``<cache root>/<key>/`` (``tokenizer.json``, ``tokens.npy``, ``meta.json``). The directory is built
in a temp dir and renamed into place, under an ``O_EXCL`` lock file, so concurrent ranks (or
concurrent jobs) build it once and never see a half-written cache.

User text: ``data.source`` is an fsspec URL, local path, directory or glob
(``s3://bucket/corpus/*.jsonl``, ``gs://...``, ``file:///data/*.txt``, ``./corpus/``) of ``.txt``
(one document per file), ``.jsonl`` (one per line, field ``data.text_field``) or ``.parquet``
(column ``data.text_field``) files, optionally ``.gz``. Files are read in sorted path order, so
the tokens (and the train/val split: the last ``data.val_fraction`` of tokens) are deterministic.
The cache key covers the source, the file listing with each file's size and ETag/mtime, the
vocab size, the text field and the ``tokenizers`` version: changed data means a new cache entry.

``data.cache_dir`` may itself be a URL (``s3://bucket/llmctl-cache``): entries are then built in
the local cache (``$LLMCTL_CACHE_DIR`` or ``~/.cache/llmctl``) and uploaded there, and another
node with the same key downloads them instead of tokenizing again. ``meta.json`` is uploaded
last and is what marks a remote entry complete.
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
from typing import Any, Iterable, Iterator

import numpy as np
import torch

BUILTIN_SOURCE = "builtin:pydoc"
EOT = "<|endoftext|>"
# Bump when the corpus recipe or the cache layout changes: old caches are then ignored.
CORPUS_VERSION = 1
_MIN_DOC_CHARS = 40
_LOCK_STALE_S = 3600.0
FILE_FORMATS = (".txt", ".jsonl", ".parquet")
_COMPRESSIONS = (".gz",)
# The BPE is trained on at most this many characters (the first ones, in file order); the whole
# source is still tokenized. Merges are settled long before this on any natural-language corpus.
TOKENIZER_TRAIN_CHARS = 1_000_000_000
_ENCODE_BATCH_DOCS = 1024
CACHE_FILES = ("tokenizer.json", "tokens.npy", "meta.json")  # meta.json last: the commit marker


# ----------------------------------------------------------------------------- corpus text


def load_texts(data_cfg: Any) -> Iterable[str]:
    """Documents for ``data.source``, in a deterministic order (a generator for file sources)."""
    if data_cfg.source == BUILTIN_SOURCE:
        return builtin_pydoc_texts()
    return file_texts(list_source_files(data_cfg.source), data_cfg.text_field)


# ----------------------------------------------------------------------------- file sources


@dataclass(frozen=True)
class SourceFile:
    """One input file: its URL, size and version stamp (ETag, generation or mtime)."""

    url: str
    size: int
    version: str


def _format_of(path: str) -> str | None:
    base = path.lower()
    for comp in _COMPRESSIONS:
        if base.endswith(comp):
            base = base[: -len(comp)]
    return next((ext for ext in FILE_FORMATS if base.endswith(ext)), None)


def _version_stamp(info: dict) -> str:
    for key in ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "last_modified", "updated", "created"):
        if info.get(key) not in (None, ""):
            return f"{key}={info[key]}"
    return ""


def list_source_files(source: str) -> list[SourceFile]:
    """The ``.txt/.jsonl/.parquet`` files ``data.source`` names (URL, path, directory or glob), sorted.

    Raises ``ValueError`` naming ``data.source`` if it is empty or matches no such file.
    """
    from fsspec.core import url_to_fs

    if not source or not str(source).strip():
        raise ValueError("data.source is empty: set data.source=<fsspec URL, path or glob of "
                         ".txt/.jsonl/.parquet files> (e.g. data.source='s3://bucket/corpus/*.jsonl')")
    fs, path = url_to_fs(str(source))
    if any(c in path for c in "*?["):
        entries = fs.glob(path, detail=True)
    elif fs.isdir(path):
        entries = fs.find(path, detail=True)
    elif fs.exists(path):
        entries = {path: fs.info(path)}
    else:
        entries = {}
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    files = [
        SourceFile(p if protocol == "file" else fs.unstrip_protocol(p),
                   int(info.get("size") or 0), _version_stamp(info))
        for p, info in entries.items()
        if info.get("type", "file") == "file" and _format_of(p)
    ]
    if not files:
        what = f"{len(entries)} entries, none of them" if entries else "nothing; expected"
        raise ValueError(f"data.source={source!r} matched {what} .txt/.jsonl/.parquet files "
                         f"(optionally .gz): check the path/glob and credentials")
    return sorted(files, key=lambda f: f.url)


def file_texts(files: list[SourceFile], text_field: str) -> Iterator[str]:
    """Documents of ``files`` in order: a whole .txt file, each .jsonl line's / .parquet row's field."""
    import fsspec

    for f in files:
        fmt = _format_of(f.url)
        with fsspec.open(f.url, "rb", compression="infer") as fh:
            if fmt == ".txt":
                text = fh.read().decode("utf-8")
                if text:
                    yield text
            elif fmt == ".jsonl":
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    rec = json.loads(line)
                    if not isinstance(rec, dict) or text_field not in rec:
                        raise ValueError(f"{f.url}:{lineno}: no field data.text_field={text_field!r} in this record")
                    if rec[text_field]:
                        yield str(rec[text_field])
            else:  # .parquet: one column, a row group at a time
                import pyarrow.parquet as pq

                pf = pq.ParquetFile(fh)
                if text_field not in pf.schema_arrow.names:
                    raise ValueError(f"{f.url}: no column data.text_field={text_field!r} "
                                     f"(columns: {', '.join(pf.schema_arrow.names)})")
                for i in range(pf.num_row_groups):
                    for text in pf.read_row_group(i, columns=[text_field]).column(0).to_pylist():
                        if text:
                            yield str(text)


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
    """Local cache: ``data.cache_dir`` (a path or file:// URL), else ``$LLMCTL_CACHE_DIR``, else
    ``~/.cache/llmctl``. A remote ``data.cache_dir`` (s3://...) is a shared copy on top of it."""
    root = getattr(data_cfg, "cache_dir", None)
    if root and _remote_root(data_cfg) is None:
        return Path(str(root).removeprefix("file://")).expanduser()
    root = os.environ.get("LLMCTL_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "llmctl"


def _remote_root(data_cfg: Any) -> str | None:
    root = str(getattr(data_cfg, "cache_dir", None) or "")
    return root.rstrip("/") if "://" in root and not root.startswith("file://") else None


def source_files(data_cfg: Any) -> list[SourceFile] | None:
    """The listing of a file source (None for the builtin corpus)."""
    return None if data_cfg.source == BUILTIN_SOURCE else list_source_files(data_cfg.source)


def cache_key(data_cfg: Any, files: list[SourceFile] | None = None) -> str:
    """What the cached tokens depend on: the source and, for files, every file's URL, size and
    ETag/mtime; vocab size; text field; tokenizers version. Builtin: fixed per Python version."""
    import tokenizers

    builtin = data_cfg.source == BUILTIN_SOURCE
    if not builtin and files is None:
        files = list_source_files(data_cfg.source)
    ident = {
        "source": data_cfg.source,
        "vocab_size": int(data_cfg.vocab_size),
        "corpus_version": CORPUS_VERSION,
        "tokenizers": tokenizers.__version__,
        "python": platform.python_version() if builtin else None,
        "text_field": None if builtin else data_cfg.text_field,
        "files": None if builtin else [[f.url, f.size, f.version] for f in files],
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return f"{data_cfg.name}-v{int(data_cfg.vocab_size)}-{digest}"


@dataclass
class Corpus:
    """A cached tokenized corpus. ``tokens`` is a read-only memmap of the whole corpus.

    ``origin``: "cache" (found locally), "built" (tokenized here) or "downloaded" (from a remote
    ``data.cache_dir``).
    """

    path: Path
    tokens: np.ndarray
    tokenizer: Any
    cache_hit: bool
    origin: str = "cache"

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
    """Load the cached corpus for ``data_cfg``, building (or downloading) it first if needed."""
    from tokenizers import Tokenizer

    files = source_files(data_cfg)
    key = cache_key(data_cfg, files)
    final = cache_root(data_cfg) / key
    remote = _remote_root(data_cfg)
    origin = ["built"]

    def build(tmp: Path) -> None:
        if remote and _download(f"{remote}/{key}", tmp):
            origin[0] = "downloaded"
            return
        _build(data_cfg, tmp, files)
        if remote:
            _upload(tmp, f"{remote}/{key}")

    built = _build_once(final, build, timeout_s)
    return Corpus(
        path=final,
        tokens=np.load(final / "tokens.npy", mmap_mode="r"),
        tokenizer=Tokenizer.from_file(str(final / "tokenizer.json")),
        cache_hit=not built,
        origin=origin[0] if built else "cache",
    )


def _download(remote_dir: str, out: Path) -> bool:
    """Fetch a complete remote cache entry into ``out``; False if there is none."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(remote_dir)
    if not fs.exists(f"{path}/meta.json"):
        return False
    for name in CACHE_FILES:
        fs.get_file(f"{path}/{name}", str(out / name))
    return True


def _upload(local_dir: Path, remote_dir: str) -> None:
    """Copy a built entry to the shared cache, ``meta.json`` last (readers wait for it)."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(remote_dir)
    for name in CACHE_FILES:
        fs.put_file(str(local_dir / name), f"{path}/{name}")


def _counted(texts: Iterable[str], stats: dict, max_chars: int) -> Iterator[str]:
    """``texts`` up to ``max_chars`` characters in all, counting documents and characters."""
    for text in texts:
        if stats["chars"] >= max_chars:
            return
        stats["docs"] += 1
        stats["chars"] += len(text)
        yield text


def _batched(it: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _build(data_cfg: Any, out: Path, files: list[SourceFile] | None = None) -> None:
    """Train the BPE on the source, then stream it through the tokenizer into ``tokens.npy``.

    File sources are read twice (tokenizer training, then encoding) so that no more than a batch
    of documents is ever held in memory; token ids go to disk as they are produced.
    """
    t0 = time.time()
    texts = (lambda: builtin_pydoc_texts()) if files is None else (lambda: file_texts(files, data_cfg.text_field))
    if files is None:
        docs = texts()
        texts = lambda: docs  # noqa: E731  (build the builtin list once)
    seen = {"docs": 0, "chars": 0}
    tok = train_tokenizer(_counted(texts(), seen, TOKENIZER_TRAIN_CHARS), int(data_cfg.vocab_size))
    if seen["chars"] == 0:
        raise ValueError(f"data.source={data_cfg.source!r}: its files hold no text "
                         f"(empty files, or empty data.text_field={data_cfg.text_field!r} values)")
    eot = tok.token_to_id(EOT)
    dtype = np.uint16 if tok.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.uint32
    sha = hashlib.sha256()
    n_docs = n_chars = n_tokens = 0
    raw = out / "tokens.bin"
    with open(raw, "wb") as fh:
        for batch in _batched(texts(), _ENCODE_BATCH_DOCS):
            for text, enc in zip(batch, tok.encode_batch(batch)):
                ids = np.asarray(enc.ids + [eot], dtype=dtype)
                fh.write(ids.tobytes())
                n_tokens += len(ids)
                sha.update(("\x00" if n_docs else "").encode() + text.encode())
                n_docs += 1
                n_chars += len(text)
    arr = np.lib.format.open_memmap(out / "tokens.npy", mode="w+", dtype=dtype, shape=(n_tokens,))
    src = np.memmap(raw, dtype=dtype, mode="r", shape=(n_tokens,)) if n_tokens else np.empty(0, dtype)
    for i in range(0, n_tokens, 1 << 24):
        arr[i : i + (1 << 24)] = src[i : i + (1 << 24)]
    arr.flush()
    del arr, src
    raw.unlink()
    tok.save(str(out / "tokenizer.json"))
    meta = {
        "source": data_cfg.source,
        "files": None if files is None else [{"url": f.url, "size": f.size, "version": f.version} for f in files],
        "vocab_size": tok.get_vocab_size(),
        "documents": n_docs,
        "chars": n_chars,
        "tokens": n_tokens,
        "tokenizer_train_chars": seen["chars"],
        "text_sha256": sha.hexdigest(),
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
