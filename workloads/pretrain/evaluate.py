"""Score a checkpoint: held-out loss, perplexity, bits per byte, and samples; or export it.

``python -m workloads.pretrain.evaluate --config run.yaml --out results.json`` (or under
``torchrun --nproc_per_node=N``; ``llmctl eval`` runs it this way). Modes:

* default: load the model part of a DCP checkpoint (``eval.step``, else the newest complete one
  under ``checkpoint.dir``; ``--checkpoint URL`` names a root or one ``step-N`` directory),
  compute the metrics on the fixed validation batches training uses (or on ``eval.source``), and
  on rank 0 generate a greedy and a sampled completion (KV cache) per ``eval.prompts``.
* ``--hf DIR``: the same metrics for a Hugging Face export, loaded by transformers with
  ``device_map="auto"`` (accelerate places it on the available devices). One process.
* ``--export-peft DIR``: a LoRA run's adapters as PEFT writes them (``lora_export``): one process.
* ``--export-hf DIR``: write the checkpoint as a transformers Llama model (``hf_export``: sharded
  safetensors in ``--export-dtype``, bf16 by default) plus the run's tokenizer, with the special
  tokens and chat template of the tokenizer's source. One process, which reads the checkpoint one
  tensor at a time and never builds the model.

Any world size loads any checkpoint: every rank builds the whole (unsharded) model and DCP reads
the pieces of each tensor from whatever shards the saving layout wrote. Ranks then split each
validation batch like training's data-parallel ranks do and sum nats, tokens and bytes.

Metrics (exact definitions, also in docs/eval.md):
  val_loss        total nats / total target tokens (mean token cross-entropy)
  perplexity      exp(val_loss)
  bits_per_byte   total nats / ln 2 / total UTF-8 bytes of the target tokens' text. A byte-level
                  BPE token is a fixed byte string, so each token's byte length is looked up once;
                  the end-of-text separator counts 0 bytes (it is not text).

Writes one JSON file (``--out``) on rank 0; llmctl logs it into the run. Exit 0 / 1 (exception).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import warnings
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from workloads.planner.hardware import cpu_threads
from workloads.pretrain.data import EOT, Corpus, Windows, load_texts, prepare_corpus, val_batches
from workloads.pretrain.model.losses import IGNORE_INDEX
from workloads.pretrain.model.transformer import Transformer, build_model
from workloads.protocol.checkpoint_layout import (
    MARKER,
    fs_and_path,
    join,
    latest_complete,
    split_step_dir,
    step_dir,
)
from workloads.protocol.config import parse_args
from workloads.protocol.run_contract import EXPORT_DTYPES, EXPORT_INFO
from workloads.protocol.schema import ModelCfg, TrainerCfg

# ----------------------------------------------------------------------------- checkpoint


def resolve_step_dir(ckpt: str, step: Optional[int]) -> tuple[str, int]:
    """(``step-N`` directory, N) for a checkpoint root or a step directory itself."""
    ckpt = str(ckpt).rstrip("/")
    named = split_step_dir(ckpt)[1]
    if named is not None:
        return ckpt, named
    if step is None:
        step = latest_complete(ckpt)
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint (step-N/{MARKER}) under {ckpt}")
    path = step_dir(ckpt, step)
    fs, p = fs_and_path(path)
    if not fs.exists(join(p, MARKER)):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER})")
    return path, int(step)


def load_model(model_cfg: ModelCfg, step_dir: str, device: torch.device | str = "cpu") -> Transformer:
    """A plain (unsharded) model holding the checkpoint's weights; optimizer state is not read.

    DCP loads only the keys asked for (``model.*``) and reshards from any saved layout. With a
    process group, every rank reads the full tensors.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = build_model(model_cfg, device)
    state = {"model": get_model_state_dict(model)}
    with warnings.catch_warnings():  # one process: DCP warns that it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=step_dir, no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    return model.eval()


# ----------------------------------------------------------------------------- data


