"""LoRA and QLoRA fine-tunes of a Hugging Face checkpoint through the real CLI: ``llmctl launch`` on
one process, FSDP over 2 gloo ranks and TP over 2; a run failed at step 4 and ``llmctl resume``d
from its step-2 checkpoint recomputes step 3 bit for bit and finishes with the losses of the run
that was never interrupted; ``llmctl export --format peft`` loads in PEFT and ``--format hf``
(adapters merged) in transformers, each computing llmctl's logits, with the checkpoint's BOS/EOS
and chat template.

Launches are shared (module fixtures) and few: per method a 1-process reference that is exported,
and a 2-rank FSDP run that is failed and resumed; under TP a LoRA run and a QLoRA run that is
failed and resumed. Losses across layouts agree to 1e-5 (test_lora's tolerance: the same sums in
another order); a step recomputed on the same layout after a resume equals its first value
exactly; logits to atol 2e-5 / rtol 1e-4 (test_hf_init's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import cli_env_at, mlflow_runs, run_cli

pytestmark = pytest.mark.slow

VOCAB = 512
SHAPES = {  # QLoRA quantizes groups of 64 x 256 weights: its base's linears hold whole groups
    "lora": dict(hidden_size=64, intermediate_size=160),
    "qlora": dict(hidden_size=256, intermediate_size=512),
}
COMMON = dict(
    vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256
)
METHOD = {
    "lora": ["model.lora.rank=4", "model.lora.alpha=8"],
    "qlora": ["model.lora.rank=4", "model.lora.quantize_base=nf4"],
}
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
STEPS = 4
ATOL, RTOL, LOSS_TOL = 2e-5, 1e-4, 1e-5


def _tokenizer():
    """A trained byte-level BPE whose BOS is "<|begin|>" and EOS "<|end|>", with a chat template."""
    from pydoc_data.topics import topics

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|begin|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)], trainer)
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>")
    out.chat_template = TEMPLATE
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path):
    import transformers

    root = tmp_path_factory.mktemp("lora-e2e")
    tok = _tokenizer()
    bases = {}
    for method, shape in SHAPES.items():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**COMMON, **shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        bases[method] = root / f"base-{method}"
        transformers.LlamaForCausalLM(cfg).save_pretrained(str(bases[method]))
        tok.save_pretrained(str(bases[method]))
    return {"root": root, "env": cli_env_at(root / "home", cache_dir), "bases": bases, "tok": tok, "runs": {}}


def _args(work, method: str, *extra: str) -> list[str]:
    return [
        "launch",
        f"model.init_from={work['bases'][method]}",
        *METHOD[method],
        f"data.vocab_size={VOCAB}",
        f"train.steps={STEPS}",
        "train.seq_len=32",
        "train.batch_size=4",
        "train.log_every=1",
        "train.val_every=0",
        "train.val_batches=1",
        "checkpoint.every=2",
        *extra,
    ]


def _all_losses(path: Path) -> dict[int, list[float]]:
    """Every train loss logged per step, in order (a step recomputed after a resume has two)."""
    out: dict[int, list[float]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "train/loss" in rec:
            out.setdefault(int(rec["step"]), []).append(float(rec["train/loss"]))
    return out


def _losses(path: Path) -> dict[int, float]:
    """Train loss per step; a step recomputed after a resume keeps its last value."""
    return {step: values[-1] for step, values in _all_losses(path).items()}


def _launch(work, name: str, method: str, *extra: str, fail_at: int | None = None):
    """One launch in its own directory; returns (process, run id, loss file)."""
    cwd = work["root"] / name
    cwd.mkdir()
    loss_file = cwd / "losses.jsonl"
    env = {**work["env"], "LLMCTL_LOSS_FILE": str(loss_file)}
    if fail_at:
        env["LLMCTL_FAIL_AT_STEP"] = str(fail_at)
    out = run_cli(_args(work, method, *extra), cwd, env)
    runs = mlflow_runs(f"sqlite:///{cwd / 'mlflow.db'}")
    return out, (runs[0].info.run_id if runs else None), loss_file, cwd


@pytest.fixture(scope="module")
def reference(work):
    """Per method: the uninterrupted 1-process run (run id, losses, directory)."""
    out = {}
    for method in METHOD:
        proc, rid, losses, cwd = _launch(work, f"ref-{method}", method)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "pretrain | lora rank 4" in proc.stdout and ("NF4" in proc.stdout) == (method == "qlora")
        # torchao's CUDA extensions this CPU cannot load, torch's register_constant deprecation: not shown
        said = proc.stdout + proc.stderr
        assert "Failed to load" not in said and "register_constant" not in said, said[-3000:]
        out[method] = (rid, _losses(losses), cwd)
    return out


def _close(got: dict[int, float], want: dict[int, float], what: str) -> None:
    assert sorted(got) == sorted(want), (what, got, want)
    for step, loss in want.items():
        assert abs(got[step] - loss) <= LOSS_TOL, (what, step, got[step], loss)


def _fail_and_resume(work, name: str, method: str, *layout: str) -> tuple[dict[int, float], Path, str]:
    """A launch failed at the start of step 4 (its last checkpoint: step 2), then ``llmctl resume``d:
    asserts the resume recomputed step 3 exactly as the failed attempt did; returns (losses, cwd, run)."""
    proc, rid, losses, cwd = _launch(work, name, method, *layout, fail_at=4)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    env = {**work["env"], "LLMCTL_LOSS_FILE": str(losses)}
    res = run_cli(["resume", rid], cwd, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "resumed from step 2" in res.stdout
    every = _all_losses(losses)
    assert len(every[3]) == 2 and every[3][0] == every[3][1], (name, every)  # bit for bit, not within a tolerance
    assert [len(every[s]) for s in (1, 2, 4)] == [1, 1, 1], (name, every)
    return _losses(losses), cwd, rid


@pytest.mark.parametrize("method", list(METHOD))
def test_fsdp_run_failed_and_resumed_matches_the_uninterrupted_one(work, reference, method: str) -> None:
    losses, cwd, rid = _fail_and_resume(work, f"fsdp-{method}", method, "parallel=fsdp2")
    _close(losses, reference[method][1], f"{method} fsdp2 resumed")
    step = next((cwd / "llmctl-runs").glob("*/checkpoints/step-4"), None) or _step_dir(cwd, rid, 4)
    from workloads.pretrain.checkpoint.tensor_source import DcpSource

    assert all(".lora_" in name for name in DcpSource(str(step)).specs())  # no base in the checkpoint


def _step_dir(cwd: Path, rid: str, step: int) -> Path:
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(cwd / "llmctl-runs" / rid / "config.yaml")
    return Path(str(cfg.checkpoint.dir)) / f"step-{step}"


def test_tp_trains_lora_and_qlora_as_one_process_does(work, reference) -> None:
    """TP over 2: LoRA uninterrupted; QLoRA (rowwise targets keep the whole NF4 weight, colwise ones
    their rows of it: ``nf4.TensorParallelNF4Linear``) failed, resumed, and the same losses."""
    proc, _, losses, _ = _launch(work, "tp-lora", "lora", "parallel=tp2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _close(_losses(losses), reference["lora"][1], "lora tp2")
    losses, _, _ = _fail_and_resume(work, "tp-qlora", "qlora", "parallel=tp2")
    _close(losses, reference["qlora"][1], "qlora tp2 resumed")


def _llmctl_logits(cwd: Path, rid: str, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    """The run's model at its last step, as the trainer builds it (base from init_from, adapters
    from the checkpoint), in this process."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from workloads.pretrain.train import init_distributed, load_pretrained
    from workloads.protocol.config import load

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg = load(str(cwd / "llmctl-runs" / rid / "config.yaml"))
    try:
        model = load_pretrained(cfg, init_distributed(cfg))
        options = StateDictOptions(ignore_frozen_params=True, strict=False)
        state = {"model": get_model_state_dict(model, options=options)}
        dcp.load(state, checkpoint_id=str(_step_dir(cwd, rid, STEPS)))
        set_model_state_dict(model, state["model"], options=options)
        with torch.no_grad():
            return model(x)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _nf4_round_trip(model: torch.nn.Module, targets: list[str]) -> None:
    """The QLoRA base as its run computed with it: every target linear's weight quantized by
    torchao's ``to_nf4`` (64-weight blocks, scales in groups of 256: bitsandbytes' QLoRA defaults)
    and dequantized, as a bitsandbytes ``Linear4bit`` base dequantizes in each forward."""
    from workloads.pretrain.model.nf4 import _torchao

    to_nf4 = _torchao().to_nf4
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
                module.weight.copy_(to_nf4(module.weight.detach().contiguous(), 64, 256).get_original_weight())


