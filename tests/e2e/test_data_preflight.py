"""Bad data is refused at launch, before a run exists: one line naming the file (and line) and the
fix, exit 3, and no MLflow store, no run directory (``llmctl.plan.data_check``). Before, each case
started a run that failed in the trainer with a traceback, a FAILED run and exit 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

SMOKE = ["experiment=smoke", "data.vocab_size=300"]
DPO = ["data=preference", "train.objective=dpo"]


def _jsonl(path: Path, records: list[object], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def _cases(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (overrides, what the one line says)."""
    docs = [{"text": f"Document {i}: the quick brown fox jumps over the lazy dog."} for i in range(3000)]
    bad = _jsonl(tmp / "bad.jsonl", docs[:50], "{not json\n")
    sft = _jsonl(tmp / "sft.jsonl", [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(20)] + [{"prompt": "?"}])
    pairs = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(40)]
    no_rejected = _jsonl(tmp / "no-rejected.jsonl", pairs[:5] + [{"prompt": "q", "chosen": "a"}] + pairs[5:])
    empty_chosen = _jsonl(tmp / "empty-chosen.jsonl", pairs[:2] + [{"prompt": "q", "chosen": " ", "rejected": "b"}])
    long_prompt = _jsonl(tmp / "long-prompt.jsonl", pairs[:3] + [dict(pairs[3], prompt="word " * 300)] + pairs[4:])
    (tmp / "empty").mkdir()
    short = _jsonl(tmp / "short.jsonl", docs)  # ~215 KB, yet 7 validation windows of 64 at val_fraction 0.01
    return {
        "malformed line": (
            ["data=files", f"data.source={bad}"],
            [f"{bad}:51: not JSON (", "Fix: one JSON object per line"],
        ),
        "prompt without completion": (
            ["data=sft", f"data.source={sft}"],
            [f"{sft}:21: a 'prompt' record needs a 'completion'", "Fix:"],
        ),
        "preference pair without rejected": (
            [*DPO, f"data.source={no_rejected}"],
            [
                f"{no_rejected}:6: a preference record needs 'prompt', 'chosen' and 'rejected'; 'rejected' missing",
                "Fix:",
            ],
        ),
        "preference pair with an empty answer": (
            [*DPO, f"data.source={empty_chosen}"],
            [f"{empty_chosen}:3: 'chosen' is empty: nothing to prefer. Fix:"],
        ),
        "preference prompt longer than seq_len": (
            [*DPO, f"data.source={long_prompt}", "train.batch_size=2", "data.val_fraction=0.1"],
            [f"{long_prompt}:4: the prompt is ", "longer than train.seq_len=64", "Fix: train.seq_len="],
        ),
        "empty directory": (
            ["data=files", f"data.source={tmp / 'empty'}"],
            [f"data.source='{tmp / 'empty'}' matched nothing", "Fix: point data.source at"],
        ),
        "validation split under a batch": (
            ["data=files", f"data.source={short}"],
            [f"data.source='{short}'", "validation split has 7 sequences of seq_len=64: fewer than one batch of 8"],
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "malformed line",
        "prompt without completion",
        "preference pair without rejected",
        "preference pair with an empty answer",
        "empty directory",
    ],
)
def test_bad_data_is_refused_before_anything_exists(case: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    overrides, says = _cases(tmp_path)[case]
    out = run_cli(["launch", *SMOKE, *overrides], tmp_path, cli_env)
    _refused(out, says, tmp_path)


@pytest.mark.slow
def test_a_validation_split_short_of_a_batch_is_refused(cli_env: dict[str, str], tmp_path: Path) -> None:
    """The byte bound cannot tell (215 KB could be 200k tokens): the source is tokenized now, into
    the cache the run would have used, and the exact count refuses it."""
    overrides, says = _cases(tmp_path)["validation split under a batch"]
    out = run_cli(["launch", *SMOKE, *overrides, "data.val_fraction=0.01"], tmp_path, cli_env)
    _refused(out, [*says, "Fix: raise data.val_fraction"], tmp_path)
    assert "tokenizing data.source now" in out.stdout


def _refused(out, says: list[str], tmp: Path) -> None:
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    for needle in says:
        assert needle in lines[0], lines[0]
    assert not (tmp / "mlflow.db").exists() and not (tmp / "mlruns").exists()
    assert not (tmp / "llmctl-runs").exists()


@pytest.mark.slow
def test_a_preference_prompt_longer_than_seq_len_is_refused_naming_its_line(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    """Only tokens tell a prompt's length: the pairs are tokenized now (the trainer's own prepare,
    into the cache the run would use), which refuses the first prompt that leaves no answer token."""
    overrides, says = _cases(tmp_path)["preference prompt longer than seq_len"]
    out = run_cli(["launch", *SMOKE, *overrides], tmp_path, cli_env)
    _refused(out, says, tmp_path)
    assert "tokenizing data.source now" in out.stdout and "to check its prompts fit train.seq_len" in out.stdout
