"""The Hugging Face export loads in the oldest transformers the package allows (``transformers>=4.45``).

transformers 4.45.2 (the newest 4.45 patch) and the tokenizers/huggingface_hub it needs are
installed with ``pip --target`` into a cache directory, keyed by version and Python, and put first
on ``PYTHONPATH`` of a subprocess: they shadow the venv's newer ones while torch, numpy and
safetensors come from the venv. That subprocess runs this file as a script (``worker``), which loads
each export and prints JSON; the same worker under the venv's own transformers is the reference.

The cache: ``$LLMCTL_TEST_CACHE`` or ``~/.cache/llmctl-test``; built in a temporary directory and
renamed into place, so it is there whole or not at all; delete it to reinstall. Installing needs
PyPI (about 13 MB of wheels); without it the test fails, unless ``LLMCTL_OFFLINE=1`` says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

OLDEST = "4.45.2"  # pyproject: transformers>=4.45; the newest 4.45 patch release
# what transformers 4.45.2 requires that the venv's newer versions do not satisfy
# (tokenizers>=0.20,<0.21; huggingface-hub>=0.23.2,<1.0); the rest (torch, numpy, safetensors,
# filelock, packaging, pyyaml, regex, requests, tqdm, fsspec, typing-extensions) comes from the venv
PINS = [f"transformers=={OLDEST}", "tokenizers==0.20.3", "huggingface_hub==0.25.2"]
TEXT = "def f(x):\n    return x  # naïve, but fine"
EOT = "<|endoftext|>"


def worker(spec_path: str) -> None:
    """Load each export with whatever transformers this process imports; print one JSON object."""
    import tokenizers
    import transformers

    spec = json.loads(Path(spec_path).read_text())
    tokens = torch.tensor(spec["tokens"])
    result: dict[str, Any] = {
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "transformers_file": transformers.__file__,
        "torch_file": torch.__file__,
        "exports": {},
    }
    for name, path in spec["exports"].items():
        # fp32 whatever the export's dtype (5.x would load a bf16 export as bf16, 4.45 as fp32)
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, output_loading_info=True, torch_dtype=torch.float32
        )
        model.eval()
        tok = transformers.AutoTokenizer.from_pretrained(path)
        eos = tok.convert_tokens_to_ids(spec["eos_token"])
        ids = tok(spec["text"])["input_ids"]
        prompt = torch.tensor([spec["prompt"]])

        class EndAtThird(transformers.LogitsProcessor):  # the model "says" end-of-text as its third token
            def __init__(self, at: int, eos: int) -> None:
                self.at, self.eos = at, eos

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                if input_ids.shape[1] == self.at:
                    scores = torch.full_like(scores, -1e9)
                    scores[:, self.eos] = 0
                return scores

        with torch.no_grad():
            logits = model(tokens).logits
            generated = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=20,
                do_sample=False,
                logits_processor=[EndAtThird(prompt.shape[1] + 2, eos)],
            )
        result["exports"][name] = {
            "model_class": type(model).__name__,
            "loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "eos_id": eos,
            "bos_token": tok.bos_token,
            "config_bos": model.config.bos_token_id,
            "config_eos": model.config.eos_token_id,
            "generation_eos": model.generation_config.eos_token_id,
            "ids": ids,
            "decoded": tok.decode(ids),
            "generated": generated[0].tolist(),
            "logits": logits.tolist(),
        }
    print(json.dumps(result))


def _cache_root() -> Path:
    return Path(os.environ.get("LLMCTL_TEST_CACHE") or Path.home() / ".cache" / "llmctl-test")


def oldest_transformers() -> Path:
    """The directory holding transformers 4.45.2 and its pins: from the cache, else installed."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    target = _cache_root() / f"transformers-{OLDEST}-{tag}"
    if (target / "transformers" / "__init__.py").is_file():
        return target
    if os.environ.get("LLMCTL_OFFLINE") == "1":
        pytest.skip(f"LLMCTL_OFFLINE=1 and {target} is not there: cannot install transformers {OLDEST} from PyPI")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-cache-dir",
            "--no-deps",
            "--only-binary=:all:",
            "--timeout",
            "30",
            "--retries",
            "2",
            "--target",
            str(tmp),
            *PINS,
        ]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.fail(
                f"could not install {' '.join(PINS)} from PyPI (needed to check the export against the "
                f"oldest transformers allowed); set LLMCTL_OFFLINE=1 to skip this test offline.\n"
                f"$ {' '.join(cmd)}\n{proc.stderr[-3000:]}",
                pytrace=False,
            )
        try:
            os.rename(tmp, target)
        except OSError:  # another process put it there first
            if not (target / "transformers" / "__init__.py").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def run_worker(spec: Path, pythonpath: str | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONNOUSERSITE": "1",
            "HF_HOME": str(spec.parent / "hf-home"),
        }
    )
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run(
        [sys.executable, __file__, str(spec)],
        check=False,
        cwd=spec.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"worker under PYTHONPATH={pythonpath}:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _variants() -> dict[str, dict[str, Any]]:
    """ModelCfg fields of the tiny models exported: the existing tests' shape, tied embeddings with
    Llama 3.1's RoPE scaling (rope_scaling in 4.x, rope_parameters in 5.x), Qwen2 (q/k/v biases), and
    the RoPE layout of a model fine-tuned from a Hugging Face checkpoint."""
    base = {
        "name": "t",
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "vocab_size": 300,
        "max_seq_len": 96,
        "rope_theta": 500000.0,
    }
    # original_max_position_embeddings 16: wavelengths past 16 positions are scaled, so within a
    # 33-token batch the scaling changes the logits (a loader that dropped it would not match)
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return {
        "llama": base,
        "llama-tied-llama3-rope": {**base, "tie_embeddings": True, "rope_theta": 10000.0, "rope_scaling": llama3},
        "qwen2": {**base, "arch": "qwen2", "n_kv_heads": 1},
        # a model loaded with model.init_from keeps Hugging Face's RoPE layout: exported unpermuted
        "llama-init_from-layout": {**base, "rope_layout": "half"},
        "llama-bf16-shards": base,  # as shipped by default: bf16, here in several shards (SHIPPED)
    }


# export options other than fp32 in one file, by variant; the native model is then rounded the same way
SHIPPED = {"llama-bf16-shards": {"dtype": "bf16", "max_shard_size": 40_000}}


def _build(fields: dict[str, Any], seed: int = 0) -> tuple[torch.nn.Module, Any]:
    from workloads.pretrain.model.transformer import build_model
    from workloads.protocol.config import typed

    torch.manual_seed(seed)
    cfg = typed({"model": fields}).model
    model = build_model(cfg).eval()
    with torch.no_grad():  # biases start at zero: make them count, in the layout the export permutes
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    return model, cfg


@pytest.mark.slow
def test_export_loads_in_oldest_allowed_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from test_generate_export import _tokenizer
    from tokenizers import Tokenizer

    from workloads.pretrain.checkpoint.hf_export import export

    site = oldest_transformers()  # first: fails (or skips, LLMCTL_OFFLINE=1) before any other work
    tok_file = _tokenizer(tmp_path)
    trained = Tokenizer.from_file(str(tok_file))  # the tokenization the model was trained with
    trained_ids, prompt, eot_id = trained.encode(TEXT).ids, trained.encode("Return a").ids, trained.token_to_id(EOT)
    tokens = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(4))
    exports, native = {}, {}
    for name, fields in _variants().items():
        model, cfg = _build(fields)
        options = SHIPPED.get(name, {"dtype": "fp32"})
        exports[name] = str(export(model.state_dict(), cfg, tmp_path / name, tok_file, EOT, **options))
        with torch.no_grad():
            if name in SHIPPED:  # the weights as the export holds them, computed in fp32
                for p in model.parameters():
                    p.copy_(p.bfloat16().float())
            native[name] = model(tokens)
    assert len(list(Path(exports["llama-bf16-shards"]).glob("model-*-of-*.safetensors"))) > 2
    # the variants exercise what they claim: without the scaling / the biases the logits differ by
    # far more than the tolerance below (atol 2e-5), so a loader that dropped either could not match
    plain, _ = _build({**_variants()["llama-tied-llama3-rope"], "rope_scaling": None})
    no_bias, _ = _build(_variants()["qwen2"])
    with torch.no_grad():
        for p_name, p in no_bias.named_parameters():
            if p_name.endswith(".bias"):
                p.zero_()
        assert (plain(tokens) - native["llama-tied-llama3-rope"]).abs().max() > 1e-3
        assert (no_bias(tokens) - native["qwen2"]).abs().max() > 1e-3

    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps({"exports": exports, "tokens": tokens.tolist(), "prompt": prompt, "text": TEXT, "eos_token": EOT})
    )
    old = run_worker(spec, str(site))
    new = run_worker(spec, None)

    # each ran the transformers it was meant to, with the venv's torch
    assert old["transformers"] == OLDEST, old["transformers"]
    assert Path(old["transformers_file"]).is_relative_to(site), old["transformers_file"]
    assert old["tokenizers"].startswith("0.20."), old["tokenizers"]
    assert new["transformers"] == transformers.__version__ != OLDEST
    assert old["torch_file"] == new["torch_file"] == torch.__file__

    for name in exports:
        for run in (old, new):
            got, version = run["exports"][name], run["transformers"]
            where = f"{name} in transformers {version}"
            assert got["model_class"] == ("Qwen2ForCausalLM" if name == "qwen2" else "LlamaForCausalLM"), where
            info = got["loading_info"]
            assert info["missing_keys"] == [] and info["unexpected_keys"] == [], (where, info)
            assert info.get("mismatched_keys", []) == [] and info.get("error_msgs", []) == [], (where, info)
            eos = got["eos_id"]
            assert got["eos_token"] == EOT and got["config_eos"] == got["generation_eos"] == eos == eot_id, (where, got)
            assert got["bos_token"] is None and got["config_bos"] is None, where  # llmctl's BPE has no BOS
            if not (name == "qwen2" and run is new):  # see test_qwen2_export_tokenizer_in_transformers_5
                assert got["ids"] == trained_ids, (where, got["tokenizer_class"], got["ids"])  # as in training
            assert got["decoded"] == TEXT, where
            generated = got["generated"]
            assert generated[: len(prompt)] == prompt and len(generated) == len(prompt) + 3, (where, generated)
            assert generated[-1] == eos, (where, generated)  # stopped there, 17 tokens short of max_new_tokens
            # fp32 tolerance: same math, different kernels/association order
            torch.testing.assert_close(
                torch.tensor(got["logits"]),
                native[name],
                atol=2e-5,
                rtol=1e-4,
                msg=lambda m, where=where: f"{where} vs the native model: {m}",
            )
        old_e, new_e = old["exports"][name], new["exports"][name]
        assert old_e["generated"] == new_e["generated"], name
        where = f"{name}: transformers {OLDEST} vs {new['transformers']}"
        torch.testing.assert_close(
            torch.tensor(old_e["logits"]),
            torch.tensor(new_e["logits"]),
            atol=2e-5,
            rtol=1e-4,
            msg=lambda m, where=where: f"{where}: {m}",
        )


@pytest.mark.xfail(
    strict=True,
    reason="transformers 5.x loads any model_type=qwen2 tokenizer as Qwen2Tokenizer, "
    "which replaces tokenizer.json's pre-tokenizer with Qwen's: an export of arch=qwen2 with "
    "llmctl's own BPE tokenizes differently than in training (4.x keeps tokenizer.json)",
)
def test_qwen2_export_tokenizer_in_transformers_5(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4.x honours tokenizer_config.json's tokenizer_class")
    from test_generate_export import _tokenizer
    from tokenizers import Tokenizer

    from workloads.pretrain.checkpoint.hf_export import export

    tok_file = _tokenizer(tmp_path)
    model, cfg = _build(_variants()["qwen2"])
    out = export(model.state_dict(), cfg, tmp_path / "qwen2", tokenizer_file=tok_file, eos_token=EOT)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok(TEXT)["input_ids"] == Tokenizer.from_file(str(tok_file)).encode(TEXT).ids, type(tok).__name__


if __name__ == "__main__":
    worker(sys.argv[1])
