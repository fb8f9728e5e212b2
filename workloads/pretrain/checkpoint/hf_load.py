"""Load a Hugging Face checkpoint (safetensors, one file or sharded) into the parallelised model.

torch's distributed checkpoint reads it (``HuggingFaceStorageReader``): the model is built on meta,
parallelised (TP/FSDP shard its parameters into DTensors), materialised empty, and DCP copies into
each rank only the slices of each tensor that rank keeps, straight from the safetensors files. No
rank ever holds the whole model. Parameter names map one to one (``NAMES``); weights are used as
they are, because a model loaded this way rotates RoPE in Hugging Face's layout
(``model.rope_layout=half``, set by ``hf_config``), so q/k need no permutation.

A remote ``init_from`` (``s3://...``) is first copied to the local cache, once per node.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch

# native FQN (no "layers.N." prefix for per-layer names) -> Hugging Face name
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_FQN = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


def hf_name(fqn: str) -> Optional[str]:
    """The Hugging Face name of a native parameter (None: not a parameter HF checkpoints hold)."""
    if fqn in _TOP:
        return _TOP[fqn]
    m = _LAYER_FQN.match(fqn)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    return None


def names(fqns: list[str], tied: bool) -> dict[str, str]:
    """{native FQN: HF name} for every parameter to load; a tied LM head is the embedding."""
    out = {}
    for fqn in fqns:
        name = hf_name(fqn)
        if name is None:
            raise KeyError(f"parameter {fqn} has no Hugging Face name")
        if tied and fqn == "output.weight":
            continue
        out[fqn] = name
    return out


def local_dir(init_from: str, cache_root: Path) -> Path:
    """A local directory holding the checkpoint: ``init_from`` itself, or a copy of the remote one.

    Every process of a node (of every node, when the cache is on a shared file system) asks for
    the copy; the data cache's lock (``build_once``) lets one download it while the others wait
    for it, as long as the download advances, so a 70B checkpoint on 8 GPUs is fetched once, not 8
    times into 8 temp dirs.
    """
    if "://" not in init_from or init_from.startswith("file://"):
        return Path(init_from.removeprefix("file://")).expanduser()
    import hashlib

    from fsspec.core import url_to_fs

    from workloads.pretrain.data.cache import build_once, progress_callback

    dest = cache_root / "checkpoints" / hashlib.sha256(init_from.encode()).hexdigest()[:16]

    def download(tmp: Path, progress) -> None:
        fs, root = url_to_fs(init_from)
        for path in fs.ls(root, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name.endswith((".json", ".safetensors", ".model", ".txt")):
                fs.get_file(path, str(tmp / name), callback=progress_callback(progress))
        (tmp / ".complete").write_text(json.dumps({"source": init_from}))

    build_once(dest, download)
    return dest


def load(model: torch.nn.Module, init_from: str, cache_root: Path) -> None:
    """Fill ``model`` (materialised, possibly sharded) with the checkpoint's weights, in place."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from workloads.pretrain.model import lora, nf4

    path = local_dir(init_from, cache_root)
    state = get_model_state_dict(model)
    # LoRA's adapters are not in a base checkpoint (``lora.init_adapters`` starts them); a QLoRA
    # base stored in NF4 is read whole and quantized (``_load_nf4``), not copied slice by slice
    base = [fqn for fqn, value in state.items() if not lora.is_adapter(fqn) and not nf4.is_nf4(value)]
    mapping = names(base, bool(getattr(model, "tie_embeddings", False)))
    hf_state = {hf: state[fqn] for fqn, hf in mapping.items()}
    try:
        dcp.load(
            hf_state,
            storage_reader=HuggingFaceStorageReader(str(path)),
            no_dist=not (dist.is_available() and dist.is_initialized()),
        )
    except CheckpointException as exc:  # a BaseException: name what is missing, in one line
        raise ValueError(
            f"model.init_from={init_from}: the checkpoint does not fit this model: {' '.join(str(exc).split())[:1500]}"
        ) from None
    loaded = {fqn: hf_state[hf] for fqn, hf in mapping.items()}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
    if getattr(model, "tie_embeddings", False):
        model.tie_weights()
    _load_nf4(model, path, init_from)


def _load_nf4(model: torch.nn.Module, path: Path, init_from: str) -> None:
    """QLoRA (``model.lora.quantize_base=nf4``): each NF4 weight read whole from the safetensors
    file holding it, quantized, and this rank's rows kept (``nf4.fill``). NF4 groups span rows, so
    a shard cannot be quantized alone: every rank reads every target weight, one at a time (the
    peak is one weight in full precision, as when initialising)."""
    from safetensors import safe_open

    from workloads.pretrain.model import nf4
    from workloads.pretrain.model.init_weights import canonical_name

    targets = nf4.linears(model)
    if not targets:
        return
    index = path / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    for fqn, linear in targets:
        name = hf_name(canonical_name(f"{fqn}.weight"))
        if name is None or (files is not None and name not in files):
            raise ValueError(f"model.init_from={init_from}: the checkpoint has no {name or fqn}")
        file = path / (files[name] if files else "model.safetensors")
        with safe_open(str(file), framework="pt") as f:
            full = f.get_tensor(name)
        nf4.fill(linear, full)
