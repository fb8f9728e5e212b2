"""Export to the Hugging Face Llama format: safetensors, config, generation config, tokenizer.

So a trained model can go on to transformers, lm-eval-harness or vLLM. Two conversions matter:
parameter names, and RoPE's layout — this model rotates interleaved pairs (Meta's Llama), HF's
Llama rotates the two halves of each head, so q/k projection rows are permuted per head.

Written with safetensors and JSON only (transformers is not needed to export, only to load). The
special-token ids come from the tokenizer, so ``generate()`` stops at its end-of-text token; the
tokenizer config names ``PreTrainedTokenizerFast``, which transformers 4.x loads as itself and 5.x
as its tokenizers backend. The directory is written beside its destination and renamed into place:
it appears whole or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from workloads.pretrain.checkpoint.hf_load import hf_name
from workloads.pretrain.contract.schema import ModelCfg
from workloads.pretrain.contract.shape import hidden_dim


def interleaved_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's output rows from (x0, x1), (x2, x3)... pairs to [evens..., odds...]."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_config(
    model_cfg: ModelCfg, bos_token_id: Optional[int] = None, eos_token_id: Optional[int] = None
) -> dict[str, Any]:
    """A ``LlamaConfig`` (or ``Qwen2Config``) dict for this shape."""
    special = {k: v for k, v in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)) if v is not None}
    qwen2 = model_cfg.arch == "qwen2"
    scaling = model_cfg.rope_scaling
    rope = {"rope_type": "default", "rope_theta": float(model_cfg.rope_theta)}
    if scaling:
        rope = {**dict(scaling), "rope_theta": float(model_cfg.rope_theta)}
    return {
        **special,
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": int(model_cfg.vocab_size),
        "hidden_size": int(model_cfg.dim),
        "intermediate_size": hidden_dim(model_cfg),
        "num_hidden_layers": int(model_cfg.n_layers),
        "num_attention_heads": int(model_cfg.n_heads),
        "num_key_value_heads": int(model_cfg.n_kv_heads or model_cfg.n_heads),
        "head_dim": int(model_cfg.dim) // int(model_cfg.n_heads),
        "hidden_act": "silu",
        "max_position_embeddings": int(model_cfg.max_seq_len),
        "rms_norm_eps": float(model_cfg.norm_eps),
        "rope_theta": float(model_cfg.rope_theta),
        "rope_scaling": dict(scaling) if scaling else None,  # transformers 4.x reads this ...
        "rope_parameters": rope,  # ... and 5.x this
        "tie_word_embeddings": bool(model_cfg.tie_embeddings),
        **({"use_sliding_window": False} if qwen2 else {"attention_bias": False}),
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def to_hf_state_dict(state: dict[str, torch.Tensor], model_cfg: ModelCfg) -> dict[str, torch.Tensor]:
    """Native parameter names/layout → HF's. ``state`` is a full (unsharded) state dict. A model
    that rotates RoPE in Meta's interleaved pairs has its q/k rows (and biases) permuted per head
    into HF's halves; one already in HF's layout (loaded from HF: ``rope_layout=half``) is not."""
    n_heads, n_kv = int(model_cfg.n_heads), int(model_cfg.n_kv_heads or model_cfg.n_heads)
    permute = model_cfg.rope_layout == "interleaved"
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "output.weight" and model_cfg.tie_embeddings:
            continue  # the embedding, saved once
        if (
            permute
            and name.startswith("layers.")
            and name.split(".", 2)[2].startswith(("attention.wq.", "attention.wk."))
        ):
            heads = n_heads if ".wq." in name else n_kv
            tensor = interleaved_to_halves(tensor if tensor.dim() == 2 else tensor[:, None], heads).reshape(
                tensor.shape
            )
        out[hf_name(name) or name] = tensor
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def generation_config(bos_token_id: Optional[int], eos_token_id: Optional[int]) -> dict[str, Any]:
    """What ``generate()`` reads first: stop at the tokenizer's end-of-text token."""
    return {k: v for k, v in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)) if v is not None}


def tokenizer_files(tokenizer_file: str | Path, eos_token: str, max_seq_len: int) -> dict[str, str]:
    """``tokenizer.json`` as it is, plus the two small files transformers' ``AutoTokenizer`` reads."""
    special = {"bos_token": eos_token, "eos_token": eos_token}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": int(max_seq_len),
        "clean_up_tokenization_spaces": False,
    }
    return {
        "tokenizer.json": Path(tokenizer_file).read_text(),
        "tokenizer_config.json": json.dumps(config, indent=2),
        "special_tokens_map.json": json.dumps(special, indent=2),
    }


def export(
    state: dict[str, torch.Tensor],
    model_cfg: ModelCfg,
    out_dir: str | Path,
    tokenizer_file: Optional[str | Path] = None,
    eos_token: Optional[str] = None,
    dtype: torch.dtype = torch.float32,
    extra_files: Optional[dict[str, str]] = None,
) -> Path:
    """Write ``model.safetensors``, ``config.json``, ``generation_config.json`` and, when given, the
    tokenizer (``eos_token``: its end-of-text token, also used as bos) into ``out_dir``, atomically."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        eos_id = None
        if tokenizer_file is not None and eos_token is not None:
            eos_id = json_token_id(Path(tokenizer_file), eos_token)
        tensors = {k: v.to(dtype) for k, v in to_hf_state_dict(state, model_cfg).items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = hf_config(model_cfg, eos_id, eos_id)
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        files = {
            "config.json": json.dumps(config, indent=2),
            "generation_config.json": json.dumps(generation_config(eos_id, eos_id), indent=2),
            **(extra_files or {}),
        }
        if tokenizer_file is not None:
            files.update(tokenizer_files(tokenizer_file, eos_token or "", int(model_cfg.max_seq_len)))
        for name, text in files.items():
            (tmp / name).write_text(text)
        if out.exists():  # replace a previous export: the old one goes only once the new one is complete
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def json_token_id(tokenizer_file: Path, token: str) -> int:
    """The id of a special token, read from ``tokenizer.json`` (no tokenizers import needed)."""
    spec = json.loads(tokenizer_file.read_text())
    for added in spec.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    vocab = spec.get("model", {}).get("vocab", {})
    if token in vocab:
        return int(vocab[token])
    raise ValueError(f"{tokenizer_file} has no token {token!r}")
