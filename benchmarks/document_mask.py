"""What ``data.document_mask`` costs in training speed: the same windows with and without the mask.

    python benchmarks/document_mask.py

One model built by the trainer's code (``train.init_sharded``, fused kernels), one process, and the
trainer's step (loss, backward, grad-norm clip, AdamW, zero_grad) on the same batches of the bundled
pydoc corpus: plain causal attention (SDPA ``is_causal``) against the block-causal mask (one additive
mask per forward, shared by the layers; SDPA cannot use its flash kernel with a mask). The two
alternate window by window (these machines are noisy) and each keeps the median tokens/s.

- CPU: ``model=smoke`` at seq 1024, batch 4, fp32, one intra-op thread (the cores are shared; see
  kernels_cpu in docs/benchmarks.md).
- CUDA: ``model=1b`` at seq 8192, batch 1, bf16 autocast, per-block compile; also each side's peak
  memory.

Last line: ``document_mask: <masked / plain tokens/s>x`` (below 1 = the mask is slower).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ROUNDS, STEPS, WARMUP = 6, 3, 2


def config(cuda: bool):
    from omegaconf import OmegaConf

    from workloads.pretrain.contract.schema import TrainerCfg

    cfg = OmegaConf.structured(TrainerCfg)
    model = "1b" if cuda else "smoke"
    cfg.model = OmegaConf.merge(cfg.model, OmegaConf.load(REPO / f"conf/model/{model}.yaml"))
    shape = (
        ["train.seq_len=8192", "train.batch_size=1", "train.dtype=bf16", "model.compile=true"]
        if cuda
        else ["train.seq_len=1024", "train.batch_size=4", "train.dtype=fp32"]
    )
    merged = OmegaConf.merge(cfg, OmegaConf.from_dotlist(["model.kernels=fused", "model.max_seq_len=8192", *shape]))
    return OmegaConf.to_object(merged)  # the trainer's typed config, as config.load returns it


def main() -> None:
    from contextlib import nullcontext

    from workloads.pretrain.components.optim import build_optimizer
    from workloads.pretrain.data import prepare_corpus
    from workloads.pretrain.parallel.parallelize import ParallelDims
    from workloads.pretrain.train import DistEnv, init_sharded

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)
    cfg = config(cuda)
    tc = cfg.train
    corpus = prepare_corpus(cfg.data)
    plain, masked = (corpus.sequences(float(cfg.data.val_fraction), tc.seq_len, mask)[0] for mask in (False, True))
    batches = [
        (plain.batch(idx, 0, device), masked.batch(idx, 0, device))
        for idx in (range(i * tc.batch_size, (i + 1) * tc.batch_size) for i in range(STEPS))
    ]
    docs = [float(d) + 1 for _, b in batches for d in b.doc_ids.max(dim=1).values]
    torch.manual_seed(0)
    model = init_sharded(cfg, DistEnv(0, 1, 0, 1, device, ParallelDims(1, 1, 1, 1), None))
    opt = build_optimizer(model, tc)
    bf16 = tc.dtype == "bf16"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else nullcontext

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
