"""Export to the Hugging Face Llama format (safetensors + config.json [+ tokenizer]).

So a trained model can go on to transformers, lm-eval-harness or vLLM. Two conversions matter:
parameter names, and RoPE's layout — this model rotates interleaved pairs (Meta's Llama), HF's
Llama rotates the two halves of each head, so q/k projection rows are permuted per head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from workloads.pretrain.shape import hidden_dim

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def interleaved_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's output rows from (x0, x1), (x2, x3)... pairs to [evens..., odds...]."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_config(model_cfg: Any) -> dict[str, Any]:
    """A ``LlamaConfig`` dict for this shape (``model_cfg`` is a ModelCfg or the same attributes)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "rope_parameters": {"rope_type": "default", "rope_theta": float(model_cfg.rope_theta)},
        "tie_word_embeddings": bool(model_cfg.tie_embeddings),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def to_hf_state_dict(state: dict[str, torch.Tensor], model_cfg: Any) -> dict[str, torch.Tensor]:
    """Native parameter names/layout → HF Llama's. ``state`` is a full (unsharded) state dict."""
    n_heads, n_kv = int(model_cfg.n_heads), int(model_cfg.n_kv_heads or model_cfg.n_heads)
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": state["tok_embeddings.weight"],
                                    "model.norm.weight": state["norm.weight"]}
    if not model_cfg.tie_embeddings:
        out["lm_head.weight"] = state["output.weight"]
    for name, tensor in state.items():
        if not name.startswith("layers."):
            continue
        _, index, rest = name.split(".", 2)
        if rest == "attention.wq.weight":
            tensor = interleaved_to_halves(tensor, n_heads)
        elif rest == "attention.wk.weight":
            tensor = interleaved_to_halves(tensor, n_kv)
        out[f"model.layers.{index}.{_LAYER_NAMES[rest]}"] = tensor
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def export(state: dict[str, torch.Tensor], model_cfg: Any, out_dir: str | Path,
           tokenizer_file: Optional[str | Path] = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``model.safetensors``, ``config.json`` and, when given, the tokenizer files."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype) for k, v in to_hf_state_dict(state, model_cfg).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(model_cfg)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_file is not None:
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file)).save_pretrained(str(out))
    return out
