"""The data preflight's choices, in-process (``llmctl.plan.data_check``): one definition of a valid
record shared with the trainer's reader, what is read and what is only listed, and which validation
splits are refused from the byte bound alone (the launch-level cases: tests/e2e/test_data_preflight.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmctl.errors import ConfigError
from llmctl.plan import data_check


def _cfg(source: str, fmt: str = "text", val_fraction: float = 0.05) -> dict[str, Any]:
    data = {"source": source, "format": fmt, "text_field": "text", "val_fraction": val_fraction}
    return {"data": data, "train": {"seq_len": 64, "batch_size": 8}}


def _said() -> tuple[list[str], Any]:
    lines: list[str] = []
    return lines, lambda text, err=False: lines.append(text)


def test_the_preflight_and_the_trainers_reader_refuse_a_record_in_the_same_words(tmp_path: Path) -> None:
    from workloads.pretrain.data.sources import file_texts, list_source_files

    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"text": "a document " * 200}) + "\n" + json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(ConfigError) as preflight:
        data_check.check(_cfg(str(src)), "local")
    with pytest.raises(ValueError) as trainer:
        list(file_texts(list_source_files(str(src)), "text"))
    assert str(preflight.value) == str(trainer.value)
    assert str(trainer.value).startswith(f"{src}:2: no field data.text_field='text'") and "Fix:" in str(trainer.value)


def test_a_split_that_cannot_hold_a_batch_even_at_a_token_a_byte_is_refused_unread(tmp_path: Path) -> None:
    src = tmp_path / "small.txt"
    src.write_text("tiny " * 400)  # 2000 bytes: at most 100 validation tokens at 5%, one batch needs 8 x 64
    lines, say = _said()
    with pytest.raises(ConfigError, match=r"has at most 1 sequences of seq_len=64: fewer than one batch of 8"):
        data_check.check(_cfg(str(src)), "local", say)
    assert lines == []  # decided from the listing's size: nothing tokenized


def test_a_source_big_enough_by_any_measure_passes_without_tokenizing(tmp_path: Path) -> None:
    src = tmp_path / "big.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 40}) + "\n" for i in range(10000)))
    lines, say = _said()
    data_check.check(_cfg(str(src)), "local", say)
    assert lines == []


def test_fine_tuning_examples_are_counted_and_txt_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) + "\n" for i in range(40)))
    with pytest.raises(ConfigError, match=r"has at most 2 sequences of seq_len=64: fewer than one batch of 8"):
        data_check.check(_cfg(str(src), "sft"), "local")
    txt = tmp_path / "notes.txt"
    txt.write_text("plain text")
    with pytest.raises(ConfigError, match=r"notes\.txt: data\.format=sft reads \.jsonl .* Fix:"):
        data_check.check(_cfg(str(txt), "sft"), "local")


def test_a_remote_source_is_listed_not_read() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/preflight/a.jsonl", b"{not json\n")
    data_check.check(_cfg("memory://preflight/*.jsonl"), "local")  # its records are the job's to read
    with pytest.raises(ConfigError, match=r"data\.source='memory://preflight/\*\.txt' matched nothing"):
        data_check.check(_cfg("memory://preflight/*.txt"), "local")
    fs.rm("/preflight", recursive=True)
