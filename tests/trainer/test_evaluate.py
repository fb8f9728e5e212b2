"""The eval workload: resharded checkpoint loads, metric definitions, generation on loaded weights."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workloads.pretrain.evaluate import finish_metrics, load_model, resolve_step_dir, token_byte_lengths
from workloads.pretrain.model.generate import generate


def test_token_byte_lengths_sum_to_the_utf8_bytes_of_the_text() -> None:
    from workloads.pretrain.data import EOT, train_tokenizer

    text = "Plain ASCII, café crème, naïve — 中文字符 and emoji 🎉. " * 20
    tok = train_tokenizer([text], 300)
    table = token_byte_lengths(tok)
    ids = tok.encode(text).ids
    assert int(table[ids].sum()) == len(text.encode("utf-8"))
    assert table[tok.token_to_id(EOT)] == 0  # the separator is not text


def test_metric_definitions() -> None:
    m = finish_metrics(nats=200.0, tokens=100.0, nbytes=400.0)
    assert m["val_loss"] == 2.0 and m["perplexity"] == pytest.approx(math.exp(2.0))
    assert m["bits_per_byte"] == pytest.approx(200.0 / math.log(2) / 400.0)


def test_loaded_checkpoint_has_the_weights_and_cached_generation_matches(tmp_path: Path, make_tiny_cfg) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from workloads.pretrain.model.transformer import build_model

    cfg = make_tiny_cfg()
    torch.manual_seed(7)
    saved = build_model(cfg.model)
    step_dir = tmp_path / "ck" / "step-3"
    dcp.save(
        {"model": get_model_state_dict(saved), "optim": {"x": torch.ones(2)}}, checkpoint_id=str(step_dir), no_dist=True
    )
    (step_dir / ".complete").write_text("{}")
    path, step = resolve_step_dir(str(tmp_path / "ck"), None)
    assert (path, step) == (str(step_dir), 3)
    torch.manual_seed(8)  # a different init: every weight must come from the checkpoint
    loaded = load_model(cfg.model, path)
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    prompt = torch.randint(0, cfg.model.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(generate(loaded, prompt, 24, use_cache=True), generate(loaded, prompt, 24, use_cache=False))
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_step_dir(str(tmp_path / "ck"), 4)


@pytest.mark.slow
def test_two_rank_fsdp_checkpoint_evaluates_the_same_in_one_and_two_processes(
    tmp_path: Path, write_tiny_config, workload_env, workload
) -> None:
    """Train 2 ranks (FSDP, dp_shard=2) with checkpoints; eval at world size 1 and 2 equals training;
    the export of that sharded checkpoint (one process, tensor by tensor, in shards) computes in
    transformers what the checkpoint computes."""
    cfg = write_tiny_config(
        **{
            "train.steps": 6,
            "train.val_every": 3,
            "checkpoint.dir": str(tmp_path / "ck"),
            "checkpoint.every": 3,
            "eval.max_new_tokens": 4,
            "eval.prompts": "[The]",
        }
    )
    loss_file = tmp_path / "loss.jsonl"
    out = workload.run(
        ["--config", str(cfg)], {**workload_env, "LLMCTL_LOSS_FILE": str(loss_file)}, launcher=workload.torchrun(2)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    trained = workload.loss_file(loss_file)["val"]
    results = {}
    for nproc in (1, 2):
        res = tmp_path / f"eval-{nproc}.json"
        launcher = workload.torchrun(nproc) if nproc > 1 else [sys.executable]
        cmd = launcher + ["-m", "workloads.pretrain.evaluate", "--config", str(cfg), "--out", str(res)]
        done = subprocess.run(
            cmd, cwd=Path(__file__).resolve().parents[2], env=workload_env, text=True, capture_output=True, timeout=300
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        results[nproc] = json.loads(res.read_text())
    one, two = results[1]["metrics"], results[2]["metrics"]
    assert results[1]["step"] == results[2]["step"] == 6 and results[2]["world_size"] == 2
    assert abs(one["val_loss"] - trained[6]) <= 1e-5
    assert abs(two["val_loss"] - trained[6]) <= 1e-5
    assert abs(one["val_loss"] - two["val_loss"]) <= 1e-5
    assert one["tokens"] == two["tokens"] and one["bytes"] == two["bytes"]
    assert results[1]["samples"][0]["greedy_ids"] == results[2]["samples"][0]["greedy_ids"]

    transformers = pytest.importorskip("transformers")
    from workloads.protocol.config import load

    hf_dir = tmp_path / "hf"
    cmd = [sys.executable, "-m", "workloads.pretrain.evaluate", "--config", str(cfg), "--export-hf", str(hf_dir)]
    cmd += ["--export-dtype", "fp32", "--export-max-shard-size", "200000"]
    done = subprocess.run(
        cmd, cwd=Path(__file__).resolve().parents[2], env=workload_env, text=True, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert len(list(hf_dir.glob("model-*.safetensors"))) > 2 and (hf_dir / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    native = load_model(load(str(cfg)).model, str(tmp_path / "ck" / "step-6"))
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # fp32 tolerance: same math, different kernels/association order
        torch.testing.assert_close(hf(tokens).logits, native(tokens), atol=2e-5, rtol=1e-4)
