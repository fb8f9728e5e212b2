"""``llmctl eval`` / ``llmctl export`` end to end: a real launch, real DCP checkpoints, real sqlite MLflow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, mlflow_runs, run_cli

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
TASKS = ROOT / "examples" / "eval-tasks"  # docs/eval.md's local lm-eval tasks (multiple choice, generation)


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

    from workloads.pretrain.evaluate import load_model
    from workloads.protocol.config import load as load_config

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


def _lm_eval_oracle(hf_dir: Path, out_dir: Path, flags: list[str]) -> tuple[dict, dict[str, list[dict]]]:
    """``lm_eval --model hf`` (lm-eval's own CLI) on an export: its results and per-sample logs."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={hf_dir},dtype=auto"]
    cmd += [*flags, "--device", "cpu", "--output_path", str(out_dir), "--log_samples"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (results,) = out_dir.rglob("results_*.json")
    samples = {f.name.split("_20")[0].removeprefix("samples_"): _jsonl(f) for f in out_dir.rglob("samples_*.jsonl")}
    return json.loads(results.read_text()), samples


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_lm_eval_tasks_score_as_lm_eval_itself_on_the_export(trained) -> None:
    """``llmctl eval RUN --tasks`` (a local multiple-choice task and a local generation task, lm-eval's
    flags) logs into the run what ``lm_eval --model hf`` computes on ``llmctl export`` of the same
    step: every score and stderr equal, every sample's log-likelihoods and greedy generations equal."""
    from mlflow.tracking import MlflowClient

    cwd, env, uri, run_id = trained
    tasks = ["python_facts_mc", "python_facts_gen"]
    # the docs' tasks, but generation stops at "." only: a 10-step model's greedy text is newlines,
    # which the docs' stop ("\n") would cut to nothing, and the comparison is of the generated text
    local = cwd / "eval-tasks"
    shutil.copytree(TASKS, local, dirs_exist_ok=True)
    gen = local / "python_facts_gen.yaml"
    gen.write_text(gen.read_text().replace('until: ["\\n"]', 'until: ["."]'))
    assert 'until: ["."]' in gen.read_text()
    flags = ["--num-fewshot", "1", "--limit", "8", "--batch-size", "2"]
    out = run_cli(
        ["eval", run_id, "eval.step=9", "--tasks", ",".join(tasks), "--include-path", str(local), *flags], cwd, env
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"logged to run {run_id} at step 9" in out.stdout, out.stdout

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    logged = {
        k: v for k, v in run.data.metrics.items() if k.startswith(("eval/python_facts_mc/", "eval/python_facts_gen/"))
    }
    assert {
        "eval/python_facts_mc/acc",
        "eval/python_facts_mc/acc_stderr",
        "eval/python_facts_mc/acc_norm",
        "eval/python_facts_gen/exact_match",
    } <= set(logged), sorted(logged)
    assert all(list(_history(uri, run_id, k)) == [9] for k in logged)  # at the checkpoint's step
    assert run.data.params["lm_eval.task.python_facts_mc.version"] == "1.0"
    import lm_eval

    assert run.data.params["lm_eval.version"] == lm_eval.__version__
    # the scored export was scratch: gone, and no tag points at it
    assert not run.data.tags.get("llmctl.export.hf", "").endswith("export-hf")
    assert not list((cwd / "llmctl-runs" / run_id).glob("eval-*/export-hf"))
    ours = {
        task: _jsonl(
            Path(client.download_artifacts(run_id, f"eval/step-9/lm_eval/samples_{task}.jsonl", str(cwd / "dl")))
        )
        for task in tasks
    }

    # the oracle: lm-eval's own CLI on `llmctl export` of the same step
    hf = cwd / "hf-step9"
    exp = run_cli(["export", run_id, "--step", "9", "--dtype", "fp32", "--out", str(hf)], cwd, env)
    assert exp.returncode == 0, exp.stdout[-3000:] + exp.stderr[-3000:]
    oracle_flags = ["--tasks", ",".join(tasks), "--include_path", str(local), "--num_fewshot", "1", "--limit", "8"]
    results, theirs = _lm_eval_oracle(hf, cwd / "oracle", [*oracle_flags, "--batch_size", "2"])
    expected = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if filt == "none" and isinstance(value, float):
                expected[f"eval/{task}/{metric}"] = value
    assert expected and logged == expected  # exactly: same model, same requests, same arithmetic
    for task in tasks:
        assert len(ours[task]) == len(theirs[task]) == 8
        mine = sorted(ours[task], key=lambda r: r["doc_id"])
        for a, b in zip(mine, sorted(theirs[task], key=lambda r: r["doc_id"])):
            assert a["arguments"] == b["arguments"]  # the same prompts, few-shot examples included
            assert a["resps"] == b["resps"], (task, a["doc_id"])  # log-likelihoods / greedy text, exactly
    assert all(len(r["resps"][0][0]) > 0 for r in ours["python_facts_gen"])  # generation produced text


def test_lm_eval_bad_requests_exit_3_and_log_nothing(trained) -> None:
    """An unknown task, a Hub task where the Hub cannot be reached, --limit 0, lm-eval not installed:
    one line each, exit 3, and the run is as it was (no metric, param, tag or artifact, no eval dir)."""
    from mlflow.tracking import MlflowClient

    cwd, env, uri, run_id = trained
    client = MlflowClient(tracking_uri=uri)

    def snapshot() -> tuple:
        run = client.get_run(run_id)
        arts = sorted(a.path for a in client.list_artifacts(run_id, "eval"))
        evals = sorted(p.name for p in (cwd / "llmctl-runs" / run_id).glob("eval-*"))
        return dict(run.data.metrics), dict(run.data.params), dict(run.data.tags), arts, evals

    before = snapshot()
    poisoned = cwd / "no-lm-eval" / "lm_eval"
    poisoned.mkdir(parents=True, exist_ok=True)
    (poisoned / "__init__.py").write_text("raise ImportError('no lm-eval here')\n")
    no_lm_eval = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(poisoned.parent), env.get("PYTHONPATH")]))}
    cases = [
        (["--tasks", "python_facts_mcq", "--include-path", str(TASKS)], env, "unknown lm-eval task 'python_facts_mcq'"),
        (
            ["--tasks", "arc_easy"],
            {**env, "HF_ENDPOINT": "http://127.0.0.1:9"},
            "reads its data set 'allenai/ai2_arc' from the Hugging Face Hub",
        ),
        (["--tasks", "arc_easy"], {**env, "HF_HUB_OFFLINE": "1"}, "(HF_HUB_OFFLINE is set)"),
        (
            ["--tasks", "python_facts_mc", "--include-path", str(TASKS), "--limit", "0"],
            env,
            "--limit 0: examples per task, at least 1",
        ),
        (["--tasks", "python_facts_mc"], no_lm_eval, "pip install 'llmctl-train[eval]'"),
    ]
    for args, case_env, message in cases:
        out = run_cli(["eval", run_id, *args], cwd, case_env)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 3 and len(lines) == 1 and message in lines[0], (
            args,
            out.stdout[-2000:],
            out.stderr[-2000:],
        )
    assert snapshot() == before


