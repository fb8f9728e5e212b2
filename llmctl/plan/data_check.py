"""Data preflight: bad training data refused before a run exists (exit 3, one line naming the file,
the line where there is one, and the fix), at launch, resume and sweep launch.

A launch must not read terabytes to start, so this reads what is cheap and decisive:

- **Listing**, of every source: a ``data.source`` that matches no ``.txt/.jsonl/.parquet`` file is
  refused. A remote URL (``s3://``...) is only listed: its records are read where the job runs. A
  listing that fails *here* (no credentials on this machine, no ``s3fs``) is not a refusal, since the
  nodes may hold what this machine lacks; one line says the check was skipped.
- **Records**, of local ``.jsonl`` (and ``.jsonl.gz``) files: the first ``RECORDS_PER_FILE`` records
  of each, at most ``BYTES_BUDGET`` bytes in all, parsed by ``workloads.protocol.records``,
  the same functions the trainer's readers parse every record with (so a record refused here and one
  refused mid-build read alike). A bad record further in is still found, by the trainer, with the
  same message. ``.parquet`` needs pyarrow (the trainer's dependency): listed only.
- **The validation split** (local, uncompressed sources: their sizes are known from the listing).
  Its size in tokens is only known after tokenizing, so: a byte-level tokenizer makes at most one
  token per byte (plus the end-of-text and BOS tokens per document), and a split that cannot hold one
  validation batch even then is refused at once. Where that bound passes but a split of
  ``BYTES_PER_TOKEN_PRIOR`` bytes per token would not (a few hundred KB of text for the default batch:
  repetitive text compresses to ~5 bytes per token), and the source is small (``PREPARE_BUDGET``) and
  tokenized on this machine (``infra.kind=local``), it is tokenized now by the trainer's own
  ``prepare`` entry (a process of its own: llmctl imports no torch) into the token cache the run
  then starts from, and the exact count decides. Fine-tuning data: the examples are counted (lines);
  fewer validation examples than one batch is refused at once, otherwise packing decides, as above.
  Larger sources pass unread: any realistic corpus of more than ``PREPARE_BUDGET`` fills a validation
  batch, and tokenizing it is the job's work, not the launcher's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from llmctl.errors import ConfigError, LaunchError
from workloads.planner import data_split
from workloads.protocol import records

RECORDS_PER_FILE = 1000
BYTES_BUDGET = 64 << 20  # read at most this much to check records, over all files
PREPARE_BUDGET = 64 << 20  # tokenize a source this small now, when the byte estimate is in doubt
BYTES_PER_TOKEN_PRIOR = 8  # more than BPE vocabularies of 4k-128k make of natural text (3-5)
BUILTIN_PREFIX = "builtin:"
Say = Callable[..., None]


@dataclass(frozen=True)
class SourceFile:
    url: str  # as the trainer names it in its messages: a local path, else the full URL
    size: int
    fmt: str
    compressed: bool


def check(cfg: dict[str, Any], backend: str, say: Optional[Say] = None) -> None:
    """Refuse (ConfigError) data the run would fail on; returns when it is fine or cannot be told here."""
    data = cfg["data"]
    source = str(data.get("source") or "")
    if not source or source.startswith(BUILTIN_PREFIX):
        return
    fmt = str(data.get("format") or "text")
    sft = fmt in ("sft", "preference")  # records with fields, counted
    listed = _list(source, say)
    if listed is None:
        return
    files, local = listed
    if not local:
        return
    for f in files:
        if sft and f.fmt == ".txt":
            raise ConfigError(records.not_for_sft(f.url))
    examples = _check_records(files, fmt, str(data.get("text_field") or "text"))
    _check_val_split(cfg, files, examples, backend, say)


def check_plan(plan: Any, say: Optional[Say] = None) -> None:
    """``check`` for a plan (launch, resume); a user's program reads its own data."""
    from llmctl.config.workload import is_command

    if not is_command(plan.cfg):
        check(plan.cfg, plan.backend, say)


