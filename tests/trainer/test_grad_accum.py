"""Gradient accumulation (``train.micro_batch_size``): micro-batches reproduce the whole batch.

The step's loss is the sum over its micro-batches of (sum of their losses / the global batch's
count of targets), and FSDP reduces gradients once, after the last micro-batch (or after each, with
``parallel.grad_sync=micro_batch``). So 2 micro-batches of 8 give the losses of 1 batch of 16, in one
process and with FSDP over 2 ranks either way, and a run resumed with another accumulation setting
continues the curve it left.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import loss_env

pytestmark = pytest.mark.slow

STEPS = {"train.steps": 10, "train.batch_size": 16, "train.log_every": 1, "train.val_every": 5}


def _assert_same(got: dict, ref: dict, steps: range | None = None) -> None:
    for kind in ("train", "val"):
        want = {s: v for s, v in ref[kind].items() if steps is None or s in steps}
        assert sorted(got[kind]) == sorted(want), (kind, sorted(got[kind]), sorted(want))
        diffs = {s: abs(got[kind][s] - v) for s, v in want.items()}
        assert max(diffs.values()) <= 1e-5, (kind, diffs)


def test_micro_batches_reproduce_the_whole_batch(workload, tmp_path: Path, cache_dir: Path) -> None:
    from omegaconf import OmegaConf

    cfg = tmp_path / "config.yaml"
    OmegaConf.save(workload.cfg(**{"data.cache_dir": str(cache_dir), **STEPS}), cfg)

    def run(name: str, *overrides: str, nproc: int = 1) -> dict:
        proc = workload.run(
            ["--config", str(cfg), *overrides],
            loss_env(tmp_path / f"{name}.jsonl"),
            launcher=workload.torchrun(nproc) if nproc > 1 else None,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout, workload.loss_file(tmp_path / f"{name}.jsonl")

    _, whole = run("whole")  # 1 x 16
    assert sorted(whole["train"]) == list(range(1, 11)) and sorted(whole["val"]) == [0, 5, 10]
    ckpt = tmp_path / "ckpt"
    out, micro = run("micro", "train.micro_batch_size=8", f"checkpoint.dir={ckpt}", "checkpoint.every=5")
    assert "16 x 64 = 1,024 tokens/step (2 micro-batches of 8 per rank)" in out, out
    _assert_same(micro, whole)

    out, fsdp = run("fsdp", "parallel.dp_shard=2", "train.micro_batch_size=4", nproc=2)
    assert "(2 micro-batches of 4 per rank, gradients reduced once)" in out and "dp_shard 2" in out, out
    _assert_same(fsdp, whole)
    # reduce-scattered after every micro-batch (parallel.grad_sync=micro_batch): the same sums
    out, each = run(
        "each", "parallel.dp_shard=2", "train.micro_batch_size=4", "parallel.grad_sync=micro_batch", nproc=2
    )
    assert "(2 micro-batches of 4 per rank, gradients reduced after each)" in out, out
    _assert_same(each, whole)

    # killed after step 5's checkpoint; resumed with 4 micro-batches of 4 instead of 2 of 8
    shutil.rmtree(ckpt / "step-10")
    out, resumed = run("resumed", "train.micro_batch_size=4", f"checkpoint.dir={ckpt}", "checkpoint.every=5")
    assert "resumed from step 5" in out and "(4 micro-batches of 4 per rank)" in out, out
    _assert_same(resumed, whole, steps=range(6, 11))


def test_micro_batch_that_does_not_divide_is_refused(workload, tmp_path: Path, cache_dir: Path) -> None:
    from omegaconf import OmegaConf

    cfg = tmp_path / "config.yaml"
    OmegaConf.save(workload.cfg(**{"data.cache_dir": str(cache_dir), **STEPS}), cfg)
    proc = workload.run(["--config", str(cfg), "train.micro_batch_size=6"], loss_env(tmp_path / "l.jsonl"), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        "Bad value for 'train.micro_batch_size': 6 does not divide the 16 sequences each of 1 data-parallel "
        "rank(s) takes per step"
    ) in proc.stderr
