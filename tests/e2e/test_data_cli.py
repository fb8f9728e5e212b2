"""``llmctl data prepare``: tokenizes a user's files once; the launch that follows hits the cache."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_cli


def test_prepare_then_cache_hit(cli_env: dict[str, str], tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": f"Document {i}: the quick brown fox jumps over the lazy dog."}) for i in range(300)]
    corpus.write_text("\n".join(lines) + "\n")
    args = ["data", "prepare", "data=files", f"data.source={corpus}", "data.vocab_size=400"]
    first = run_cli(args, tmp_path, cli_env)
    assert first.returncode == 0, first.stderr
    assert "300 documents" in first.stdout and "| built in" in first.stdout
    cache = Path(first.stdout.strip().splitlines()[-1])
    assert (cache / "meta.json").is_file()
    again = run_cli(args, tmp_path, cli_env)
    assert again.returncode == 0 and "| cache in" in again.stdout
    assert again.stdout.strip().splitlines()[-1] == str(cache)


def test_prepare_reports_bad_source_and_bad_keys(cli_env: dict[str, str], tmp_path: Path) -> None:
    missing = run_cli(["data", "prepare", "data=files", f"data.source={tmp_path}/none/*.txt"], tmp_path, cli_env)
    assert missing.returncode == 3 and "data.source" in missing.stderr and "Traceback" not in missing.stderr
    typo = run_cli(["data", "prepare", "data.sourse=x"], tmp_path, cli_env)
    assert typo.returncode == 3 and "Did you mean 'data.source'" in typo.stderr
