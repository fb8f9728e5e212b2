"""Token caches built from user files (.txt/.jsonl/.parquet) through fsspec: local, glob, S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from workloads.pretrain.data import EOT, list_source_files, prepare_corpus
from workloads.pretrain.prepare import prepare
from workloads.protocol.schema import DataCfg

REPO = Path(__file__).resolve().parents[2]
DOCS = [
    "The quick brown fox jumps over the lazy dog.\nA second line, with punctuation!",
    "def f(x):\n\treturn x ** 2  # naïve café ✓",
    "Tokenizers round-trip any UTF-8 text: 日本語, emoji 🙂, tabs\tand  spaces  ",
    "Short one.",
]


def cfg(source: str, cache: Path | str, **kw) -> DataCfg:
    return DataCfg(name="files", source=source, cache_dir=str(cache), vocab_size=kw.pop("vocab_size", 400), **kw)


def documents(corpus) -> list[str]:
    """Split the token stream at EOT and decode each document."""
    eot = corpus.tokenizer.token_to_id(EOT)
    ids = np.asarray(corpus.tokens).tolist()
    assert ids[-1] == eot
    docs, cur = [], []
    for i in ids:
        if i == eot:
            docs.append(corpus.tokenizer.decode(cur))
            cur = []
        else:
            cur.append(i)
    return docs


def expected_tokens(corpus, docs: list[str]) -> int:
    return sum(len(corpus.tokenizer.encode(d).ids) + 1 for d in docs)


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> None:
    lines = [json.dumps({field: d, "id": i}) for i, d in enumerate(docs)]
    path.write_text("\n".join(lines[:1] + [""] + lines[1:]) + "\n")  # a blank line is skipped


def test_txt_files_one_document_each(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i, d in enumerate(DOCS):
        (src / f"doc{i}.txt").write_text(d, encoding="utf-8")
    corpus = prepare_corpus(cfg(str(src / "*.txt"), tmp_path / "cache"))
    assert documents(corpus) == DOCS
    assert len(corpus.tokens) == expected_tokens(corpus, DOCS)
    meta = json.loads((corpus.path / "meta.json").read_text())
    assert meta["documents"] == 4 and meta["tokens"] == len(corpus.tokens) and len(meta["files"]) == 4


def test_jsonl_uses_text_field(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", DOCS, field="content")
    corpus = prepare_corpus(cfg(f"file://{tmp_path}/a.jsonl", tmp_path / "cache", text_field="content"))
    assert documents(corpus) == DOCS
    assert len(corpus.tokens) == expected_tokens(corpus, DOCS)
    with pytest.raises(ValueError, match=r"a\.jsonl:1: no field data\.text_field='text'"):
        prepare_corpus(cfg(str(tmp_path / "a.jsonl"), tmp_path / "cache"))


def test_parquet_uses_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS, "n": list(range(4))}), tmp_path / "part-0.parquet", row_group_size=3)
    corpus = prepare_corpus(cfg(str(tmp_path), tmp_path / "cache"))  # a directory: every supported file
    assert documents(corpus) == DOCS
    assert len(corpus.tokens) == expected_tokens(corpus, DOCS)
    with pytest.raises(ValueError, match=r"no column data\.text_field='body' \(columns: text, n\)"):
        prepare_corpus(cfg(str(tmp_path / "*.parquet"), tmp_path / "cache", text_field="body"))


def test_glob_is_sorted_and_deterministic(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name, d in [("c.jsonl", DOCS[2:]), ("a.jsonl", DOCS[:1]), ("b.jsonl", DOCS[1:2])]:  # created out of order
        write_jsonl(src / name, d)
    (src / "notes.md").write_text("not a corpus file")
    files = list_source_files(str(src / "*"))
    assert [Path(f.url).name for f in files] == ["a.jsonl", "b.jsonl", "c.jsonl"]
    one = prepare_corpus(cfg(str(src / "*.jsonl"), tmp_path / "cache1"))
    two = prepare_corpus(cfg(str(src / "*.jsonl"), tmp_path / "cache2"))
    assert documents(one) == DOCS
    assert one.path.name == two.path.name and np.array_equal(one.tokens, two.tokens)
    assert (one.path / "tokenizer.json").read_text() == (two.path / "tokenizer.json").read_text()


def test_second_prepare_is_a_cache_hit_and_edits_rebuild(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    c = cfg(str(tmp_path / "*.txt"), tmp_path / "cache")
    first = prepare_corpus(c)
    assert not first.cache_hit and first.origin == "built"
    again = prepare_corpus(c)
    assert again.cache_hit and again.origin == "cache" and again.path == first.path
    assert prepare(c) == first.path
    (tmp_path / "a.txt").write_text(DOCS[0] + " Edited.")  # new size and mtime: a new key
    edited = prepare_corpus(c)
    assert not edited.cache_hit and edited.path != first.path
    assert documents(edited) == [DOCS[0] + " Edited."]
    assert prepare_corpus(cfg(str(tmp_path / "*.txt"), tmp_path / "cache", vocab_size=300)).path != edited.path


@pytest.mark.parametrize(
    "source, message",
    [
        ("", r"data\.source is empty"),
        ("{tmp}/missing/*.jsonl", r"data\.source='.*missing/\*\.jsonl' matched nothing"),
        ("{tmp}/nope.txt", r"data\.source='.*nope\.txt' matched nothing"),
        ("{tmp}/other", r"data\.source='.*other' matched 1 entries, none of them \.txt/\.jsonl/\.parquet"),
        ("{tmp}/empty/*.txt", r"data\.source='.*empty/\*\.txt': its files hold no text"),
    ],
)
def test_missing_or_empty_source_names_data_source(tmp_path, source, message):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.csv").write_text("a,b")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ValueError, match=message):
        prepare_corpus(cfg(source.format(tmp=tmp_path), tmp_path / "cache"))
    assert not list((tmp_path / "cache").glob("*/meta.json"))  # nothing half-built left behind


def test_s3_glob_and_shared_remote_cache(s3_bucket, tmp_path):
    import s3fs

    url, _ = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    for name, d in [("corpus/b.jsonl", DOCS[2:]), ("corpus/a.jsonl", DOCS[:2])]:
        write_jsonl(tmp_path / "f.jsonl", d)
        fs.put_file(str(tmp_path / "f.jsonl"), f"{url}/{name}")
    fs.pipe(f"{url}/corpus/readme.md", b"skip me")

    source = f"{url}/corpus/*.jsonl"
    files = list_source_files(source)
    assert [f.url for f in files] == [f"{url}/corpus/a.jsonl", f"{url}/corpus/b.jsonl"]
    assert all(f.version.startswith("ETag=") for f in files)

    # Node 1 tokenizes and uploads to the shared cache; node 2 (its own local cache) downloads.
    os.environ["LLMCTL_CACHE_DIR"] = str(tmp_path / "node1")
    try:
        node1 = prepare_corpus(cfg(source, f"{url}/cache"))
        assert node1.origin == "built" and node1.path.parent == tmp_path / "node1"
        assert documents(node1) == DOCS
        assert fs.exists(f"{url}/cache/{node1.path.name}/meta.json")
        os.environ["LLMCTL_CACHE_DIR"] = str(tmp_path / "node2")
        node2 = prepare_corpus(cfg(source, f"{url}/cache"))
        assert node2.origin == "downloaded" and node2.path.parent == tmp_path / "node2"
        assert np.array_equal(node1.tokens, node2.tokens)
        assert prepare_corpus(cfg(source, f"{url}/cache")).origin == "cache"
    finally:
        os.environ.pop("LLMCTL_CACHE_DIR", None)


def test_prepare_cli(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    cmd = [
        sys.executable,
        "-m",
        "workloads.pretrain.prepare",
        "data.name=files",
        f"data.source={tmp_path}/*.txt",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.vocab_size=300",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    out = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path.parent == tmp_path / "cache" and (path / "tokens.npy").is_file()
    assert "1 files, 1 documents" in out.stdout and "built" in out.stdout

    bad = subprocess.run(
        cmd[:4] + [f"data.source={tmp_path}/none/*.txt"], cwd=REPO, env=env, text=True, capture_output=True, timeout=120
    )
    assert bad.returncode == 1 and "data.source=" in bad.stderr and "matched nothing" in bad.stderr
    # presets are composition, the launcher's job: the message says how to get a config file
    preset = subprocess.run(cmd[:3] + ["data=files"], cwd=REPO, env=env, text=True, capture_output=True, timeout=120)
    assert preset.returncode == 1 and "llmctl config show data=files > run.yaml" in preset.stderr, preset.stderr
