"""Export to the Hugging Face Llama format: sharded safetensors, config, generation config, tokenizer.

So a trained model can go on to transformers, lm-eval-harness or vLLM, and be shipped. Two
conversions matter: parameter names, and RoPE's layout — this model rotates interleaved pairs
(Meta's Llama), HF's Llama rotates the two halves of each head, so q/k projection rows are
permuted per head.

The weights are written as ``save_pretrained`` writes them: in bf16 unless asked otherwise
(``config.json``'s ``torch_dtype``/``dtype`` say which), in safetensors shards of at most
``max_shard_size`` bytes (5 GB, its default) named ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``, or one ``model.safetensors`` when they fit in one. They are
read from a ``TensorSource`` one tensor at a time, converted, and each shard is written once it is
full, so the process holds about one shard (plus the tensor being converted), never the model: a
DCP checkpoint (``DcpSource``) is exported without building the model at all. Merging LoRA
adapters into the base belongs in such a source (``tensor_source``).

The tokenizer files and the special-token ids come from where the run's tokenizer came from
(``hf_tokenizer``): the real BOS and EOS, the source's chat template and generation config.

Written with safetensors and JSON only (transformers is not needed to export, only to load). The
directory is written beside its destination and renamed into place: it appears whole or not at all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from workloads.pretrain.checkpoint.hf_load import hf_name
from workloads.pretrain.checkpoint.hf_tokenizer import TokenizerExport, tokenizer_export
from workloads.pretrain.checkpoint.tensor_source import StateDictSource, TensorSource
from workloads.protocol.run_contract import EXPORT_DTYPES
from workloads.protocol.schema import ModelCfg
from workloads.protocol.shape import hidden_dim

DTYPES = dict(zip(EXPORT_DTYPES, (torch.bfloat16, torch.float16, torch.float32)))
MAX_SHARD_SIZE = 5 * 10**9  # save_pretrained's default "5GB" (decimal, as huggingface_hub counts)
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
_LAYER = re.compile(r"^layers\.(\d+)\.")


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


def exported_name(name: str) -> str:
    """The Hugging Face name of a native tensor; a tensor without one is refused by name."""
    hf = hf_name(name)
    if hf is None:
        raise ValueError(
            f"{name}: no Hugging Face name; an export holds the model's own weights (merge adapters"
            " into them in the TensorSource, see workloads/pretrain/checkpoint/tensor_source.py)"
        )
    return hf


def to_hf_tensor(name: str, tensor: torch.Tensor, model_cfg: ModelCfg) -> Optional[tuple[str, torch.Tensor]]:
    """One native tensor as (HF name, HF layout); None for a tied LM head (the embedding, saved
    once). A model that rotates RoPE in Meta's interleaved pairs has its q/k rows (and biases)
    permuted per head into HF's halves; one already in HF's layout (loaded from HF:
    ``rope_layout=half``) is not."""
    if name == "output.weight" and model_cfg.tie_embeddings:
        return None
    hf = exported_name(name)
    if model_cfg.rope_layout == "interleaved" and name.split(".", 2)[-1].startswith(("attention.wq.", "attention.wk.")):
        heads = int(model_cfg.n_heads) if ".wq." in name else int(model_cfg.n_kv_heads or model_cfg.n_heads)
        tensor = interleaved_to_halves(tensor if tensor.dim() == 2 else tensor[:, None], heads).reshape(tensor.shape)
    return hf, tensor


def to_hf_state_dict(state: dict[str, torch.Tensor], model_cfg: ModelCfg) -> dict[str, torch.Tensor]:
    """A whole (unsharded) native state dict, converted (``to_hf_tensor``) in memory."""
    out = {}
    for name, tensor in state.items():
        converted = to_hf_tensor(name, tensor, model_cfg)
        if converted is not None:
            out[converted[0]] = converted[1].detach().to("cpu").contiguous()
    return out


def plan_shards(
    source: TensorSource, model_cfg: ModelCfg, dtype: torch.dtype, max_shard_size: int = MAX_SHARD_SIZE
) -> list[list[tuple[str, str, int]]]:
    """Output shards before any tensor is read: lists of (native name, HF name, bytes written), in
    model order (embedding, layers by index, the rest), filled in order as ``save_pretrained``
    does (a tensor that would overflow the shard starts the next; one larger than the limit is a
    shard of its own)."""
    specs = source.specs()

    def order(name: str) -> tuple[int, int]:
        layer = _LAYER.match(name)
        return (1, int(layer.group(1))) if layer else (0 if name.startswith("tok_embeddings.") else 2, 0)

    itemsize = dtype.itemsize
    shards: list[list[tuple[str, str, int]]] = [[]]
    size = 0
    for name in sorted(specs, key=order):
        if name == "output.weight" and model_cfg.tie_embeddings:
            continue
        hf = exported_name(name)
        nbytes = specs[name].numel * itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append((name, hf, nbytes))
        size += nbytes
    return shards


def shard_names(n: int) -> list[str]:
    return [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def write_weights(
    source: TensorSource,
    model_cfg: ModelCfg,
    out_dir: Path,
    dtype: torch.dtype,
    max_shard_size: int = MAX_SHARD_SIZE,
) -> dict[str, str]:
    """The shards (and the index, for more than one) into ``out_dir``; returns {HF name: file}.
    Holds one shard's tensors at a time: each is read, converted and cast, the shard is written
    when complete and dropped."""
    from safetensors.torch import save_file

    shards = plan_shards(source, model_cfg, dtype, max_shard_size)
    files = shard_names(len(shards))
    weight_map: dict[str, str] = {}
    total_bytes = total_params = 0
    for shard, file in zip(shards, files):
        tensors: dict[str, torch.Tensor] = {}
        for name, hf, nbytes in shard:
            tensors[hf] = _cast(name, to_hf_tensor(name, source.read(name), model_cfg)[1], dtype)
            weight_map[hf] = file
            total_bytes += nbytes
            total_params += tensors[hf].numel()
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        del tensors
    if len(files) > 1:
        index = {
            "metadata": {"total_parameters": total_params, "total_size": total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return weight_map


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in the export's dtype; a weight fp16 cannot hold is refused rather than written as inf."""
    if dtype == torch.float16 and tensor.is_floating_point() and tensor.numel():
        biggest = float(tensor.abs().max())
        if biggest > torch.finfo(torch.float16).max:
            raise ValueError(f"{name} holds {biggest:.3g}, beyond fp16's range: export with --dtype bf16 (or fp32)")
    return tensor.to(dtype).contiguous()