def token_byte_lengths(tokenizer: Any) -> np.ndarray:
    """UTF-8 bytes each token id stands for (special tokens: 0).

    Byte-level BPE maps every byte to one printable character, so a token's byte length is the
    length of its vocabulary string. Other tokenizers: the length of the token decoded alone.
    """
    from tokenizers import pre_tokenizers

    n = tokenizer.get_vocab_size()
    byte_level = isinstance(tokenizer.pre_tokenizer, pre_tokenizers.ByteLevel)
    special = (
        {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        if hasattr(tokenizer, "get_added_tokens_decoder")
        else {EOT}
    )
    out = np.zeros(n, dtype=np.int64)
    for i in range(n):
        tok = tokenizer.id_to_token(i)
        if tok is None or tok in special:
            continue
        out[i] = len(tok) if byte_level else len(tokenizer.decode([i]).encode("utf-8"))
    return out


def source_tokens(corpus: Corpus, source: str, text_field: str, max_tokens: Optional[int]) -> np.ndarray:
    """``source``'s documents tokenized with the run's tokenizer (EOT after each), in file order."""
    from types import SimpleNamespace

    eot = corpus.eos_id
    ids: list[int] = []
    for text in load_texts(SimpleNamespace(source=source, text_field=text_field)):
        ids.extend(corpus.tokenizer.encode(text).ids + [eot])
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return np.asarray(ids, dtype=np.int64)


def eval_batches(cfg: TrainerCfg, corpus: Corpus, rank: int, world: int, device: torch.device):
    """This rank's slice of each fixed eval batch (training's val batches unless ``eval.source``)."""
    tc, ec = cfg.train, cfg.eval
    if tc.batch_size % world:
        raise ValueError(f"train.batch_size={tc.batch_size} does not split over {world} eval processes")
    if ec.source:
        n = ec.val_batches if ec.val_batches is not None else 10**9
        need = None if ec.val_batches is None else n * tc.batch_size * tc.seq_len + 1
        eos = corpus.eos_id if cfg.data.document_mask else None
        sequences = Windows(source_tokens(corpus, ec.source, ec.text_field, need), tc.seq_len, eos)
    else:
        n = ec.val_batches if ec.val_batches is not None else tc.val_batches
        sequences = corpus.sequences(float(cfg.data.val_fraction), tc.seq_len, bool(cfg.data.document_mask))[1]
    return val_batches(sequences, tc.seq_len, tc.batch_size, n, rank, world, device)


# ----------------------------------------------------------------------------- metrics


def _reduce(totals: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return totals


def finish_metrics(nats: float, tokens: float, nbytes: float) -> dict[str, float]:
    loss = nats / tokens
    return {
        "val_loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": nats / math.log(2) / nbytes if nbytes else float("nan"),
        "tokens": tokens,
        "bytes": nbytes,
    }


@torch.no_grad()
def score_native(model: Transformer, batches: list, byte_len: torch.Tensor, autocast) -> dict[str, float]:
    """Sum of nats / tokens / bytes over the batches, across ranks. ``model(x, y)`` is training's
    own loss path (same kernels), so the number equals training's val/loss."""
    totals = torch.zeros(3, dtype=torch.float64)
    for b in batches:
        with autocast():
            nats = model(b.inputs, b.targets, **b.model_kwargs(), reduction="sum").float()
        targets = b.targets[b.targets != IGNORE_INDEX].cpu()
        totals += torch.tensor(
            [nats.double().item(), targets.numel(), byte_len[targets].sum().item()], dtype=torch.float64
        )
    return finish_metrics(*_reduce(totals).tolist())


@torch.no_grad()
def score_hf(hf_model: Any, batches: list, byte_len: torch.Tensor) -> dict[str, float]:
    totals = torch.zeros(3, dtype=torch.float64)
    device = hf_model.get_input_embeddings().weight.device
    for b in batches:
        for x, y in _unpacked(b):  # packed fine-tuning examples go to transformers one at a time
            logits = hf_model(input_ids=x.to(device)).logits.float()
            nats = F.cross_entropy(
                logits.flatten(0, 1), y.to(logits.device).flatten(), reduction="sum", ignore_index=IGNORE_INDEX
            )
            targets = y[y != IGNORE_INDEX].cpu()
            totals += torch.tensor([nats.item(), targets.numel(), byte_len[targets].sum().item()], dtype=torch.float64)
    return finish_metrics(*totals.tolist())


def _unpacked(batch: Any):
    """(inputs, targets) [1, n] per example of a packed batch; the whole batch otherwise."""
    if batch.doc_ids is None:
        yield batch.inputs, batch.targets
        return
    for row in range(batch.inputs.shape[0]):
        for d in batch.doc_ids[row].unique().tolist():
            at = batch.doc_ids[row] == d
            yield batch.inputs[row][at][None], batch.targets[row][at][None]


def samples(model: Transformer, corpus: Corpus, ec: Any, device: torch.device) -> list[dict[str, Any]]:
    """A greedy and a sampled completion per prompt, both with the KV cache."""
    from workloads.pretrain.model.generate import generate

    tok, out = corpus.tokenizer, []
    gen = torch.Generator(device=device).manual_seed(int(ec.seed))
    for prompt in ec.prompts:
        if corpus.chat_template is not None:  # a chat fine-tune: the prompt as a user turn, as it trained
            text = corpus.chat_template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False).ids
        else:  # as a prompt/completion fine-tune's prompt was encoded (BOS where the tokenizer adds it)
            ids = tok.encode(prompt).ids or [corpus.eos_id]
        n = max(0, min(int(ec.max_new_tokens), model.max_seq_len - len(ids)))
        x = torch.tensor([ids], device=device)
        greedy = generate(model, x, n, temperature=0.0, use_cache=True)[0].tolist()
        sampled = generate(
            model, x, n, temperature=float(ec.temperature), top_k=ec.top_k, use_cache=True, generator=gen
        )[0].tolist()
        out.append(
            {
                "prompt": prompt,
                "prompt_ids": ids,
                "greedy": tok.decode(greedy),
                "sampled": tok.decode(sampled),
                "greedy_ids": greedy,
                "sampled_ids": sampled,
            }
        )
    return out


# ----------------------------------------------------------------------------- modes


def _init() -> tuple[int, int, torch.device]:
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=10))
    return rank, world, device


