"""``model.init_from``: Hugging Face checkpoints (made here with transformers, saved in several
shards) load into one process, FSDP over 2 and TP over 2, and compute what transformers computes.
transformers is the oracle: logits and the loss of the same batch, fp32."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}  # short: the scaled and blended bands both occur
OVERRIDES = [f"data.vocab_size={VOCAB}", "train.batch_size=2", "train.seq_len=48"]


def _save(model, path: Path) -> Path:
    model.save_pretrained(str(path), max_shard_size="60KB")  # several shards and an index
    assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {}
    for name, tie in (("llama", False), ("llama-tied", True)):
        cfg = transformers.LlamaConfig(
            **COMMON, tie_word_embeddings=tie, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE)
        )
        out[name] = _save(transformers.LlamaForCausalLM(cfg), root / name)
    _hf_tokenizer().save_pretrained(str(out["llama-tied"]))  # a checkpoint that brings its tokenizer
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, tie_word_embeddings=False))
    with torch.no_grad():  # transformers initialises biases to 0: make them count
        for layer in qwen.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(std=0.5)
    out["qwen2"] = _save(qwen, root / "qwen2")
    return out


def _hf_tokenizer():
    """A transformers tokenizer of VOCAB tokens whose end-of-text is "<|end|>" (not llmctl's)."""
    from pydoc_data.topics import topics

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [topics[k] for k in sorted(topics)],
        trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=["<|end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    assert tok.get_vocab_size() <= VOCAB
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (2, 41), generator=torch.Generator().manual_seed(7))
    return tokens[:, :-1], tokens[:, 1:]


def _reference(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    import transformers

    x, y = _batch()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=x).logits
    return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _close(got: dict, path: Path) -> None:
    logits, loss = _reference(path)
    torch.testing.assert_close(got["logits"], logits, atol=2e-5, rtol=1e-4)
    assert abs(float(got["loss"]) - float(loss)) < 1e-5, (float(got["loss"]), float(loss))


def test_config_json_sets_the_shape(checkpoints: dict[str, Path]) -> None:
    from workloads.protocol.config import load

    llama = load(None, OVERRIDES + [f"model.init_from={checkpoints['llama-tied']}"]).model
    assert (llama.dim, llama.n_layers, llama.n_heads, llama.n_kv_heads, llama.vocab_size, llama.hidden_dim) == (
        64,
        2,
        4,
        2,
        VOCAB,
        160,
    )
    assert llama.tie_embeddings and llama.rope_layout.value == "half" and llama.arch.value == "llama"
    assert dict(llama.rope_scaling) == LLAMA3_ROPE and llama.rope_theta == 500000.0
    qwen = load(None, OVERRIDES + [f"model.init_from={checkpoints['qwen2']}"])
    assert qwen.model.arch.value == "qwen2" and not qwen.model.tie_embeddings and qwen.model.rope_scaling is None
    # the checkpoint's own tokenizer, when it brings one; else a BPE trained on the data
    assert load(None, OVERRIDES + [f"model.init_from={checkpoints['llama-tied']}"]).data.tokenizer == str(
        checkpoints["llama-tied"]
    )
    assert qwen.data.tokenizer is None


@pytest.mark.parametrize("name", ["llama", "llama-tied", "qwen2"])
def test_one_process_computes_what_transformers_computes(
    checkpoints: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workloads.pretrain.train import init_distributed, load_pretrained
    from workloads.protocol.config import load

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg = load(None, OVERRIDES + [f"model.init_from={checkpoints[name]}"])
    try:
        model = load_pretrained(cfg, init_distributed(cfg))  # a 1-rank group and mesh, as the trainer's
        x, y = _batch()
        with torch.no_grad():
            _close({"logits": model(x), "loss": model(x, y)}, checkpoints[name])
    finally:  # this pytest process may later host a fake process group (the memory oracle)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", [["parallel.dp_shard=2"], ["parallel.tp=2", "parallel.dp_shard=1"]], ids=["fsdp2", "tp2"]
)
def test_sharded_layouts_compute_what_transformers_computes(
    checkpoints: dict[str, Path], layout: list[str], tmp_path: Path
) -> None:
    batch = tmp_path / "batch.pt"
    torch.save(_batch(), batch)
    jobs = [{"init_from": str(path), "out": str(tmp_path / f"{name}.pt")} for name, path in checkpoints.items()]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "tests" / "trainer" / "hf_logits_worker.py"),
        str(batch),
        str(tmp_path / "jobs.json"),
        *OVERRIDES,
        *layout,
    ]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for name, path in checkpoints.items():
        _close(torch.load(tmp_path / f"{name}.pt"), path)


