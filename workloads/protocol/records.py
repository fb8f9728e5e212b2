"""What a valid training record is: one definition for the trainer's readers and llmctl's preflight.

Stdlib only. The trainer's readers (``data.sources``, ``data.chat``) parse every record through
these functions as they tokenize; llmctl's data preflight (``llmctl.plan.data_check``) parses the
first records of each file through the same ones before a run exists, so a record refused at
launch and one refused mid-build get the same message: ``<file>:<line>: <what is wrong>. Fix: ...``.
"""

from __future__ import annotations

import json
from typing import Any, Optional

FILE_FORMATS = (".txt", ".jsonl", ".parquet")
COMPRESSIONS = (".gz",)
FORMATS_TEXT = ".txt/.jsonl/.parquet files (optionally .gz)"


class RecordError(ValueError):
    """A record (or a source) the user can fix; the message starts with where it is (file:line)."""


def format_of(path: str) -> Optional[str]:
    """``.txt``, ``.jsonl`` or ``.parquet`` (a ``.gz`` suffix looked through), else None."""
    base = path.lower()
    for comp in COMPRESSIONS:
        if base.endswith(comp):
            base = base[: -len(comp)]
    return next((ext for ext in FILE_FORMATS if base.endswith(ext)), None)


def matching_entries(fs: Any, path: str) -> dict[str, dict]:
    """What ``data.source`` names on filesystem ``fs`` (an fsspec one, passed in: this module imports
    none): a glob's matches, a directory's files, one file, or nothing; path -> fsspec's info. The
    trainer's reader and llmctl's launch check list a source the same way."""
    if any(c in path for c in "*?["):
        return fs.glob(path, detail=True)
    if fs.isdir(path):
        return fs.find(path, detail=True)
    if fs.exists(path):
        return {path: fs.info(path)}
    return {}


def no_files(source: str, entries: int) -> str:
    """The message for a ``data.source`` that names no readable file (``entries``: what it did match)."""
    what = f"{entries} entries, none of them" if entries else "nothing; expected"
    return (
        f"data.source={source!r} matched {what} {FORMATS_TEXT}. Fix: point data.source at such files"
        " (a path, directory, glob or fsspec URL) and check its credentials"
    )


def not_for_sft(url: str) -> str:
    """The message for a ``.txt`` file under ``data.format=sft`` (records have fields; text has none)."""
    return (
        f"{url}: data.format=sft reads .jsonl (or .parquet) records of 'messages' or 'prompt'/'completion',"
        " not .txt files. Fix: convert it to .jsonl records, or data.format=text to pretrain on it"
    )


def parse_line(line: bytes | str, where: str) -> Any:
    """One ``.jsonl`` line as JSON, or RecordError naming ``where`` (``file:line``)."""
    try:
        return json.loads(line)
    except ValueError as e:
        msg = getattr(e, "msg", None) or str(e)
        raise RecordError(f"{where}: not JSON ({msg}). Fix: one JSON object per line") from None


def text_of(record: Any, text_field: str, where: str) -> str:
    """A pretraining record's text (``data.text_field``); '' when it is empty."""
    if not isinstance(record, dict) or text_field not in record:
        got = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise RecordError(
            f"{where}: no field data.text_field={text_field!r} in this record (got {got}). Fix: set"
            " data.text_field=<the field holding the text>"
        )
    value = record[text_field]
    return str(value) if value else ""


def check_example(record: Any, where: str) -> str:
    """A fine-tuning record's shape, before any tokenizer sees it: ``"messages"`` (a chat with an
    assistant turn) or ``"prompt"`` (with a completion). Returns which one."""
    if not isinstance(record, dict) or not ("messages" in record or "prompt" in record):
        got = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise RecordError(
            f"{where}: a fine-tuning record needs 'messages' (a chat) or 'prompt' and 'completion'; got {got}"
        )
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RecordError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        if not any(m["role"] == "assistant" for m in messages):
            raise RecordError(f"{where}: no assistant message, so nothing to learn from this conversation")
        return "messages"
    if "completion" not in record:
        raise RecordError(f"{where}: a 'prompt' record needs a 'completion'. Fix: add one, or drop the record")
    return "prompt"


PREFERENCE_KEYS = ("prompt", "chosen", "rejected")


def check_preference(record: Any, where: str) -> str:
    """A preference record's shape (TRL's explicit-prompt format), before any tokenizer sees it:
    ``"text"`` (``prompt``, ``chosen`` and ``rejected`` strings) or ``"messages"`` (``prompt`` a list
    of {role, content} messages, ``chosen`` and ``rejected`` the assistant's messages that follow it).
    Returns which one."""
    missing = [k for k in PREFERENCE_KEYS if not isinstance(record, dict) or k not in record]
    if missing:
        got = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise RecordError(
            f"{where}: a preference record needs 'prompt', 'chosen' and 'rejected'; {', '.join(map(repr, missing))}"
            f" missing (got {got}). Fix: add it, or drop the record"
        )
    values = [record[k] for k in PREFERENCE_KEYS]
    if all(isinstance(v, str) for v in values):
        for key in ("chosen", "rejected"):
            if not record[key].strip():
                raise RecordError(
                    f"{where}: '{key}' is empty: nothing to prefer. Fix: give it text, or drop the record"
                )
        return "text"
    if not all(isinstance(v, list) and all(isinstance(m, dict) and "role" in m for m in v) for v in values):
        raise RecordError(
            f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings, or all lists of {{role, content}}"
            " messages. Fix: give the three in one form"
        )
    for key in ("chosen", "rejected"):
        turns = record[key]
        if not turns or not all(m["role"] == "assistant" for m in turns) or not any(m.get("content") for m in turns):
            raise RecordError(
                f"{where}: '{key}' must be the assistant's non-empty answer (messages with role 'assistant')."
                " Fix: give it one, or drop the record"
            )
    return "messages"