def test_eval_usage_errors(trained) -> None:
    cwd, env, uri, run_id = trained
    # without transformers, scoring an export is refused before any work, naming the extra
    poisoned = cwd / "no-transformers" / "transformers"
    poisoned.mkdir(parents=True, exist_ok=True)
    (poisoned / "__init__.py").write_text("raise ImportError('no transformers here')\n")
    bare = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(poisoned.parent), env.get("PYTHONPATH")]))}
    out = run_cli(["eval", run_id, "--hf", str(cwd / "hf")], cwd, bare)
    assert out.returncode == 3 and "pip install 'llmctl-train[hf]'" in out.stderr, out.stderr
    out = run_cli(["export", run_id, "--out", str(cwd / "hf-bare")], cwd, bare)  # export itself needs none
    assert out.returncode == 0 and (cwd / "hf-bare" / "tokenizer_config.json").is_file(), out.stderr[-3000:]
    out = run_cli(["eval", run_id, "eval.max_new_tokns=3"], cwd, env)
    assert out.returncode == 3 and "Did you mean 'eval.max_new_tokens'" in out.stderr
    out = run_cli(["eval", run_id, "model=tiny"], cwd, env)
    assert out.returncode == 3 and "fixed by its checkpoint" in out.stderr
    out = run_cli(["eval", "no-such-run"], cwd, env)
    assert out.returncode == 3 and "no run 'no-such-run'" in out.stderr
    run_folder = sorted((cwd / "llmctl-runs" / run_id).iterdir())
    out = run_cli(["eval", run_id, "eval.step=7"], cwd, env)
    assert out.returncode == 3 and "never saved (checkpoint.every=3" in out.stderr and "Traceback" not in out.stderr
    assert "Complete: 9, 10." in out.stderr, out.stderr
    pruned = run_cli(["eval", run_id[:12], "eval.step=3"], cwd, env)  # saved, then deleted by checkpoint.keep
    assert pruned.returncode == 3 and "deleted: checkpoint.keep=2" in pruned.stderr, pruned.stdout + pruned.stderr
    assert "Traceback" not in pruned.stdout + pruned.stderr
    out = run_cli(["export", run_id, "--step", "6"], cwd, env)
    assert out.returncode == 3 and "deleted: checkpoint.keep=2" in out.stderr, out.stderr
    # the refusals left no eval-<time>/ scratch folder in the run's folder, and none anywhere else
    assert sorted((cwd / "llmctl-runs" / run_id).iterdir()) == run_folder
    elsewhere = cwd / "elsewhere"
    elsewhere.mkdir()
    out = run_cli(["eval", run_id, "eval.step=7", "--tracking-uri", uri], elsewhere, env)
    assert out.returncode == 3 and "never saved" in out.stderr, out.stderr
    assert list(elsewhere.iterdir()) == []
