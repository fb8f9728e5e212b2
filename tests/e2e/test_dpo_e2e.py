"""SFT, then DPO from its checkpoint, through the real CLI: what a fine-tuning user runs.

A tiny model is fine-tuned on prompt/completion records (the preferred answers), exported for
transformers, and DPO starts from that export (``model.init_from``) on preference pairs. The DPO run
is stopped mid-run (SIGTERM to the controller, as ``llmctl down`` sends) and resumed with
``llmctl resume``: one MLflow run whose every step's loss equals an uninterrupted run's, and whose
held-out reward accuracy (TRL's ``val/rewards/accuracies``) rises. Its export, loaded in
transformers, prefers the chosen answers over the SFT model it started from; a LoRA DPO run's
adapters load in PEFT over that same SFT export and compute the merged export's logits.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import cli_env_at, mlflow_runs, run_cli, write_pairs
from test_resume import _losses, _pids, _start, _wait_for_step

pytestmark = pytest.mark.slow

STEPS = 12
SHAPE = ["train.batch_size=8", "train.seq_len=32", "data.val_fraction=0.25"]
DPO = [
    "data=preference",
    "train.objective=dpo",
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.val_every=6",
    "checkpoint.every=3",
    "train.lr=2e-3",
    *SHAPE,
]


@pytest.fixture(scope="module")
def env(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return cli_env_at(tmp_path_factory.mktemp("home"), cache_dir)


@pytest.fixture(scope="module")
def sft(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The pairs, and the SFT model fine-tuned on their preferred answers, exported for transformers."""
    tmp = tmp_path_factory.mktemp("sft")
    pairs = write_pairs(tmp / "pairs.jsonl")
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    records = tmp / "sft.jsonl"
    records.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["chosen"]}) + "\n" for r in rows))
    out = run_cli(
        ["launch", "model=tiny", "data=sft", f"data.source={records}", "train.steps=10", "data.vocab_size=400", *SHAPE],
        tmp,
        env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (run,) = mlflow_runs(f"sqlite:///{tmp / 'mlflow.db'}")
    export = run_cli(["export", run.info.run_id, "--out", str(tmp / "sft-hf"), "--dtype", "fp32"], tmp, env)
    assert export.returncode == 0, export.stderr[-2000:]
    return {"pairs": pairs, "hf": tmp / "sft-hf"}


def _sequence_logps(model, tokenizer, prompt: str, answer: str) -> float:
    """log p(answer + end-of-text | prompt) under a transformers model, encoded as the trainer encodes
    a pair (the prompt with the tokenizer's special tokens, the answer without)."""
    head = tokenizer(prompt)["input_ids"]
    tail = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([head + tail])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    return float(logprobs[len(head) - 1 :].gather(1, targets[len(head) - 1 :, None]).sum())


def _held_out(pairs: Path) -> list[dict]:
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    return rows[-len(rows) // 4 :]  # data.val_fraction=0.25: the pairs training never saw


def test_sft_then_dpo_stopped_and_resumed_is_one_run_whose_export_prefers_the_chosen(
    sft: dict[str, Path], env: dict[str, str], tmp_path: Path
) -> None:
    import transformers

    run_args = [f"model.init_from={sft['hf']}", f"data.source={sft['pairs']}", *DPO]
    whole = tmp_path / "whole"
    whole.mkdir()
    out = run_cli(["launch", *run_args], whole, {**env, "LLMCTL_LOSS_FILE": str(whole / "losses.jsonl")})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "objective dpo: sigmoid loss, beta 0.1 | reference frozen copy of the starting weights" in out.stdout
    reference = _losses(whole / "losses.jsonl")

    stopped = tmp_path / "stopped"
    stopped.mkdir()
    loss_file = stopped / "losses.jsonl"
    run_env = {**env, "LLMCTL_LOSS_FILE": str(loss_file)}
    proc = _start(run_args, stopped, run_env)
    _wait_for_step(loss_file, 4, proc)
    run_id, pids = _pids(stopped)
    os.kill(pids["controller"], signal.SIGTERM)
    so, se = proc.communicate(timeout=120)
    assert proc.returncode == 75, so[-2000:] + se[-2000:]
    res = run_cli(["resume", run_id], stopped, run_env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = _losses(loss_file)
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - reference[s]) for s in reference) <= 1e-6, (got, reference)

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{stopped / 'mlflow.db'}"
    (run,) = mlflow_runs(uri)
    assert run.info.run_id == run_id and run.info.status == "FINISHED" and run.data.tags["llmctl.attempt"] == "2"
    client = MlflowClient(tracking_uri=uri)
    accuracy = {m.step: m.value for m in client.get_metric_history(run_id, "val/rewards/accuracies")}
    assert accuracy[0] == 0.0 and accuracy[STEPS] >= 0.75, accuracy  # step 0: policy = reference, no margin
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(1, STEPS + 1)), key

    export = run_cli(["export", run_id, "--out", str(tmp_path / "dpo-hf"), "--dtype", "fp32"], stopped, env)
    assert export.returncode == 0, export.stderr[-2000:]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "dpo-hf"))
    policy = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dpo-hf"), dtype=torch.float32)
    start = transformers.AutoModelForCausalLM.from_pretrained(str(sft["hf"]), dtype=torch.float32)
    wins = 0
    held_out = _held_out(sft["pairs"])
    for pair in held_out:  # DPO's implicit reward: the log-ratio to the model it started from
        ratio = {
            k: _sequence_logps(policy, tokenizer, pair["prompt"], pair[k])
            - _sequence_logps(start, tokenizer, pair["prompt"], pair[k])
            for k in ("chosen", "rejected")
        }
        wins += ratio["chosen"] > ratio["rejected"]
    assert wins >= 0.75 * len(held_out), (wins, len(held_out))


def test_a_lora_dpo_runs_adapters_load_in_peft_over_the_sft_export(
    sft: dict[str, Path], env: dict[str, str], tmp_path: Path
) -> None:
    import peft
    import transformers

    args = [f"model.init_from={sft['hf']}", f"data.source={sft['pairs']}", "model.lora.rank=4", *DPO]
    out = run_cli(["launch", *args, "train.lr=1e-2", "train.steps=6", "checkpoint.every=0"], tmp_path, env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "reference the base with adapters off" in out.stdout
    (run,) = mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    for fmt in ("peft", "hf"):
        done = run_cli(
            ["export", run.info.run_id, "--format", fmt, "--out", str(tmp_path / fmt), "--dtype", "fp32"], tmp_path, env
        )
        assert done.returncode == 0, done.stderr[-2000:]
    base = transformers.AutoModelForCausalLM.from_pretrained(str(sft["hf"]), dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(sft["hf"]))
    ids = torch.tensor([tokenizer(_held_out(sft["pairs"])[0]["prompt"] + " yes")["input_ids"]])
    with torch.no_grad():
        got, want = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
        with adapted.disable_adapter():
            before = adapted(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got - before).abs().max() > 1e-3  # the adapters trained: not the SFT model