@pytest.mark.parametrize("method", list(METHOD))
def test_exports_compute_llmctls_logits(work, reference, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import peft
    import transformers

    rid, _, cwd = reference[method]
    base = work["bases"][method]
    env = work["env"]
    out = run_cli(["export", rid, "--format", "peft", "--out", str(cwd / "peft")], cwd, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    out = run_cli(["export", rid, "--dtype", "fp32", "--out", str(cwd / "hf")], cwd, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    x = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    want = _llmctl_logits(cwd, rid, x, monkeypatch)
    conf = json.loads((cwd / "peft" / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str(base) and conf["r"] == 4 and conf["peft_type"] == "LORA"
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(cwd / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, want, atol=ATOL, rtol=RTOL)
        if method == "qlora":  # its adapters were trained on the NF4 base: PEFT's base is quantized alike
            _nf4_round_trip(hf_base, conf["target_modules"])
        adapted = peft.PeftModel.from_pretrained(hf_base, str(cwd / "peft")).eval()
        torch.testing.assert_close(adapted(input_ids=x).logits, want, atol=ATOL, rtol=RTOL)

    tok = transformers.AutoTokenizer.from_pretrained(str(cwd / "hf"))
    assert (tok.bos_token, tok.eos_token) == ("<|begin|>", "<|end|>")
    assert (merged.config.bos_token_id, merged.config.eos_token_id) == (
        work["tok"].bos_token_id,
        work["tok"].eos_token_id,
    )
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "<|user|>hi<|end|>"


def test_peft_export_of_a_full_fine_tune_is_refused(work, tmp_path: Path) -> None:
    out = run_cli(["export", str(tmp_path / "ck"), "--format", "peft"], tmp_path, work["env"])
    assert out.returncode == 3 and "model.lora.rank=0" in out.stderr.strip().splitlines()[-1], out.stderr
    assert not (tmp_path / "llmctl-runs").exists() or not any((tmp_path / "llmctl-runs").iterdir())


def test_lm_eval_scores_of_a_lora_run_are_lm_evals_through_peft(work, reference) -> None:
    """``llmctl eval RUN --tasks`` on a LoRA run (its adapters merged into the export it scores) gives
    the scores lm-eval's own ``hf`` model gives with the adapters applied by PEFT over the base
    (``--model_args pretrained=BASE,peft=ADAPTERS``): accuracies equal, each choice's log-likelihood
    to 1e-4 (merged vs. adapter arithmetic, in fp32)."""
    import subprocess
    import sys

    from helpers import ROOT
    from mlflow.tracking import MlflowClient

    rid, _, cwd = reference["lora"]
    env, tasks = work["env"], ROOT / "examples" / "eval-tasks"
    flags = ["--tasks", "python_facts_mc", "--limit", "6"]
    out = run_cli(["eval", rid, *flags, "--include-path", str(tasks)], cwd, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{cwd / 'mlflow.db'}")
    ours = client.get_run(rid).data.metrics
    path = client.download_artifacts(rid, f"eval/step-{STEPS}/lm_eval/samples_python_facts_mc.jsonl", str(cwd / "dl"))
    our_samples = [json.loads(line) for line in Path(path).read_text().splitlines()]

    peft_dir = cwd / "peft-for-lm-eval"
    done = run_cli(["export", rid, "--format", "peft", "--out", str(peft_dir)], cwd, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    model_args = f"pretrained={work['bases']['lora']},peft={peft_dir},dtype=float32"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", model_args, *flags]
    cmd += ["--include_path", str(tasks), "--device", "cpu", "--output_path", str(cwd / "oracle"), "--log_samples"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (results,) = (cwd / "oracle").rglob("results_*.json")
    theirs = json.loads(results.read_text())["results"]["python_facts_mc"]
    for metric in ("acc", "acc_norm"):
        assert ours[f"eval/python_facts_mc/{metric}"] == theirs[f"{metric},none"], metric
    (samples,) = (cwd / "oracle").rglob("samples_python_facts_mc_*.jsonl")
    their_samples = {r["doc_id"]: r for r in map(json.loads, samples.read_text().splitlines())}
    assert len(our_samples) == len(their_samples) == 6
    for row in our_samples:
        mine = [float(r[0][0]) for r in row["resps"]]
        other = [float(r[0][0]) for r in their_samples[row["doc_id"]]["resps"]]
        assert mine == pytest.approx(other, abs=1e-4), row["doc_id"]


def test_a_peft_export_of_a_base_without_a_tokenizer_stands_on_its_own(
    work, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A base saved without a tokenizer (the run trains its own BPE) and named by a relative path: the
    PEFT export ships the run's tokenizer and generation config, names the base by its absolute path,
    and says that the base's generation config stops at another EOS (LlamaConfig's default 2). Loaded
    from another directory with ``AutoPeftModelForCausalLM``, it generates the merged export's tokens."""
    import peft
    import transformers

    torch.manual_seed(0)
    cwd = work["root"] / "bare"
    (cwd / "bases").mkdir(parents=True)
    bare = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, **SHAPES["lora"]))
    bare.save_pretrained(str(cwd / "bases" / "bare"))  # no tokenizer; generation_config.json says eos 2
    args = [a for a in _args(work, "lora") if not a.startswith("model.init_from=")]
    out = run_cli([*args, "model.init_from=bases/bare"], cwd, work["env"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run,) = mlflow_runs(f"sqlite:///{cwd / 'mlflow.db'}")
    rid = run.info.run_id
    peft_out = run_cli(["export", rid, "--format", "peft", "--out", "peft"], cwd, work["env"])
    assert peft_out.returncode == 0, peft_out.stdout[-3000:] + peft_out.stderr[-3000:]
    assert "warning: the base's generation_config.json stops at eos_token_id=2" in peft_out.stdout, peft_out.stdout
    hf_out = run_cli(["export", rid, "--dtype", "fp32", "--out", "hf"], cwd, work["env"])
    assert hf_out.returncode == 0, hf_out.stdout[-3000:] + hf_out.stderr[-3000:]
    conf = json.loads((cwd / "peft" / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str((cwd / "bases" / "bare").resolve())

    monkeypatch.chdir(tmp_path)  # elsewhere: a relative base would be looked up on the Hub from here
    adapter, merged_dir = cwd / "peft", cwd / "hf"
    tok = transformers.AutoTokenizer.from_pretrained(str(adapter))
    assert tok.eos_token == transformers.AutoTokenizer.from_pretrained(str(merged_dir)).eos_token
    adapted = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    prompt = tok("def main", return_tensors="pt").input_ids
    how = dict(max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        want = merged.generate(prompt, **how)
        got = adapted.generate(
            input_ids=prompt, generation_config=transformers.GenerationConfig.from_pretrained(str(adapter)), **how
        )
    assert got.tolist() == want.tolist()
    assert transformers.GenerationConfig.from_pretrained(str(adapter)).eos_token_id == tok.eos_token_id != 2
