"""Exports of a LoRA run (``model.lora.rank > 0``): the adapters alone for PEFT, or merged into the base.

A LoRA checkpoint holds the adapters and nothing of the frozen base (``dcp``), so both exports
read the base where the run read it: ``model.init_from`` (a Hugging Face directory, ``HfSource``)
or, for a run that started from its own initial weights, the same weights drawn again from
``train.seed`` (``seeded_source``).

* ``--format peft`` (``export_peft``): ``adapter_config.json`` and ``adapter_model.safetensors`` as
  PEFT's ``save_pretrained`` writes them, so ``PeftModel.from_pretrained(base, DIR)`` and vLLM's
  LoRA loader take it: keys ``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``
  (no adapter name in the saved keys), ``target_modules`` in Hugging Face's names. A model that
  rotates RoPE in Meta's interleaved pairs has its q/k output rows permuted into HF's halves, as the
  merged export permutes the base (``hf_export.to_hf_tensor``): B's rows, A is untouched.
* ``--format hf`` (``MergedSource``): each adapted weight becomes ``W + alpha/rank * B @ A``,
  computed in fp32 and cast to the export's dtype by ``hf_export``. QLoRA trained against the
  NF4-dequantized base, so its adapters are merged into that (quantized and dequantized again as
  the run did), not into the original weights they never saw.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from workloads.pretrain.checkpoint.hf_load import _LAYER, hf_name
from workloads.pretrain.checkpoint.tensor_source import StateDictSource, TensorSource, TensorSpec
from workloads.protocol.schema import TrainerCfg

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def _native_names(cfg: TrainerCfg) -> list[str]:
    """The model's parameter FQNs (built on meta: no memory)."""
    from workloads.pretrain.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg.model)
    return [name for name, _ in model.named_parameters()]


class HfSource:
    """A Hugging Face safetensors directory (one file or sharded) under the model's native names."""

    def __init__(self, path: Path, native: list[str]):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        files = json.loads(index.read_text())["weight_map"] if index.is_file() else None
        self._where: dict[str, tuple[Path, str]] = {}
        self._specs: dict[str, TensorSpec] = {}
        for fqn in native:
            hf = hf_name(fqn)
            file = path / (files.get(hf, "") if files is not None else "model.safetensors")
            if hf is None or not file.is_file():
                continue
            with safe_open(str(file), framework="pt") as f:
                if hf not in f.keys():  # noqa: SIM118 (a safetensors handle has no __contains__)
                    continue
                piece = f.get_slice(hf)
                self._specs[fqn] = TensorSpec(tuple(piece.get_shape()), _SAFETENSORS_DTYPES[piece.get_dtype()])
            self._where[fqn] = (file, hf)

    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file, hf = self._where[name]
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(hf)


def seeded_source(cfg: TrainerCfg) -> TensorSource:
    """The base a run without ``model.init_from`` trained on: its initial weights, drawn again from
    ``train.seed`` exactly as ``train.init_sharded`` draws them (the whole model, in memory)."""
    from workloads.pretrain.model.transformer import build_model

    torch.manual_seed(int(cfg.train.seed))
    model = build_model(cfg.model, "cpu")
    return StateDictSource({k: v for k, v in model.state_dict().items() if k in set(_native_names(cfg))})


def base_source(cfg: TrainerCfg) -> TensorSource:
    """Where the run's frozen base comes from (``model.init_from``, else ``train.seed``)."""
    if not cfg.model.init_from:
        return seeded_source(cfg)
    from workloads.pretrain.checkpoint.hf_load import local_dir
    from workloads.pretrain.data.cache import cache_root

    return HfSource(local_dir(str(cfg.model.init_from), cache_root(cfg.data)), _native_names(cfg))


def nf4_dtype(cfg: TrainerCfg, step_dir: Optional[str] = None) -> torch.dtype:
    """The dtype QLoRA's NF4 base was dequantized to while training: the compute dtype the run
    recorded in the checkpoint's marker (``compute_dtype``), so a GPU run exported on a CPU merges
    into the base it trained against. A checkpoint from before the marker said so: ``train.dtype``
    as this machine resolves it (``auto`` is bf16 only where this process sees CUDA)."""
    from workloads.protocol.checkpoint_layout import read_marker

    recorded = read_marker(step_dir).get("compute_dtype") if step_dir else None
    if recorded in ("bf16", "fp32"):
        return torch.bfloat16 if recorded == "bf16" else torch.float32
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.bfloat16 if cfg.train.dtype.on(device) == "bf16" else torch.float32


def _adapted(adapters: dict[str, TensorSpec]) -> set[str]:
    """Native weight names that have adapters: ``X.lora_a.weight`` -> ``X.weight``."""
    return {name.replace(".lora_a.weight", ".weight") for name in adapters if name.endswith(".lora_a.weight")}


