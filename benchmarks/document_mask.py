"""What ``data.document_mask`` costs in training speed: the same windows with and without the mask.

    python benchmarks/document_mask.py

One model built by the trainer's code (``train.init_sharded``, fused kernels), one process, and the
trainer's step (loss, backward, grad-norm clip, AdamW, zero_grad) on the same batches of the bundled
pydoc corpus: plain causal attention (SDPA ``is_causal``) against the block-causal mask (one additive
mask per forward, shared by the layers; torch picks the attention kernel per call: on an H100 with
torch 2.11, cuDNN for both). The two alternate window by window (these machines are noisy) and each
keeps the median tokens/s.

- CPU: ``model=smoke`` at seq 1024, batch 4, fp32, one intra-op thread (the cores are shared; see
  kernels_cpu in docs/benchmarks.md).
- CUDA: ``model=1b`` at seq 8192, batch 1, bf16 (FSDP2 on a 1-rank mesh, as the trainer), per-block
  compile; also each side's peak memory.
- ``DOCUMENT_MASK_SHAPE=tiny``: ``model=smoke`` at seq 256, batch 2, 2 windows of 1 step, on CPU
  only: a few seconds, so ``tests/benchmarks/test_gpu_agenda.py`` can run the script through
  ``gpu_agenda.sh C``; its figure means nothing.

Last line: ``document_mask: <masked / plain tokens/s>x`` (below 1 = the mask is slower).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ROUNDS, STEPS, WARMUP = 6, 3, 2
SHAPES = ("default", "tiny")


def shape() -> str:
    value = os.environ.get("DOCUMENT_MASK_SHAPE", "default")
    if value not in SHAPES:
        print(f"DOCUMENT_MASK_SHAPE must be one of {SHAPES}, got {value!r}", file=sys.stderr)
        sys.exit(3)
    return value


def config(cuda: bool, tiny: bool = False):
    from omegaconf import OmegaConf

    from workloads.protocol.schema import TrainerCfg

    cfg = OmegaConf.structured(TrainerCfg)
    model = "1b" if cuda else "smoke"
    cfg.model = OmegaConf.merge(cfg.model, OmegaConf.load(REPO / f"conf/model/{model}.yaml"))
    if cuda:
        dims = ["train.seq_len=8192", "train.batch_size=1", "train.dtype=bf16", "model.compile=true"]
    elif tiny:
        dims = ["train.seq_len=256", "train.batch_size=2", "train.dtype=fp32"]
    else:
        dims = ["train.seq_len=1024", "train.batch_size=4", "train.dtype=fp32"]
    merged = OmegaConf.merge(cfg, OmegaConf.from_dotlist(["model.kernels=fused", "model.max_seq_len=8192", *dims]))
    return OmegaConf.to_object(merged)  # the trainer's typed config, as config.load returns it


def main() -> None:
    from workloads.pretrain.components.optim import build_optimizer
    from workloads.pretrain.data import prepare_corpus
    from workloads.pretrain.parallel.parallelize import autocast_context
    from workloads.pretrain.train import init_distributed, init_sharded

    global ROUNDS, STEPS, WARMUP
    tiny = shape() == "tiny"
    cuda = torch.cuda.is_available() and not tiny
    if tiny:
        ROUNDS, STEPS, WARMUP = 2, 1, 1
    device = torch.device("cuda" if cuda else "cpu")
    cfg = config(cuda, tiny)
    env = init_distributed(cfg)  # the trainer's 1-rank group and mesh: its FSDP bf16 recipe
    if not cuda:
        torch.set_num_threads(1)
    tc = cfg.train
    corpus = prepare_corpus(cfg.data)
    plain, masked = (corpus.sequences(float(cfg.data.val_fraction), tc.seq_len, mask)[0] for mask in (False, True))
    batches = [
        (plain.batch(idx, 0, device), masked.batch(idx, 0, device))
        for idx in (range(i * tc.batch_size, (i + 1) * tc.batch_size) for i in range(STEPS))
    ]
    docs = [float(d) + 1 for _, b in batches for d in b.doc_ids.max(dim=1).values]
    torch.manual_seed(0)
    model = init_sharded(cfg, env)
    opt = build_optimizer(model, tc)
    autocast = autocast_context(model, cfg, device.type)  # none under FSDP, as in train.py

    def steps(which: int) -> None:
        for pair in batches:
            b = pair[which]
            with autocast():
                loss = model(b.inputs, b.targets, **b.model_kwargs())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    names = ("plain", "masked")
    rates: dict[str, list[float]] = {n: [] for n in names}
    peaks = dict.fromkeys(names, 0.0)
    for which in (0, 1):
        for _ in range(WARMUP):
            steps(which)  # compile / allocator warm-up, untimed
    tokens = STEPS * tc.batch_size * tc.seq_len
    for r in range(ROUNDS):
        for which in (0, 1) if r % 2 == 0 else (1, 0):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            steps(which)
            rates[names[which]].append(tokens / (time.perf_counter() - t0))
            if cuda:
                peaks[names[which]] = max(peaks[names[which]], torch.cuda.max_memory_allocated() / 2**30)
    where = torch.cuda.get_device_name() if cuda else "CPU, 1 thread"
    print(
        f"model {cfg.model.name}, seq {tc.seq_len} x batch {tc.batch_size}, "
        f"{getattr(tc.dtype, 'value', tc.dtype)}, {where}; "
        f"about {statistics.mean(docs):.1f} documents per window"
    )
    for n in names:
        mem = f", peak {peaks[n]:.2f} GiB" if cuda else ""
        print(
            f"{n:>7}: {statistics.median(rates[n]):,.0f} tok/s "
            f"(windows {', '.join(f'{x:,.0f}' for x in rates[n])}){mem}"
        )
    print(f"document_mask: {statistics.median(rates['masked']) / statistics.median(rates['plain']):.2f}x")


if __name__ == "__main__":
    main()
