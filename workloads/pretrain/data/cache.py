"""The tokenized corpus on disk: built once per (source, files, vocab), shared by ranks, jobs and nodes.

A byte-level BPE is trained on the source (``tokenizer``), or a pretrained one is used
(``data.tokenizer``), and the tokenized corpus is cached in
``<cache root>/<key>/`` (``tokenizer.json``, ``tokens.npy``, ``meta.json``). The directory is built
in a temp dir and renamed into place, under an ``O_EXCL`` lock file, so concurrent ranks (or
concurrent jobs) build it once and never see a half-written cache (``build_once``). The cache key covers the
source, the file listing with each file's size and ETag/mtime, the vocab size, the text field and
the ``tokenizers`` version: changed data means a new cache entry.

``data.cache_dir`` may itself be a URL (``s3://bucket/llmctl-cache``): entries are then built in
the local cache (``$LLMCTL_CACHE_DIR`` or ``~/.cache/llmctl``) and uploaded there, and another
node with the same key downloads them instead of tokenizing again. ``meta.json`` is uploaded
last and is what marks a remote entry complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from workloads.planner import data_split
from workloads.pretrain.data.chat import ChatTemplate, ExampleError, encode_example, encode_pair, load_chat_template
from workloads.pretrain.data.preference import PairSource
from workloads.pretrain.data.sources import (
    BUILTIN_SOURCE,
    CORPUS_VERSION,
    SourceFile,
    builtin_pydoc_texts,
    file_records,
    file_texts,
    list_source_files,
    source_files,
)
from workloads.pretrain.data.tokenizer import EOT, load_pretrained, train_tokenizer
from workloads.protocol.run_contract import cache_home
from workloads.protocol.schema import DataCfg, DataFormat

# A waiter breaks the lock (and builds) when its builder shows no progress for this long.
STALL_S = 1800.0
# The BPE is trained on at most this many characters (the first ones, in file order); the whole
# source is still tokenized. Merges are settled long before this on any natural-language corpus.
TOKENIZER_TRAIN_CHARS = 1_000_000_000
_ENCODE_BATCH_DOCS = 1024
# meta.json last: the commit marker. mask.npy / offsets.npy: fine-tuning data only.
# prompts.npy / origins.txt: preference pairs only (each pair's prompt length and file:line).
CACHE_FILES = ("tokenizer.json", "tokens.npy", "mask.npy", "offsets.npy", "prompts.npy", "origins.txt", "meta.json")
# data.format values whose records are examples with a loss mask (offsets.npy, mask.npy)
FINE_TUNING = ("sft", "preference")


def cache_root(data_cfg: DataCfg) -> Path:
    """Local cache: ``data.cache_dir`` (a path or file:// URL), else ``$LLMCTL_CACHE_DIR``, else
    ``~/.cache/llmctl``. A remote ``data.cache_dir`` (s3://...) is a shared copy on top of it."""
    root = data_cfg.cache_dir
    if root and _remote_root(data_cfg) is None:
        return Path(str(root).removeprefix("file://")).expanduser()
    return cache_home()


def _remote_root(data_cfg: DataCfg) -> str | None:
    root = str(data_cfg.cache_dir or "")
    return root.rstrip("/") if "://" in root and not root.startswith("file://") else None


def cache_key(
    data_cfg: DataCfg,
    files: list[SourceFile] | None = None,
    pretrained: str | None = None,
    chat_template: str | None = None,
) -> str:
    """What the cached tokens depend on: the source and, for files, every file's URL, size and
    ETag/mtime; vocab size (or the pretrained tokenizer's own text); text field; tokenizers version;
    for fine-tuning data its format and the chat template. Builtin: fixed per Python version."""
    import tokenizers

    builtin = data_cfg.source == BUILTIN_SOURCE
    if not builtin and files is None:
        files = list_source_files(data_cfg.source)
    if data_cfg.format in FINE_TUNING:
        ident = {
            "format": DataFormat(data_cfg.format).value,
            "pretrained": pretrained,
            "chat_template": chat_template,
            "vocab_size": None if pretrained else int(data_cfg.vocab_size),
            "corpus_version": CORPUS_VERSION,
            "tokenizers": tokenizers.__version__,
            "files": [[f.url, f.size, f.version] for f in files or []],
        }
        digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
        return f"{data_cfg.name}-{DataFormat(data_cfg.format).value}-{digest}"
    if pretrained is not None:
        digest = hashlib.sha256(pretrained.encode()).hexdigest()[:12]
        return f"{data_cfg.name}-tok{digest}-{_ident_digest(data_cfg, files, builtin, tokenizers.__version__, digest)}"
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


def _ident_digest(
    data_cfg: DataCfg, files: list[SourceFile] | None, builtin: bool, version: str, tokenizer: str
) -> str:
    ident = {
        "source": data_cfg.source,
        "tokenizer": tokenizer,
        "corpus_version": CORPUS_VERSION,
        "tokenizers": version,
        "python": platform.python_version() if builtin else None,
        "text_field": None if builtin else data_cfg.text_field,
        "files": None if builtin else [[f.url, f.size, f.version] for f in files or []],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


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
    eos_token: str = EOT  # what separates documents (and ends generation): the tokenizer's end-of-text
    # fine-tuning data (data.format=sft): per token 1 where it is a target; example j is
    # tokens[offsets[j]:offsets[j + 1]]
    mask: np.ndarray | None = None
    offsets: np.ndarray | None = None
    # a chat fine-tune (most examples were chat messages): the template it was rendered with, so a
    # prompt is given to the model as a user turn and its generation prompt, as it trained
    chat_template: ChatTemplate | None = None
    # preference pairs (data.format=preference): examples 2j and 2j + 1 are pair j's chosen and
    # rejected answers after the same prompt
    pairs: "PairSource | None" = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def eos_id(self) -> int:
        """The id of the end-of-text token that closes each document."""
        return self.tokenizer.token_to_id(self.eos_token)

    def split(self, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """(train, val): val is the last ``val_fraction`` of tokens, never seen in training."""
        n_val = data_split.val_count(len(self.tokens), val_fraction)
        if n_val <= 0:
            raise ValueError(f"data.val_fraction={val_fraction} leaves no validation tokens")
        return self.tokens[:-n_val], self.tokens[-n_val:]

    def sequences(self, val_fraction: float, seq_len: int, document_mask: bool = False):
        """(train, val) training sequences: windows of the token stream (text; ``document_mask``:
        attention inside each document), or the examples packed into sequences (sft; val is the
        last ``val_fraction`` of the examples)."""
        from workloads.pretrain.data.sampler import PackedExamples, Windows

        if self.offsets is None:
            eos = self.eos_id if document_mask else None
            return tuple(Windows(part, seq_len, eos) for part in self.split(val_fraction))
        if self.pairs is not None:
            return self.pairs.split(self.tokens, self.mask, self.offsets, val_fraction, seq_len, self.eos_id)
        n = len(self.offsets) - 1
        n_val = data_split.val_count(n, val_fraction)
        if n_val <= 0 or n_val >= n:
            raise ValueError(
                f"data.val_fraction={val_fraction} of {n} examples leaves no validation or no training examples"
            )
        pad = self.eos_id
        cut = n - n_val
        return (
            PackedExamples(self.tokens, self.mask, self.offsets[: cut + 1], seq_len, pad),
            PackedExamples(self.tokens, self.mask, self.offsets[cut:], seq_len, pad),
        )


def prepare_corpus(data_cfg: DataCfg, *, stall_s: float = STALL_S) -> Corpus:
    """Load the cached corpus for ``data_cfg``, building (or downloading) it first if needed.

    A process that finds another one building waits as long as that build makes progress, and
    takes over when it has made none for ``stall_s`` seconds (``build_once``)."""
    from tokenizers import Tokenizer

    files = source_files(data_cfg)
    spec = data_cfg.tokenizer
    pretrained = load_pretrained(spec) if spec else None
    sft = data_cfg.format in FINE_TUNING
    if sft and files is None:
        raise ValueError(
            f"data.format={DataFormat(data_cfg.format).value} needs data.source=<.jsonl files of its records>,"
            " not the bundled corpus"
        )
    template = load_chat_template(spec) if sft else None
    key = cache_key(data_cfg, files, pretrained[2] if pretrained else None, template.source if template else None)
    final = cache_root(data_cfg) / key
    remote = _remote_root(data_cfg)
    origin = ["built"]

    def build(tmp: Path, progress: Callable[[], None]) -> None:
        if remote and _download(f"{remote}/{key}", tmp, progress):
            origin[0] = "downloaded"
            return
        if data_cfg.format == "preference":
            _build_preference(data_cfg, tmp, files, pretrained, template, progress)
        elif sft:
            _build_sft(data_cfg, tmp, files, pretrained, template, progress)
        else:
            _build(data_cfg, tmp, files, pretrained, progress)
        if remote:
            _upload(tmp, f"{remote}/{key}")

    built = build_once(final, build, stall_s)
    meta = json.loads((final / "meta.json").read_text())
    extra = {}
    if sft:
        extra = {"mask": np.load(final / "mask.npy", mmap_mode="r"), "offsets": np.load(final / "offsets.npy")}
        if data_cfg.format == "preference":
            extra["pairs"] = PairSource(
                np.load(final / "prompts.npy"), (final / "origins.txt").read_text(encoding="utf-8").splitlines()
            )
        if template is not None and 2 * int(meta.get("chats", 0)) >= int(meta.get("examples", 1)):
            extra["chat_template"] = template
    return Corpus(
        path=final,
        tokens=np.load(final / "tokens.npy", mmap_mode="r"),
        tokenizer=Tokenizer.from_file(str(final / "tokenizer.json")),
        cache_hit=not built,
        origin=origin[0] if built else "cache",
        eos_token=meta.get("eos_token", EOT),
        **extra,
    )


def _download(remote_dir: str, out: Path, progress: Callable[[], None] = lambda: None) -> bool:
    """Fetch a complete remote cache entry into ``out``; False if there is none."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(remote_dir)
    if not fs.exists(f"{path}/meta.json"):
        return False
    for name in CACHE_FILES:
        if fs.exists(f"{path}/{name}"):
            fs.get_file(f"{path}/{name}", str(out / name), callback=progress_callback(progress))
    return True


def _upload(local_dir: Path, remote_dir: str) -> None:
    """Copy a built entry to the shared cache, ``meta.json`` last (readers wait for it)."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(remote_dir)
    for name in CACHE_FILES:
        if (local_dir / name).exists():
            fs.put_file(str(local_dir / name), f"{path}/{name}")


def _counted(
    texts: Iterable[str], stats: dict, max_chars: int, progress: Callable[[], None] = lambda: None
) -> Iterator[str]:
    """``texts`` up to ``max_chars`` characters in all, counting documents and characters."""
    for text in texts:
        if stats["chars"] >= max_chars:
            return
        stats["docs"] += 1
        stats["chars"] += len(text)
        progress()
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


def _build(
    data_cfg: DataCfg,
    out: Path,
    files: list[SourceFile] | None = None,
    pretrained: tuple[Any, str, str] | None = None,
    progress: Callable[[], None] = lambda: None,
) -> None:
    """Train the BPE on the source (unless a pretrained tokenizer is given), then stream the source
    through the tokenizer into ``tokens.npy``, each document followed by the end-of-text token.

    File sources are read twice (tokenizer training, then encoding) so that no more than a batch
    of documents is ever held in memory; token ids go to disk as they are produced. ``progress``
    is called as documents are read and written (the BPE's merges, after its last document, are
    one call into ``tokenizers`` that reports nothing).
    """
    t0 = time.time()
    texts = (lambda: builtin_pydoc_texts()) if files is None else (lambda: file_texts(files, data_cfg.text_field))
    if files is None:
        docs = texts()
        texts = lambda: docs  # noqa: E731  (build the builtin list once)
    seen = {"docs": 0, "chars": 0}
    if pretrained is None:
        counted = _counted(texts(), seen, TOKENIZER_TRAIN_CHARS, progress)
        tok, eos = train_tokenizer(counted, int(data_cfg.vocab_size)), EOT
    else:
        tok, eos, _ = pretrained
    eot = tok.token_to_id(eos)
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
            progress()
    if n_chars == 0:
        raise ValueError(
            f"data.source={data_cfg.source!r}: its files hold no text "
            f"(empty files, or empty data.text_field={data_cfg.text_field!r} values)"
        )
    arr = np.lib.format.open_memmap(out / "tokens.npy", mode="w+", dtype=dtype, shape=(n_tokens,))
    src = np.memmap(raw, dtype=dtype, mode="r", shape=(n_tokens,)) if n_tokens else np.empty(0, dtype)
    for i in range(0, n_tokens, 1 << 24):
        arr[i : i + (1 << 24)] = src[i : i + (1 << 24)]
        progress()
    arr.flush()
    del arr, src
    raw.unlink()
    if pretrained is None:
        tok.save(str(out / "tokenizer.json"))
    else:  # byte for byte what the user gave: the export hands on the same file
        (out / "tokenizer.json").write_text(pretrained[2], encoding="utf-8")
    meta = {
        "source": data_cfg.source,
        "files": None if files is None else [{"url": f.url, "size": f.size, "version": f.version} for f in files],
        "vocab_size": tok.get_vocab_size(),
        "documents": n_docs,
        "chars": n_chars,
        "tokens": n_tokens,
        "tokenizer_train_chars": seen["chars"],
        "tokenizer": data_cfg.tokenizer,
        "eos_token": eos,
        "text_sha256": sha.hexdigest(),
        "corpus_version": CORPUS_VERSION,
        "build_seconds": round(time.time() - t0, 2),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))


def _build_sft(
    data_cfg: DataCfg,
    out: Path,
    files: list[SourceFile],
    pretrained: tuple[Any, str, str] | None,
    template: ChatTemplate | None,
    progress: Callable[[], None] = lambda: None,
) -> None:
    """Encode each fine-tuning record (``chat.encode_example``) into ``tokens.npy`` (the examples one
    after another), ``mask.npy`` (1 where a token is a target) and ``offsets.npy`` (example bounds).

    Without ``data.tokenizer`` a byte-level BPE is trained on the prompt/completion texts.
    """
    t0 = time.time()
    tok, eos = _fine_tuning_tokenizer(data_cfg, files, pretrained, ("prompt", "completion"))
    eos_id = tok.token_to_id(eos)
    examples = _Examples()
    for where, record in file_records(files):
        progress()
        examples.add(encode_example(record, tok, eos_id, template, where), where)
        examples.chats += isinstance(record, dict) and "messages" in record
    if len(examples.offsets) < 3:
        raise ValueError(
            f"data.source={data_cfg.source!r}: {len(examples.offsets) - 1} fine-tuning example(s); need at "
            f"least 2 (one for validation)"
        )
    examples.write(out, data_cfg, files, tok, eos, pretrained, template, t0)


def _build_preference(
    data_cfg: DataCfg,
    out: Path,
    files: list[SourceFile],
    pretrained: tuple[Any, str, str] | None,
    template: ChatTemplate | None,
    progress: Callable[[], None] = lambda: None,
) -> None:
    """Encode each preference record (``chat.encode_pair``) as two examples, its chosen and its
    rejected answer after the same prompt (examples 2j and 2j + 1), with each pair's prompt length
    (``prompts.npy``) and where it came from (``origins.txt``, ``file:line``): a prompt too long for
    ``train.seq_len``, known only when training starts, is refused naming its line."""
    t0 = time.time()
    tok, eos = _fine_tuning_tokenizer(data_cfg, files, pretrained, ("prompt", "chosen", "rejected"))
    eos_id = tok.token_to_id(eos)
    examples, prompts, origins = _Examples(), [], []
    for where, record in file_records(files):
        progress()
        chosen, rejected, prompt_tokens = encode_pair(record, tok, eos_id, template, where)
        examples.add(chosen, where)
        examples.add(rejected, where)
        examples.chats += 2 * isinstance(record.get("prompt"), list)
        prompts.append(prompt_tokens)
        origins.append(where)
    if len(prompts) < 2:
        raise ValueError(
            f"data.source={data_cfg.source!r}: {len(prompts)} preference pair(s); need at least 2 (one for validation)"
        )
    np.save(out / "prompts.npy", np.asarray(prompts, dtype=np.int64))
    (out / "origins.txt").write_text("\n".join(origins) + "\n", encoding="utf-8")
    examples.write(out, data_cfg, files, tok, eos, pretrained, template, t0, pairs=len(prompts))


def _fine_tuning_tokenizer(
    data_cfg: DataCfg, files: list[SourceFile], pretrained: tuple[Any, str, str] | None, fields: tuple[str, ...]
) -> tuple[Any, str]:
    """(tokenizer, its end-of-text token): the given one, else a byte-level BPE of
    ``data.vocab_size`` trained on the text records' ``fields`` (chat records use a pretrained one)."""
    if pretrained is not None:
        return pretrained[0], pretrained[1]

    def texts():
        for _, rec in file_records(files):
            if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                yield "".join(str(rec.get(k, "")) for k in fields)

    return train_tokenizer(texts(), int(data_cfg.vocab_size)), EOT


class _Examples:
    """Fine-tuning examples as they are encoded, written as ``tokens.npy``, ``mask.npy`` (1 where a
    token is a target) and ``offsets.npy`` (example bounds), with ``meta.json`` last."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.offsets = [0]
        self.targets = 0
        self.chats = 0

    def add(self, example: tuple[np.ndarray, np.ndarray], where: str) -> None:
        ids, mask = example
        if mask[1:].sum() == 0:
            raise ExampleError(f"{where}: nothing to learn: the example has no target tokens after its first token")
        self.ids.append(ids)
        self.masks.append(mask)
        self.offsets.append(self.offsets[-1] + len(ids))
        self.targets += int(mask[1:].sum())

    def write(
        self,
        out: Path,
        data_cfg: DataCfg,
        files: list[SourceFile],
        tok: Any,
        eos: str,
        pretrained: tuple[Any, str, str] | None,
        template: ChatTemplate | None,
        t0: float,
        pairs: int | None = None,
    ) -> None:
        dtype = np.uint16 if tok.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.uint32
        np.save(out / "tokens.npy", np.concatenate(self.ids).astype(dtype))
        np.save(out / "mask.npy", np.concatenate(self.masks))
        np.save(out / "offsets.npy", np.asarray(self.offsets, dtype=np.int64))
        if pretrained is None:
            tok.save(str(out / "tokenizer.json"))
        else:  # byte for byte what the user gave: the export hands on the same file
            (out / "tokenizer.json").write_text(pretrained[2], encoding="utf-8")
        meta = {
            "source": data_cfg.source,
            "format": DataFormat(data_cfg.format).value,
            "files": [{"url": f.url, "size": f.size, "version": f.version} for f in files],
            "vocab_size": tok.get_vocab_size(),
            "examples": len(self.offsets) - 1,
            **({"pairs": pairs} if pairs is not None else {}),
            "tokens": self.offsets[-1],
            "target_tokens": self.targets,
            "tokenizer": data_cfg.tokenizer,
            "eos_token": eos,
            "chat_template": template is not None,
            "chats": self.chats,  # examples that were chat messages (the rest prompt/completion): how eval prompts
            "corpus_version": CORPUS_VERSION,
            "build_seconds": round(time.time() - t0, 2),
        }
        (out / "meta.json").write_text(json.dumps(meta, indent=2))


def progress_callback(progress: Callable[[], None]):
    """An fsspec transfer callback that reports every block as progress: a download of a large
    file is then seen to advance, not to hang."""
    from fsspec.callbacks import Callback

    return Callback(hooks={"progress": lambda size, value, **kw: progress()})


def build_once(
    final: Path, build: Callable[[Path, Callable[[], None]], None], stall_s: float = STALL_S, poll_s: float = 0.2
) -> bool:
    """Run ``build(tmp_dir, progress)`` and rename tmp_dir to ``final`` unless it exists; True if
    built here.

    Whoever creates the lock file ``<final>.lock`` (O_CREAT|O_EXCL) builds; the others poll for
    ``final``. The builder's ``progress()`` calls move the lock's mtime (at most once a second),
    so a waiter waits as long as the build advances, however long it takes: a 1T-token corpus
    takes hours. A waiter breaks the lock and builds itself when the builder is dead (same host:
    its pid is gone) or has shown no progress for ``stall_s`` seconds of the waiter's own clock
    (any host: a lost node, a hung mount). Breaking is a rename of the lock to a name of the
    breaker's own, so of several waiters exactly one breaks a given lock; a builder releases only a
    lock that still names it. Two builders can then race (a stalled one may wake up): the first
    rename wins, and the loser, finding ``final`` complete, discards its own copy and returns
    False, since ``final`` is what every reader loads.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    lock = final.with_name(final.name + ".lock")
    me = f"{socket.gethostname()} {os.getpid()} {os.urandom(6).hex()}"
    seen, since = None, time.monotonic()
    while not final.is_dir():
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            state = _lock_state(lock)
            if state is None:  # just removed: look again
                continue
            if state != seen:  # new holder, or the holder moved on: restart the stall clock
                seen, since = state, time.monotonic()
            if _holder_gone(state[0]) or time.monotonic() - since > stall_s:
                _break_lock(lock, state[0], me)
                seen = None
            else:
                time.sleep(poll_s)
            continue
        try:
            os.write(fd, f"{me}\n".encode())
            os.close(fd)
            if final.is_dir():  # finished by someone else between our check and the lock
                return False
            tmp = final.with_name(f"{final.name}.tmp-{me.replace(' ', '-')}")
            tmp.mkdir()
            try:
                build(tmp, _Heartbeat(lock, min(1.0, stall_s / 10)))
                try:
                    os.rename(tmp, final)  # atomic: readers see all files or none
                except OSError:
                    if not final.is_dir():
                        raise
                    shutil.rmtree(tmp, ignore_errors=True)  # another builder's entry is in place
                    return False
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return True
        finally:
            _release_lock(lock, me)
    return False


class _Heartbeat:
    """The builder's ``progress``: moves the lock's mtime, at most every ``every`` seconds."""

    def __init__(self, lock: Path, every: float):
        self.lock, self.every, self.last = lock, every, 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            try:
                os.utime(self.lock)
            except OSError:  # broken by a waiter that judged us stalled: build on, the rename decides
                pass


def _lock_state(lock: Path) -> tuple[str, int] | None:
    """(holder, mtime_ns) of the lock, None if it is gone. A holder that died between creating
    the lock and writing its name leaves an empty one: that stalls like any other."""
    try:
        return lock.read_text().strip(), lock.stat().st_mtime_ns
    except OSError:
        return None


def _holder_gone(holder: str) -> bool:
    """True if the lock's holder ran on this host and its process is gone."""
    host, pid = (holder.split() + ["", ""])[:2]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _break_lock(lock: Path, holder: str, me: str) -> None:
    """Remove the lock ``holder`` held, and only that one: renamed aside first, then checked."""
    aside = lock.with_name(f"{lock.name}.broken-{me.split()[-1]}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:  # another waiter broke it first
        return
    try:
        if aside.read_text().strip() != holder:  # a new holder's lock, taken just now: put it back
            try:
                os.link(aside, lock)
            except OSError:  # a third process holds the lock by now; the builds' renames settle it
                pass
    finally:
        aside.unlink(missing_ok=True)


def _release_lock(lock: Path, me: str) -> None:
    try:
        if lock.read_text().strip() == me:
            lock.unlink(missing_ok=True)
    except OSError:
        pass