class MergedSource:
    """The base with the adapters merged in (``lora.merged_weight``, fp32), under the base's names."""

    def __init__(self, base: TensorSource, adapters: TensorSource, cfg: TrainerCfg, step_dir: Optional[str] = None):
        """``step_dir``: the checkpoint the adapters come from, whose marker says the dtype a QLoRA
        base was de-quantized to (``nf4_dtype``)."""
        from workloads.pretrain.model.lora import is_adapter, lora_scaling

        self.base, self.adapters = base, adapters
        self.scaling = lora_scaling(cfg.model.lora)
        self.nf4 = cfg.model.lora.quantize_base == "nf4"
        self.dtype = nf4_dtype(cfg, step_dir)
        self._base_specs = {k: v for k, v in base.specs().items() if not is_adapter(k)}
        self._adapted = _adapted(adapters.specs())
        missing = sorted(self._adapted - set(self._base_specs))
        if missing or not self._adapted:
            raise ValueError(
                f"the adapters do not fit the base: {'no adapters in the checkpoint' if not missing else missing[:3]}"
            )

    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._base_specs)

    def read(self, name: str) -> torch.Tensor:
        from workloads.pretrain.model import nf4
        from workloads.pretrain.model.lora import merged_weight

        weight = self.base.read(name)
        if name not in self._adapted:
            return weight
        if self.nf4:  # what the run computed with: the base quantized to 4 bits and back
            weight = nf4.dequantized(nf4.to_nf4(weight, self.dtype))
        stem = name.removesuffix(".weight")
        a, b = self.adapters.read(f"{stem}.lora_a.weight"), self.adapters.read(f"{stem}.lora_b.weight")
        return merged_weight(weight.float(), a, b, self.scaling)


def merged_model(cfg: TrainerCfg, step_dir: str, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A plain model holding a LoRA checkpoint's base with its adapters merged: what ``evaluate``
    scores (it computes what base plus adapters compute, in one matmul per linear)."""
    from workloads.pretrain.checkpoint.tensor_source import DcpSource
    from workloads.pretrain.model.transformer import build_model

    model = build_model(cfg.model, device)
    source = MergedSource(base_source(cfg), DcpSource(step_dir), cfg, step_dir)
    specs = source.specs()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in specs:
                param.copy_(source.read(name))
            elif not (name == "output.weight" and cfg.model.tie_embeddings):
                raise ValueError(f"{step_dir}: the base has no {name}")
    return model.eval()


def peft_key(name: str) -> str:
    """``layers.0.attention.wq.lora_a.weight`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    layer, n, module, linear, ab, _ = name.split(".")
    return f"base_model.model.model.{layer}.{n}.{_LAYER[f'{module}.{linear}']}.lora_{ab[-1].upper()}.weight"


def peft_state_dict(adapters: TensorSource, cfg: TrainerCfg) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names, in Hugging Face's RoPE layout (``hf_export.to_hf_tensor``
    permutes q/k output rows when the model rotates interleaved pairs: B's rows; A is per input)."""
    from workloads.pretrain.checkpoint.hf_export import to_hf_tensor

    out = {}
    for name in sorted(adapters.specs()):
        tensor = adapters.read(name).float()
        if ".lora_b." in name:  # rows are the base weight's output rows
            tensor = to_hf_tensor(name.replace(".lora_b.weight", ".weight"), tensor, cfg.model)[1]
        out[peft_key(name)] = tensor.contiguous()
    return out


def adapter_config(cfg: TrainerCfg, base_model: Optional[str]) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` as ``save_pretrained`` writes it (what PEFT and vLLM read)."""
    lc = cfg.model.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(lc.rank),
        "lora_alpha": float(lc.alpha),
        "lora_dropout": float(lc.dropout),
        "target_modules": sorted(_LAYER[k].split(".")[1] for k in _LAYER if k.split(".")[-1] in lc.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "inference_mode": True,
        "init_lora_weights": True,
    }


def base_model_name(init_from: Optional[str]) -> Optional[str]:
    """``base_model_name_or_path``: a local base by its absolute path (PEFT resolves a relative one from
    wherever the adapter is loaded, and then asks the Hub), a URL as it is."""
    if not init_from:
        return None
    return str(init_from) if "://" in str(init_from) else str(Path(str(init_from)).expanduser().resolve())


def base_stops_elsewhere(init_from: Optional[str], generation_config: dict[str, Any]) -> Optional[str]:
    """Why PEFT's generation would not stop where the run's tokenizer ends text, or None. PEFT loads the
    base's ``generation_config.json``, never the adapter's: a base saved without a tokenizer keeps
    ``LlamaConfig``'s default EOS (2), some token of the run's vocabulary."""
    from workloads.pretrain.checkpoint.hf_tokenizer import read_json, stops_at

    ours = generation_config.get("eos_token_id")
    if not init_from or ours is None:
        return None
    try:
        theirs = read_json(f"{str(init_from).rstrip('/')}/generation_config.json")
    except (OSError, ValueError):
        return None
    if not theirs or theirs.get("eos_token_id") is None:
        return None
    if all(stops_at(theirs, eos) for eos in (ours if isinstance(ours, list) else [ours])):
        return None
    return (
        f"the base's generation_config.json stops at eos_token_id={theirs['eos_token_id']}, this run's tokenizer"
        f" ends text with {ours}; PEFT generates with the base's. Fix: generate(..., generation_config="
        "GenerationConfig.from_pretrained(<this export>))"
    )


def export_peft(
    adapters: TensorSource,
    cfg: TrainerCfg,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    extra_files: Optional[dict[str, str]] = None,
) -> Path:
    """``adapter_config.json`` + ``adapter_model.safetensors`` into ``out_dir``, atomically. The
    adapters are small (MBs), so they stay fp32 unless asked: PEFT casts them to the base's dtype."""
    from safetensors.torch import save_file

    if not int(cfg.model.lora.rank):
        raise ValueError("--format peft exports LoRA adapters, but the run has none (model.lora.rank=0)")
    state = {k: v.to(dtype) for k, v in peft_state_dict(adapters, cfg).items()}
    if not state:
        raise ValueError("the checkpoint holds no LoRA adapters")
    base = base_model_name(cfg.model.init_from)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        files = {ADAPTER_CONFIG: json.dumps(adapter_config(cfg, base), indent=2), **(extra_files or {})}
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
