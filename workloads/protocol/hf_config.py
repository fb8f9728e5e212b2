"""A Hugging Face checkpoint's ``config.json`` as the trainer's model fields. Stdlib (+ fsspec for URLs).

``model.init_from=<dir or URL>`` starts training from those weights; the shape is whatever the
checkpoint's config says, so it overrides the model fields (the trainer's ``config.load`` and
llmctl's compose both apply it, so the plan, the estimate and the run agree). Families: Llama
(2, 3, 3.1 with ``llama3`` RoPE scaling, 3.2) and Qwen2/2.5 (q/k/v biases), which is what most
fine-tuning starts from. Anything the model cannot reproduce exactly is refused with the field
that says so, rather than loaded into a model that computes something else.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from workloads.protocol.validate import ConfigError

FAMILIES = {"llama": "llama", "qwen2": "qwen2"}  # config.json model_type -> model.arch
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read(init_from: str) -> dict[str, Any]:
    """``<init_from>/config.json`` (a local path or any fsspec URL)."""
    import fsspec

    url = f"{str(init_from).rstrip('/')}/config.json"
    try:
        with fsspec.open(url, "r") as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError):  # a missing path, or a file given for the directory
        raise ConfigError(
            f"Bad value for 'model.init_from': no config.json at {url}. Fix: model.init_from="
            "<a Hugging Face checkpoint directory: config.json + *.safetensors>"
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"Bad value for 'model.init_from': {url} is not JSON ({exc.msg}, line {exc.lineno}). Fix: point"
            " model.init_from at a checkpoint saved by transformers' save_pretrained"
        ) from None


def model_fields(hf: Mapping[str, Any], init_from: str) -> dict[str, Any]:
    """The ModelCfg fields ``hf`` (a parsed config.json) stands for."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(
            f"Bad value for 'model.init_from': {init_from} is a '{model_type}' model; supported:"
            f" {', '.join(FAMILIES)} (Llama 2/3/3.1/3.2, Qwen2/2.5)"
        )

    def refuse(field: str, why: str) -> None:
        raise ConfigError(f"Bad value for 'model.init_from': config.json has {field}={hf.get(field)!r}, {why}")

    dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hf.get("head_dim") not in (None, dim // heads):
        refuse("head_dim", f"but this model's heads are hidden_size / num_attention_heads = {dim // heads}")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "only SwiGLU with silu is supported")
    if hf.get("mlp_bias") or (model_type == "llama" and hf.get("attention_bias")):
        refuse("attention_bias" if hf.get("attention_bias") else "mlp_bias", "biases there are not supported")
    if model_type == "qwen2" and hf.get("use_sliding_window"):
        refuse("use_sliding_window", "sliding-window attention is not supported")
    rope = dict(hf.get("rope_parameters") or {})  # transformers 5 keeps rope_theta and scaling here
    theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    scaling = dict(hf.get("rope_scaling") or {}) or {k: v for k, v in rope.items() if k != "rope_theta"}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ("default", "llama3"):
        refuse("rope_scaling", f"RoPE type '{kind}' is not supported (default or llama3)")
    if kind == "llama3" and any(k not in scaling for k in LLAMA3_KEYS):
        refuse("rope_scaling", f"llama3 RoPE scaling needs {', '.join(LLAMA3_KEYS)}")
    return {
        "name": str(init_from).rstrip("/").rsplit("/", 1)[-1],
        "arch": FAMILIES[model_type],
        "dim": dim,
        "n_layers": int(hf["num_hidden_layers"]),
        "n_heads": heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "vocab_size": int(hf["vocab_size"]),
        "hidden_dim": int(hf["intermediate_size"]),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_layout": "half",
        "rope_scaling": ({"rope_type": "llama3", **{k: scaling[k] for k in LLAMA3_KEYS}} if kind == "llama3" else None),
    }


def resolve(cfg: dict[str, Any]) -> dict[str, Any]:
    """A plain config whose ``model.init_from`` is set: the shape from its config.json, and the
    checkpoint's own tokenizer when ``data.tokenizer`` names none and the checkpoint has one."""
    init_from = cfg["model"].get("init_from")
    if not init_from:
        return cfg
    model = {**cfg["model"], **model_fields(read(init_from), init_from)}
    data = dict(cfg["data"])
    if not data.get("tokenizer") and _exists(f"{str(init_from).rstrip('/')}/tokenizer.json"):
        data["tokenizer"] = init_from
    return {**cfg, "model": model, "data": data}


def _exists(url: str) -> bool:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    return fs.exists(path)