def test_a_checkpoint_that_does_not_fit_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from workloads.protocol.config import load
    from workloads.protocol.validate import ConfigError

    bad = tmp_path / "mistral"
    bad.mkdir()
    hf = json.loads((checkpoints["llama"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**hf, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="'gpt2' model; supported: llama, qwen2"):
        load(None, OVERRIDES + [f"model.init_from={bad}"])
    (bad / "config.json").write_text(json.dumps({**hf, "head_dim": 32}))
    with pytest.raises(ConfigError, match="head_dim=32"):
        load(None, OVERRIDES + [f"model.init_from={bad}"])
    with pytest.raises(ConfigError, match="no config.json"):
        load(None, OVERRIDES + [f"model.init_from={tmp_path / 'nowhere'}"])


@pytest.mark.slow
def test_launch_fine_tunes_exports_and_transformers_agrees(
    checkpoints: dict[str, Path], cli_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through llmctl: the plan and MLflow show the checkpoint's shape; FSDP over 2 trains from it
    (first-step loss = transformers' loss on the sampler's first batch, the tied head stays tied);
    the export loads in transformers (the newest and the oldest allowed, 4.45) and computes what
    the checkpoint computes."""
    import transformers
    from helpers import run_cli
    from mlflow.tracking import MlflowClient
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from workloads.pretrain.data import Sampler, prepare_corpus
    from workloads.pretrain.evaluate import load_model
    from workloads.protocol.config import load

    ckpt = checkpoints["llama-tied"]
    loss_file = tmp_path / "losses.jsonl"
    args = [
        "launch",
        f"model.init_from={ckpt}",
        f"data.vocab_size={VOCAB}",
        "train.steps=2",
        "train.seq_len=48",
        "train.batch_size=4",
        "train.log_every=1",
        "train.val_every=2",
        "train.val_batches=1",
        "parallel=fsdp2",
        "checkpoint.every=2",
    ]
    out = run_cli(args, tmp_path, {**cli_env, "LLMCTL_LOSS_FILE": str(loss_file)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mc = MlflowClient(tracking_uri=uri)
    (run,) = mc.search_runs([e.experiment_id for e in mc.search_experiments()])
    assert run.data.tags["llmctl.choice.model"] == ckpt.name  # what it is, not the conf/model default (smoke)
    p = run.data.params
    assert (p["model.dim"], p["model.hidden_dim"], p["model.rope_layout"], p["model.init_from"]) == (
        "64",
        "160",
        "half",
        str(ckpt),
    )

    cfg = load(str(tmp_path / "llmctl-runs" / run.info.run_id / "config.yaml"))
    monkeypatch.setenv("LLMCTL_CACHE_DIR", cli_env["LLMCTL_CACHE_DIR"])  # the corpus the run trained on
    first = next(json.loads(line) for line in loss_file.read_text().splitlines() if '"train/loss"' in line)
    corpus = prepare_corpus(cfg.data)
    # tokenized by the checkpoint's tokenizer, as transformers tokenizes: documents end in its "<|end|>"
    from workloads.pretrain.data.sources import builtin_pydoc_texts

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    doc = builtin_pydoc_texts()[0]
    want = hf_tok(doc)["input_ids"] + [hf_tok.eos_token_id]
    assert corpus.eos_token == "<|end|>" and corpus.tokens[: len(want)].tolist() == want
    batch = Sampler(corpus.split(float(cfg.data.val_fraction))[0], 48, 4, int(cfg.train.seed)).next_batch()
    x, y = batch.inputs, batch.targets
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(hf(input_ids=x).logits.flatten(0, 1), y.flatten())
    assert first["step"] == 1 and abs(first["train/loss"] - float(ref)) < 1e-5, (first, float(ref))

    step_dir = Path(cfg.checkpoint.dir) / "step-2"
    dcp_to_torch_save(str(step_dir), str(tmp_path / "flat.pt"))
    flat = torch.load(tmp_path / "flat.pt", weights_only=False)["model"]
    assert torch.equal(flat["tok_embeddings.weight"], flat["output.weight"])  # still one matrix after training
    assert not torch.equal(flat["tok_embeddings.weight"], hf.model.embed_tokens.weight)  # and it trained

    out = run_cli(["export", run.info.run_id, "--dtype", "fp32", "--out", str(tmp_path / "export")], tmp_path, cli_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert exported.config.rope_parameters["rope_type"] == "llama3" and exported.config.tie_word_embeddings
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export"))  # the same tokenizer, handed on
    assert back(doc)["input_ids"] == hf_tok(doc)["input_ids"] and back.eos_token == "<|end|>"
    assert exported.generation_config.eos_token_id == hf_tok.eos_token_id
    native = load_model(cfg.model, str(step_dir))
    with torch.no_grad():
        want = native(x)
        torch.testing.assert_close(exported.eval()(input_ids=x).logits, want, atol=2e-5, rtol=1e-4)

    # the same export in the oldest transformers the package allows (4.45)
    from test_export_oldest_transformers import oldest_transformers, run_worker

    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "exports": {"launch": str(tmp_path / "export")},
                "tokens": x.tolist(),
                "prompt": hf_tok("The")["input_ids"],
                "text": doc[:300],
                "eos_token": "<|end|>",
            }
        )
    )
    old = run_worker(spec, str(oldest_transformers()))
    assert old["transformers"].startswith("4.45."), old["transformers"]
    got = old["exports"]["launch"]
    assert got["loading_info"]["missing_keys"] == [] and got["loading_info"]["unexpected_keys"] == [], got
    assert got["ids"] == hf_tok(doc[:300])["input_ids"] and got["decoded"] == doc[:300]
    assert got["config_eos"] == got["generation_eos"] == got["eos_id"] == hf_tok.eos_token_id
    assert got["generated"][-1] == hf_tok.eos_token_id  # generate stopped at end-of-text
    torch.testing.assert_close(torch.tensor(got["logits"]), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "preset, published",
    [
        ("llama3.2-1b", 1_235_814_400),
        ("llama3.1-8b", 8_030_261_248),
        ("llama3.1-70b", 70_553_706_496),
        ("qwen2.5-7b", 7_615_616_512),
    ],
)
def test_presets_are_the_published_models(preset: str, published: int) -> None:
    """transformers builds the preset (on meta: no memory) with exactly the published parameter count,
    and our count (N: the input embedding left out) agrees with it."""
    import transformers
    from omegaconf import OmegaConf

    from workloads.pretrain.checkpoint.hf_export import hf_config
    from workloads.protocol.schema import ModelCfg
    from workloads.protocol.shape import num_params

    cfg = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(REPO / "conf" / "model" / f"{preset}.yaml"))
    )
    spec = hf_config(cfg)
    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in spec.items() if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    total = sum(p.numel() for p in hf.parameters())
    assert total == published
    embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    assert num_params(cfg) == total - embedding