def _list(source: str, say: Optional[Say]) -> Optional[tuple[list[SourceFile], bool]]:
    """(files, whether they are on this machine), as the trainer's ``data.sources`` lists them;
    None when a remote source cannot be listed here (said, not refused)."""
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(source)
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        local = protocol in ("file", "local")
        entries = records.matching_entries(fs, path)
    except Exception as exc:  # credentials, a filesystem package missing: the nodes may have them
        if say is not None:
            say(
                f"llmctl: data.source not listed here ({type(exc).__name__}: {str(exc)[:200]}); the job checks"
                " it where it runs"
            )
        return None
    files = []
    for p, info in entries.items():
        fmt = records.format_of(p)
        if info.get("type", "file") != "file" or not fmt:
            continue
        url = p if local else fs.unstrip_protocol(p)
        files.append(SourceFile(url, int(info.get("size") or 0), fmt, p.lower().endswith(records.COMPRESSIONS)))
    if not files:
        raise ConfigError(records.no_files(source, len(entries)))
    return sorted(files, key=lambda f: f.url), local


def _check_records(files: list[SourceFile], fmt: str, text_field: str) -> Optional[int]:
    """Parse the first records of each ``.jsonl`` file (RecordError → ConfigError). Returns the number
    of fine-tuning examples (preference pairs) when every file was read to its end within the
    budget, else None."""
    import fsspec

    sft = fmt in ("sft", "preference")

    budget, counted = BYTES_BUDGET, 0
    whole = all(f.fmt == ".jsonl" for f in files)
    for f in files:
        if f.fmt != ".jsonl":
            continue
        with fsspec.open(f.url, "rb", compression="infer") as fh:
            parsed = 0
            for lineno, line in enumerate(fh, 1):
                budget -= len(line)
                if budget < 0 or (parsed == RECORDS_PER_FILE and not sft):  # text: no count needed
                    whole = False
                    break
                if not line.strip():
                    continue
                counted += 1
                if parsed < RECORDS_PER_FILE:
                    parsed += 1
                    where = f"{f.url}:{lineno}"
                    try:
                        rec = records.parse_line(line, where)
                        if fmt == "preference":
                            records.check_preference(rec, where)
                        elif sft:
                            records.check_example(rec, where)
                        else:
                            records.text_of(rec, text_field, where)
                    except records.RecordError as exc:
                        raise ConfigError(str(exc)) from None
        if budget < 0:
            break
    return counted if whole and sft else None


def _check_val_split(
    cfg: dict[str, Any], files: list[SourceFile], examples: Optional[int], backend: str, say: Optional[Say]
) -> None:
    data, train = cfg["data"], cfg["train"]
    vf, seq, batch = float(data["val_fraction"]), int(train["seq_len"]), int(train["batch_size"])
    if any(f.compressed or f.fmt == ".parquet" for f in files):
        return  # sizes after decompression are unknown without reading them
    size = sum(f.size for f in files)
    if str(data.get("format") or "text") == "preference":
        _check_pairs(cfg, examples)
        if backend == "local" and size <= PREPARE_BUDGET:
            _exact(
                cfg, size, say
            )  # tokenized by the trainer's prepare, which refuses a prompt longer than train.seq_len
        return
    if str(data.get("format") or "text") == "sft":
        if examples is None:
            return
        n_val = data_split.val_count(examples, vf)
        if n_val <= 0 or n_val >= examples:
            raise ConfigError(
                f"data.val_fraction={vf} of the {examples} examples in data.source={data['source']!r} leaves no"
                " validation or no training examples. Fix: data.val_fraction=<a share leaving both>, or add examples"
            )
        short = data_split.too_few_for_a_batch(n_val, seq, batch)  # a packed sequence holds >= 1 example
        if short:
            raise ConfigError(f"data.source={data['source']!r}: {short.replace(' has ', ' has at most ', 1)}")
        if n_val >= batch * seq:
            return
    else:
        bound = size + 2 * sum(1 for f in files if f.fmt == ".txt")
        short = data_split.too_few_for_a_batch(data_split.windows(data_split.val_count(bound, vf), seq), seq, batch)
        if short:
            raise ConfigError(
                f"data.source={data['source']!r} ({size:,} bytes, at most one token each):"
                f" {short.replace(' has ', ' has at most ', 1)}"
            )
        prior = size // BYTES_PER_TOKEN_PRIOR
        if data_split.windows(data_split.val_count(prior, vf), seq) >= batch:
            return
    if backend != "local" or size > PREPARE_BUDGET:
        return
    _exact(cfg, size, say)


