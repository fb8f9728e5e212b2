"""``llmctl eval`` / ``llmctl export`` end to end: a real launch, real DCP checkpoints, real sqlite MLflow."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import mlflow_runs, run_cli

pytestmark = pytest.mark.slow

TRAIN = [
    "experiment=smoke",
    "train.steps=10",
    "train.val_every=5",
    "train.log_every=5",
    "train.val_batches=2",
    "checkpoint.every=3",
]  # saved at 3, 6, 9, 10; checkpoint.keep=2 leaves 9 and 10
FEW_TOKENS = ["eval.max_new_tokens=6", "eval.prompts=[The,'def ']"]


@pytest.fixture(scope="module")
def trained(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One 10-step smoke run (1 process) shared by the tests here: (cwd, env, uri, run_id)."""
    cwd = tmp_path_factory.mktemp("eval-run")
    (cwd / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LLMCTL_"))}
    env.update({"LLMCTL_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1", "HOME": str(cwd / "home")})
    out = run_cli(["launch", *TRAIN], cwd, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    uri = f"sqlite:///{cwd / 'mlflow.db'}"
    (run,) = mlflow_runs(uri)
    return cwd, env, uri, run.info.run_id


def _history(uri: str, run_id: str, key: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    return {m.step: m.value for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)}


def test_eval_equals_training_val_loss_and_logs_into_the_run(trained) -> None:
    cwd, env, uri, run_id = trained
    out = run_cli(["eval", run_id, *FEW_TOKENS], cwd, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"logged to run {run_id} at step 10" in out.stdout
    # each prompt's greedy and sampled completions, both printed (issue #34, item 10)
    shown = [ln for ln in out.stdout.splitlines() if "sample | " in ln]
    assert len(shown) == 2 and all(" -> greedy " in ln and " | sampled " in ln for ln in shown), out.stdout
    val = _history(uri, run_id, "val/loss")
    ev = _history(uri, run_id, "eval/val_loss")
    assert list(ev) == [10]
    assert abs(ev[10] - val[10]) <= 1e-5, (ev, val)
    ppl, bpb = _history(uri, run_id, "eval/perplexity")[10], _history(uri, run_id, "eval/bits_per_byte")[10]
    assert ppl == pytest.approx(2.718281828 ** ev[10], rel=1e-6)
    assert 0 < bpb < ev[10] / 0.693  # a token is more than one byte
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    path = client.download_artifacts(run_id, "eval/step-10/samples.json", str(cwd / "dl"))
    result = json.loads(Path(path).read_text())
    assert [s["prompt"] for s in result["samples"]] == ["The", "def "]
    assert all(len(s["greedy_ids"]) == 6 and len(s["sampled_ids"]) == 6 for s in result["samples"])
    assert client.get_run(run_id).data.tags["llmctl.eval.last_step"] == "10"

    # an older checkpoint, and another data set tokenized with the run's tokenizer
    text = cwd / "other.txt"
    text.write_text("A short document about nothing in particular. " * 400)
    out = run_cli(["eval", run_id, "eval.step=9", "eval.max_new_tokens=0", f"data.source={text}"], cwd, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    src = _history(uri, run_id, "eval/source/val_loss")
    assert list(src) == [9] and src[9] > 0


def test_export_loads_in_transformers_and_accelerate_eval_matches(trained) -> None:
    import torch
    import transformers

    from workloads.pretrain.contract.config import load as load_config
    from workloads.pretrain.evaluate import load_model

    cwd, env, uri, run_id = trained
    out = run_cli(["export", run_id, "--format", "hf", "--dtype", "fp32", "--out", str(cwd / "hf")], cwd, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "eval |" not in out.stdout and f"export | step 10 to {cwd / 'hf'}" in out.stdout, out.stdout
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(tracking_uri=uri).get_run(run_id).data.tags
    assert tags["llmctl.export.hf"] == str(cwd / "hf") and tags["llmctl.export.hf_step"] == "10"
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (cwd / "hf" / name).is_file(), name
    info = json.loads((cwd / "hf" / "llmctl_export.json").read_text())
    assert (info["run_id"], info["step"]) == (run_id, 10)  # provenance, written inside the atomic directory

    # logits: transformers on the export vs the native model on the checkpoint
    cfg = load_config(cwd / "llmctl-runs" / run_id / "config.yaml")
    native = load_model(cfg.model, str(Path(cfg.checkpoint.dir) / "step-10"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(cwd / "hf"), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(cwd / "hf"))
    ids = torch.tensor([tok("Return the number of items in a container.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, native(ids), atol=2e-5, rtol=1e-4)

    # the same val loss through transformers + accelerate (device_map="auto")
    out = run_cli(["eval", run_id, "--hf", str(cwd / "hf")], cwd, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    hf_loss = _history(uri, run_id, "eval/hf/val_loss")
    assert abs(hf_loss[10] - _history(uri, run_id, "val/loss")[10]) <= 1e-5


def test_eval_usage_errors(trained) -> None:
    cwd, env, uri, run_id = trained
    out = run_cli(["eval", run_id, "--tasks", "hellaswag"], cwd, env)
    assert out.returncode == 3 and "pip install lm-eval" in out.stderr
    # without transformers, scoring an export is refused before any work, naming the extra
    poisoned = cwd / "no-transformers" / "transformers"
    poisoned.mkdir(parents=True, exist_ok=True)
    (poisoned / "__init__.py").write_text("raise ImportError('no transformers here')\n")
    bare = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(poisoned.parent), env.get("PYTHONPATH")]))}
    out = run_cli(["eval", run_id, "--hf", str(cwd / "hf")], cwd, bare)
    assert out.returncode == 3 and "pip install 'llmctl[hf]'" in out.stderr, out.stderr
    out = run_cli(["export", run_id, "--out", str(cwd / "hf-bare")], cwd, bare)  # export itself needs none
    assert out.returncode == 0 and (cwd / "hf-bare" / "tokenizer_config.json").is_file(), out.stderr[-3000:]
    out = run_cli(["eval", run_id, "eval.max_new_tokns=3"], cwd, env)
    assert out.returncode == 3 and "Did you mean 'eval.max_new_tokens'" in out.stderr
    out = run_cli(["eval", run_id, "model=tiny"], cwd, env)
    assert out.returncode == 3 and "fixed by its checkpoint" in out.stderr
    out = run_cli(["eval", "no-such-run"], cwd, env)
    assert out.returncode == 3 and "no run 'no-such-run'" in out.stderr
    out = run_cli(["eval", run_id, "eval.step=7"], cwd, env)
    assert out.returncode == 3 and "never saved (checkpoint.every=3" in out.stderr and "Traceback" not in out.stderr
    assert "Complete: 9, 10." in out.stderr, out.stderr
    pruned = run_cli(["eval", run_id[:12], "eval.step=3"], cwd, env)  # saved, then deleted by checkpoint.keep
    assert pruned.returncode == 3 and "deleted: checkpoint.keep=2" in pruned.stderr, pruned.stdout + pruned.stderr
    assert "Traceback" not in pruned.stdout + pruned.stderr
    out = run_cli(["export", run_id, "--step", "6"], cwd, env)
    assert out.returncode == 3 and "deleted: checkpoint.keep=2" in out.stderr, out.stderr