def run(
    cfg: TrainerCfg,
    checkpoint: Optional[str] = None,
    hf_dir: Optional[str] = None,
    export_dir: Optional[str] = None,
    run_id: Optional[str] = None,
    export_dtype: str = EXPORT_DTYPES[0],
    export_max_shard_size: Optional[int] = None,
    peft_dir: Optional[str] = None,
) -> dict[str, Any]:
    """Do the requested mode; returns the result (rank 0's is complete)."""
    rank, world, device = _init()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    ec = cfg.eval
    corpus = prepare_corpus(cfg.data)
    result: dict[str, Any] = {"world_size": world, "source": ec.source or "held-out split"}
    t0 = time.perf_counter()
    if hf_dir:  # the export, through transformers + accelerate
        if world > 1:
            raise ValueError("--hf runs in one process (device_map='auto' spreads it over devices)")
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, device_map="auto").eval()
        batches = eval_batches(cfg, corpus, 0, 1, torch.device("cpu"))
        result.update(
            hf=str(hf_dir),
            metrics=score_hf(hf, batches, torch.from_numpy(token_byte_lengths(corpus.tokenizer))),
            device_map={k: str(v) for k, v in (getattr(hf, "hf_device_map", None) or {}).items()},
        )
        say(f"eval | hf {hf_dir}: " + _line(result["metrics"]))
        return result

    root = checkpoint or cfg.checkpoint.dir
    if not root:
        raise ValueError("no checkpoint: checkpoint.dir is unset and no --checkpoint given")
    found = [resolve_step_dir(str(root), ec.step) if rank == 0 else None]
    if dist.is_initialized():  # one listing, so every rank loads the same step
        dist.broadcast_object_list(found, src=0)
    step_dir, step = found[0]
    result.update(step=step, checkpoint=step_dir)
    if peft_dir:
        if world > 1:
            raise ValueError("--export-peft runs in one process")
        from workloads.pretrain.checkpoint.hf_tokenizer import source_dir, tokenizer_export
        from workloads.pretrain.checkpoint.lora_export import base_stops_elsewhere, export_peft
        from workloads.pretrain.checkpoint.tensor_source import DcpSource

        # the run's tokenizer and generation config beside the adapters, as PEFT's save_pretrained
        # leaves them: the base may have neither (a run that trained its own BPE)
        tok = tokenizer_export(
            corpus.path / "tokenizer.json", corpus.eos_token, int(cfg.model.max_seq_len), source_dir(cfg.data.tokenizer)
        )
        info = {"run_id": run_id, "step": step, "checkpoint": step_dir, "format": "peft"}
        files = {
            EXPORT_INFO: json.dumps(info, indent=2),
            "generation_config.json": json.dumps(tok.generation_config, indent=2),
            **tok.files,
        }
        export_peft(DcpSource(step_dir), cfg, peft_dir, extra_files=files)
        result.update(export=str(peft_dir), format="peft")
        say(f"export | step {step} adapters to {peft_dir} (PEFT LoRA) in {time.perf_counter() - t0:.1f}s")
        stale = base_stops_elsewhere(cfg.model.init_from, tok.generation_config)
        if stale:
            say(f"export | warning: {stale}")
        return result
    if export_dir:
        if world > 1:
            raise ValueError("--export-hf runs in one process")
        info = {"run_id": run_id, "step": step, "checkpoint": step_dir, "dtype": export_dtype}
        export_checkpoint(cfg, step_dir, corpus, export_dir, export_dtype, info, export_max_shard_size)
        result.update(export=str(export_dir), dtype=export_dtype)
        say(
            f"export | step {step} to {export_dir} ({export_dtype} safetensors + tokenizer for transformers)"
            f" in {time.perf_counter() - t0:.1f}s"
        )
        return result

    if cfg.model.lora.rank:  # adapters only in the checkpoint: merged into the base the run read
        from workloads.pretrain.checkpoint.lora_export import merged_model

        model = merged_model(cfg, step_dir, device)
    else:
        model = load_model(cfg.model, step_dir, device)
    say(f"eval | loaded {step_dir} (step {step}) in {world} process(es), {time.perf_counter() - t0:.1f}s")

    bf16 = cfg.train.dtype.on(device.type) == "bf16"
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else nullcontext
    batches = eval_batches(cfg, corpus, rank, world, device)
    byte_len = torch.from_numpy(token_byte_lengths(corpus.tokenizer))
    result["metrics"] = score_native(model, batches, byte_len, autocast)
    result["batches"] = len(batches)
    say(f"eval | step {step}: " + _line(result["metrics"]))
    if rank == 0 and ec.prompts and ec.max_new_tokens > 0:
        result["samples"] = samples(model, corpus, ec, device)
        for s in result["samples"]:
            say(f"sample | {s['prompt']!r} -> greedy {s['greedy']!r} | sampled {s['sampled']!r}")
    if dist.is_initialized():
        dist.barrier()
    result["eval_s"] = time.perf_counter() - t0
    return result


