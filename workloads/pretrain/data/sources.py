"""Where training text comes from: the bundled corpus, or the user's files through fsspec.

The bundled corpus needs no download: ``pydoc_data.topics`` (the language reference pydoc
shows) plus the docstrings of the standard library, read from source with ``ast`` so no module
is imported (imports have side effects: ``antigravity`` opens a browser, ``this`` prints).

User text: ``data.source`` is an fsspec URL, local path, directory or glob
(``s3://bucket/corpus/*.jsonl``, ``gs://...``, ``file:///data/*.txt``, ``./corpus/``) of ``.txt``
(one document per file), ``.jsonl`` (one per line, field ``data.text_field``) or ``.parquet``
(column ``data.text_field``) files, optionally ``.gz``. Files are read in sorted path order, so
the tokens (and the train/val split: the last ``data.val_fraction`` of tokens) are deterministic.
"""

from __future__ import annotations

import ast
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from workloads.protocol.records import (
    RecordError,
    format_of,
    matching_entries,
    no_files,
    not_for_sft,
    parse_line,
    text_of,
)
from workloads.protocol.schema import DataCfg

BUILTIN_SOURCE = "builtin:pydoc"
# Bump when the corpus recipe or the cache layout changes: old caches are then ignored.
CORPUS_VERSION = 1
_MIN_DOC_CHARS = 40


def load_texts(data_cfg: DataCfg) -> Iterable[str]:
    """Documents for ``data.source``, in a deterministic order (a generator for file sources)."""
    if data_cfg.source == BUILTIN_SOURCE:
        return builtin_pydoc_texts()
    return file_texts(list_source_files(data_cfg.source), data_cfg.text_field)


@dataclass(frozen=True)
class SourceFile:
    """One input file: its URL, size and version stamp (ETag, generation or mtime)."""

    url: str
    size: int
    version: str


def _version_stamp(info: dict) -> str:
    for key in (
        "ETag",
        "etag",
        "md5Hash",
        "generation",
        "mtime",
        "LastModified",
        "last_modified",
        "updated",
        "created",
    ):
        if info.get(key) not in (None, ""):
            return f"{key}={info[key]}"
    return ""


def list_source_files(source: str) -> list[SourceFile]:
    """The ``.txt/.jsonl/.parquet`` files ``data.source`` names (URL, path, directory or glob), sorted.

    Raises ``ValueError`` naming ``data.source`` if it is empty or matches no such file.
    """
    from fsspec.core import url_to_fs

    if not source or not str(source).strip():
        raise ValueError(
            "data.source is empty: set data.source=<fsspec URL, path or glob of "
            ".txt/.jsonl/.parquet files> (e.g. data.source='s3://bucket/corpus/*.jsonl')"
        )
    fs, path = url_to_fs(str(source))
    entries = matching_entries(fs, path)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    files = [
        SourceFile(
            p if protocol == "file" else fs.unstrip_protocol(p), int(info.get("size") or 0), _version_stamp(info)
        )
        for p, info in entries.items()
        if info.get("type", "file") == "file" and format_of(p)
    ]
    if not files:
        raise RecordError(no_files(source, len(entries)))
    return sorted(files, key=lambda f: f.url)


def file_texts(files: list[SourceFile], text_field: str) -> Iterator[str]:
    """Documents of ``files`` in order: a whole .txt file, each .jsonl line's / .parquet row's field."""
    import fsspec

    for f in files:
        fmt = format_of(f.url)
        with fsspec.open(f.url, "rb", compression="infer") as fh:
            if fmt == ".txt":
                text = fh.read().decode("utf-8")
                if text:
                    yield text
            elif fmt == ".jsonl":
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    where = f"{f.url}:{lineno}"
                    text = text_of(parse_line(line, where), text_field, where)
                    if text:
                        yield text
            else:  # .parquet: one column, a row group at a time
                import pyarrow.parquet as pq

                pf = pq.ParquetFile(fh)
                if text_field not in pf.schema_arrow.names:
                    raise ValueError(
                        f"{f.url}: no column data.text_field={text_field!r} "
                        f"(columns: {', '.join(pf.schema_arrow.names)})"
                    )
                for i in range(pf.num_row_groups):
                    for text in pf.read_row_group(i, columns=[text_field]).column(0).to_pylist():
                        if text:
                            yield str(text)


def file_records(files: list[SourceFile]) -> Iterator[tuple[str, Any]]:
    """(where, record) for each .jsonl line / .parquet row of ``files``, in order (fine-tuning data)."""
    import fsspec

    for f in files:
        fmt = format_of(f.url)
        if fmt == ".txt":
            raise RecordError(not_for_sft(f.url))
        with fsspec.open(f.url, "rb", compression="infer") as fh:
            if fmt == ".jsonl":
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        yield f"{f.url}:{lineno}", parse_line(line, f"{f.url}:{lineno}")
            else:
                import pyarrow.parquet as pq

                pf = pq.ParquetFile(fh)
                row = 0
                for i in range(pf.num_row_groups):
                    for rec in pf.read_row_group(i).to_pylist():
                        row += 1
                        yield f"{f.url}: row {row}", rec


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


def source_files(data_cfg: DataCfg) -> list[SourceFile] | None:
    """The listing of a file source (None for the builtin corpus)."""
    return None if data_cfg.source == BUILTIN_SOURCE else list_source_files(data_cfg.source)