def _check_pairs(cfg: dict[str, Any], pairs: Optional[int]) -> None:
    """Preference pairs: a validation split of at least one batch of pairs (``train.batch_size``
    counts pairs, one row each per answer: no packing, so lines decide)."""
    if pairs is None:
        return
    data, batch = cfg["data"], int(cfg["train"]["batch_size"])
    vf = float(data["val_fraction"])
    n_val = data_split.val_count(pairs, vf)
    if n_val <= 0 or n_val >= pairs or n_val < batch:
        raise ConfigError(
            f"data.val_fraction={vf} of the {pairs} pairs in data.source={data['source']!r} leaves {n_val} for"
            f" validation and {pairs - n_val} for training; validation needs one batch (train.batch_size={batch}"
            " pairs). Fix: raise data.val_fraction, lower train.batch_size, or add pairs"
        )


def _exact(cfg: dict[str, Any], size: int, say: Optional[Say]) -> None:
    """Tokenize the source now (the trainer's ``prepare``, into the cache the run starts from) and
    count the validation sequences exactly."""
    from llmctl.backends.trainer_entry import run_trainer_entry

    data, train = cfg["data"], cfg["train"]
    vf, seq, batch = float(data["val_fraction"]), int(train["seq_len"]), int(train["batch_size"])
    pairs = data.get("format") == "preference"
    if say is not None:
        why = "check its prompts fit train.seq_len" if pairs else "size its validation split"
        say(f"llmctl: tokenizing data.source now ({size:,} bytes) to {why}; the run reuses it")
    try:
        out = run_trainer_entry("prepare", cfg)
    except LaunchError as exc:  # the trainer's own message (a record past the first ones, an empty text)
        raise ConfigError(str(exc).split(": error: ", 1)[-1]) from None
    if pairs:  # prepare checked the pairs against train.seq_len
        return
    entry = Path(out.strip().splitlines()[-1])
    meta = json.loads((entry / "meta.json").read_text())
    if meta.get("format") == "sft":
        offsets = _int64_npy(entry / "offsets.npy")
        n = len(offsets) - 1
        lengths = [offsets[j + 1] - offsets[j] for j in range(n - data_split.val_count(n, vf), n)]
        sequences = len(data_split.next_fit(data_split.packed_positions(lengths, seq), seq)) - 1
    else:
        sequences = data_split.windows(data_split.val_count(int(meta["tokens"]), vf), seq)
    short = data_split.too_few_for_a_batch(sequences, seq, batch)
    if short:
        raise ConfigError(f"data.source={data['source']!r} ({int(meta['tokens']):,} tokens): {short}")


def _int64_npy(path: Path) -> list[int]:
    """A 1-d little-endian int64 ``.npy`` file (the cache's example offsets), read without numpy."""
    import ast
    import struct
    from array import array

    raw = path.read_bytes()
    if raw[:6] != b"\x93NUMPY":
        raise ValueError(f"{path} is not a .npy file")
    width = 2 if raw[6] == 1 else 4
    (header_len,) = struct.unpack("<H" if width == 2 else "<I", raw[8 : 8 + width])
    start = 8 + width + header_len
    header = ast.literal_eval(raw[8 + width : start].decode("latin1"))
    if header.get("descr") != "<i8" or header.get("fortran_order"):
        raise ValueError(f"{path}: expected little-endian int64, got {header}")
    values = array("q")
    values.frombytes(raw[start:])
    return values.tolist()