def export_checkpoint(
    cfg: TrainerCfg,
    step_dir: str,
    corpus: Corpus,
    out_dir: str,
    dtype: str = EXPORT_DTYPES[0],
    info: Optional[dict[str, Any]] = None,
    max_shard_size: Optional[int] = None,
) -> None:
    """The checkpoint's model, read from DCP tensor by tensor, and the run's tokenizer as a
    transformers Llama / Qwen2 (no transformers needed)."""
    from workloads.pretrain.checkpoint.hf_export import MAX_SHARD_SIZE, export
    from workloads.pretrain.checkpoint.hf_tokenizer import source_dir
    from workloads.pretrain.checkpoint.tensor_source import DcpSource

    extra = {EXPORT_INFO: json.dumps(info, indent=2)} if info else None
    source = DcpSource(step_dir)
    if cfg.model.lora.rank:  # the checkpoint holds adapters only: merged into the base the run read
        from workloads.pretrain.checkpoint.lora_export import MergedSource, base_source

        source = MergedSource(base_source(cfg), source, cfg, step_dir)
    export(
        source,
        cfg.model,
        out_dir,
        tokenizer_file=corpus.path / "tokenizer.json",
        eos_token=corpus.eos_token,
        dtype=dtype,
        extra_files=extra,
        tokenizer_source=source_dir(cfg.data.tokenizer),
        max_shard_size=max_shard_size or MAX_SHARD_SIZE,
    )


def _line(m: dict[str, float]) -> str:
    return (
        f"val_loss {m['val_loss']:.6f} | perplexity {m['perplexity']:.3f} | "
        f"bits/byte {m['bits_per_byte']:.4f} | {int(m['tokens']):,} tokens, {int(m['bytes']):,} bytes"
    )


# ----------------------------------------------------------------------------- process


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.pretrain.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the result as JSON here (rank 0)")
    parser.add_argument("--checkpoint", help="checkpoint root or step-N directory (default: checkpoint.dir)")
    parser.add_argument("--hf", help="score this Hugging Face export instead of a checkpoint")
    parser.add_argument("--export-hf", help="export the checkpoint to this directory")
    parser.add_argument("--export-peft", help="export a LoRA run's adapters (PEFT's format) to this directory")
    parser.add_argument("--export-dtype", choices=EXPORT_DTYPES, default=EXPORT_DTYPES[0], help="the export's weights")
    parser.add_argument(
        "--export-max-shard-size", type=int, help="bytes per safetensors shard (default 5e9, as save_pretrained)"
    )
    parser.add_argument("--run-id", help="the run the checkpoint belongs to, recorded in the export's provenance")
    try:
        args, cfg = parse_args(parser, argv, config_required=True)
        result = run(
            cfg,
            args.checkpoint,
            args.hf,
            args.export_hf,
            args.run_id,
            args.export_dtype,
            args.export_max_shard_size,
            args.export_peft,
        )
        if args.out and int(os.environ.get("RANK", "0")) == 0:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
        return 0
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    from workloads.protocol.process_exit import exit_process

    exit_process(main())