def export(
    state: Mapping[str, torch.Tensor] | TensorSource,
    model_cfg: ModelCfg,
    out_dir: str | Path,
    tokenizer_file: Optional[str | Path] = None,
    eos_token: Optional[str] = None,
    dtype: str | torch.dtype = EXPORT_DTYPES[0],
    extra_files: Optional[dict[str, str]] = None,
    tokenizer_source: Optional[str] = None,
    max_shard_size: int = MAX_SHARD_SIZE,
) -> Path:
    """Write the weights (``state``: a native state dict or a ``TensorSource``), ``config.json``,
    ``generation_config.json`` and, when given, the tokenizer (``eos_token``: the run's end-of-text
    token; ``tokenizer_source``: the Hugging Face directory it came from, whose special tokens, chat
    template and generation config are handed on) into ``out_dir``, atomically."""
    torch_dtype = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if torch_dtype not in DTYPES.values():
        raise ValueError(f"dtype {dtype}: choose one of {', '.join(EXPORT_DTYPES)}")
    source = state if hasattr(state, "specs") and hasattr(state, "read") else StateDictSource(state)
    # the tokenizer first: a bad one fails before gigabytes of weights are written
    tok = TokenizerExport()
    if tokenizer_file is not None:
        tok = tokenizer_export(tokenizer_file, eos_token, int(model_cfg.max_seq_len), tokenizer_source)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_weights(source, model_cfg, tmp, torch_dtype, max_shard_size)
        config = {**hf_config(model_cfg), **tok.token_ids}
        name = str(torch_dtype).removeprefix("torch.")
        config.update(torch_dtype=name, dtype=name)  # transformers 4.x reads the first, 5.x the second
        files = {
            "config.json": json.dumps(config, indent=2),
            "generation_config.json": json.dumps(tok.generation_config, indent=2),
            **tok.files,
            **(extra_files or {}),
        }
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
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
