"""DCP checkpoints: marker semantics, retention, async isolation, exact resume, resharding, S3.

In-process tests use one process (no process group); the rest run the workload under torchrun
with 2 gloo ranks and a checkpoint directory, crash it with ``LLMCTL_FAIL_AT_STEP`` and rerun it:
the rerun must find the newest complete checkpoint on its own, as a preempted job does.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import loss_env

from workloads.pretrain.checkpoint.dcp import Checkpointer
from workloads.pretrain.components.optim import build_optimizer
from workloads.pretrain.data import Sampler
from workloads.pretrain.model.transformer import build_model
from workloads.protocol.checkpoint_layout import MARKER, latest_complete, list_checkpoints

SHORT = {"train.steps": 6, "train.log_every": 1, "train.val_every": 3}
ONE_PROCESS = SimpleNamespace(rank=0, world_size=1)


# ----------------------------------------------------------------------------- in process


def _trainer(cfg):
    """Model, optimizer and sampler as train.py builds them for one process."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, "cpu")
    opt = build_optimizer(model, cfg.train)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, 20_000).astype(np.uint16)
    return model, opt, Sampler(tokens, cfg.train.seq_len, cfg.train.batch_size, cfg.train.seed)


def _step(model, opt, sampler):
    b = sampler.next_batch()
    model(b.inputs, b.targets).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(model, snap):
    state = model.state_dict()
    assert state.keys() == snap.keys()
    for k, v in snap.items():
        assert torch.equal(state[k], v), k


def test_missing_marker_is_ignored_and_keep_prunes(workload, tmp_path):
    cfg = workload.cfg(**{"checkpoint.dir": str(tmp_path / "ck"), "checkpoint.every": 1, "checkpoint.keep": 2})
    model, opt, sampler = _trainer(cfg)
    ck = Checkpointer(cfg, ONE_PROCESS, model, opt, sampler)
    snaps = {}
    for step in (1, 2, 3):
        _step(model, opt, sampler)
        ck.maybe_save(step)
        snaps[step] = _snapshot(model)
    ck.close()
    assert list_checkpoints(str(tmp_path / "ck")) == {2: True, 3: True}  # keep=2 dropped step 1

    (tmp_path / "ck" / "step-3" / MARKER).unlink()  # as if killed while saving step 3
    assert latest_complete(str(tmp_path / "ck")) == 2
    model2, opt2, sampler2 = _trainer(cfg)
    assert Checkpointer(cfg, ONE_PROCESS, model2, opt2, sampler2).load() == 2
    _assert_same(model2, snaps[2])
    assert sampler2.consumed == 2 * cfg.train.batch_size

    # training on from step 2 rewrites step 3 (the partial directory is replaced) and commits it
    _step(model2, opt2, sampler2)
    Checkpointer(cfg, ONE_PROCESS, model2, opt2, sampler2).maybe_save(3, last=True)
    assert list_checkpoints(str(tmp_path / "ck")) == {2: True, 3: True}
    _assert_same(model2, snaps[3])  # same data, same optimizer state -> the same step 3


def test_gs_round_trip(workload, tmp_path, fake_gcs, monkeypatch):
    """``checkpoint.dir=gs://...`` through gcsfs against a real local GCS endpoint: a save commits
    its marker last, a load restores the same weights, and a step without its marker is not complete.
    """
    import uuid

    import fsspec

    for k, v in fake_gcs.items():
        monkeypatch.setenv(k, v)
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("gs", skip_instance_cache=True)
    fs.mkdir(bucket)
    root = f"gs://{bucket}/runs/a"
    cfg = workload.cfg(**{"checkpoint.dir": root})
    model, opt, sampler = _trainer(cfg)
    _step(model, opt, sampler)
    Checkpointer(cfg, ONE_PROCESS, model, opt, sampler).maybe_save(1, last=True)
    assert list_checkpoints(root) == {1: True}
    assert {p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/runs/a/step-1")} >= {MARKER, ".metadata"}

    model2, opt2, sampler2 = _trainer(cfg)
    assert Checkpointer(cfg, ONE_PROCESS, model2, opt2, sampler2).load() == 1
    _assert_same(model2, _snapshot(model))
    assert sampler2.consumed == cfg.train.batch_size

    fs.rm(f"{bucket}/runs/a/step-1/{MARKER}")  # as if killed while saving
    assert latest_complete(root) is None


def test_async_save_is_isolated_from_later_updates(workload, tmp_path):
    cfg = workload.cfg(**{"checkpoint.dir": str(tmp_path / "ck"), "checkpoint.async_save": True})
    model, opt, sampler = _trainer(cfg)
    _step(model, opt, sampler)
    ck = Checkpointer(cfg, ONE_PROCESS, model, opt, sampler)
    ck.maybe_save(1, last=True)
    saved = _snapshot(model)
    for _ in range(2):  # the optimizer updates parameters in place while the save may still run
        _step(model, opt, sampler)
    ck.close()
    assert list_checkpoints(str(tmp_path / "ck")) == {1: True}
    model2, opt2, sampler2 = _trainer(cfg)
    assert Checkpointer(cfg, ONE_PROCESS, model2, opt2, sampler2).load() == 1
    _assert_same(model2, saved)


def test_rng_state_is_restored(workload, tmp_path):
    cfg = workload.cfg(**{"checkpoint.dir": str(tmp_path / "ck")})
    model, opt, sampler = _trainer(cfg)
    torch.manual_seed(1234)
    Checkpointer(cfg, ONE_PROCESS, model, opt, sampler).maybe_save(1, last=True)
    expected = torch.rand(4)
    model2, opt2, sampler2 = _trainer(cfg)  # reseeds
    Checkpointer(cfg, ONE_PROCESS, model2, opt2, sampler2).load()
    assert torch.equal(torch.rand(4), expected)


# ----------------------------------------------------------------------------- torchrun


def _env(loss_file, extra=None) -> dict[str, str]:
    return loss_env(loss_file, **(extra or {}))


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, cache_dir, workload):
    """A straight 2-rank FSDP run, and the same run crashed at step 4 after saving step 2."""
    from omegaconf import OmegaConf

    tmp = tmp_path_factory.mktemp("ckpt")
    cfg = tmp / "config.yaml"
    OmegaConf.save(workload.cfg(**{"data.cache_dir": str(cache_dir), "parallel.dp_shard": 2, **SHORT}), cfg)
    straight = workload.run(
        ["--config", str(cfg), f"checkpoint.dir={tmp / 'straight'}"],
        _env(tmp / "straight.jsonl"),
        launcher=workload.torchrun(2),
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    crashed = workload.run(
        ["--config", str(cfg), f"checkpoint.dir={tmp / 'crashed'}", "checkpoint.every=2"],
        _env(tmp / "crashed.jsonl", {"LLMCTL_FAIL_AT_STEP": "4"}),
        launcher=workload.torchrun(2),
    )
    assert crashed.returncode != 0 and "LLMCTL_FAIL_AT_STEP=4" in crashed.stderr
    assert list_checkpoints(str(tmp / "crashed")) == {2: True}
    shutil.copytree(tmp / "crashed", tmp / "step2-pristine")
    return SimpleNamespace(
        tmp=tmp,
        cfg=cfg,
        losses=workload.loss_file(tmp / "straight.jsonl"),
        pristine=tmp / "step2-pristine",
        crashed=tmp / "crashed",
    )


def _resume(workload, runs, tmp_path, ckpt_dir, nproc, *overrides, extra_env=None):
    proc = workload.run(
        ["--config", str(runs.cfg), f"checkpoint.dir={ckpt_dir}", "checkpoint.every=2", *overrides],
        _env(tmp_path / "resumed.jsonl", extra_env),
        launcher=workload.torchrun(nproc) if nproc > 1 else None,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 2" in proc.stdout
    return workload.loss_file(tmp_path / "resumed.jsonl")


@pytest.mark.slow
def test_resume_is_exact(fsdp_runs, workload, tmp_path):
    """Same world size: steps 3..6 after the crash equal the uninterrupted run's, bit for bit."""
    got = _resume(workload, fsdp_runs, tmp_path, fsdp_runs.crashed, 2)
    ref = fsdp_runs.losses
    assert sorted(got["train"]) == [3, 4, 5, 6]
    assert {s: got["train"][s] for s in got["train"]} == {s: ref["train"][s] for s in got["train"]}
    assert got["val"] == {s: ref["val"][s] for s in (3, 6)}
    assert list_checkpoints(str(fsdp_runs.crashed)) == {4: True, 6: True}  # keep=2
    assert list_checkpoints(str(fsdp_runs.tmp / "straight")) == {6: True}  # every=0: the last step only


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, overrides",
    [
        (1, ["parallel.dp_shard=1"]),
        (2, ["parallel.dp_shard=1", "parallel.tp=2"]),
    ],
    ids=["to-1-process", "to-tp2"],
)
def test_fsdp_checkpoint_resumes_in_another_layout(fsdp_runs, workload, tmp_path, nproc, overrides):
    ckpt = tmp_path / "ck"
    shutil.copytree(fsdp_runs.pristine, ckpt)
    got = _resume(workload, fsdp_runs, tmp_path, ckpt, nproc, *overrides)
    for step, loss in got["train"].items():
        assert abs(loss - fsdp_runs.losses["train"][step]) <= 1e-5, (step, loss, fsdp_runs.losses["train"][step])


@pytest.mark.slow
def test_two_rank_checkpoint_loads_into_one_process_with_equal_state(fsdp_runs, workload, tmp_path):
    """Full state after loading == the 2-rank checkpoint consolidated by DCP's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dcp_to_torch_save(fsdp_runs.pristine / "step-2", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    cfg = workload.cfg(**{"checkpoint.dir": str(fsdp_runs.pristine), **SHORT})
    model, opt, sampler = _trainer(cfg)
    ck = Checkpointer(cfg, ONE_PROCESS, model, opt, sampler)
    assert ck.load() == 2
    model_sd, optim_sd = get_state_dict(model, opt)
    assert model_sd.keys() == full["model"].keys()
    for k, v in model_sd.items():
        assert torch.equal(v, full["model"][k]), k
    for fqn, state in optim_sd["state"].items():
        for name, v in state.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(full["optim"]["state"][fqn][name])), (fqn, name)
    assert sampler.consumed == 2 * cfg.train.batch_size


@pytest.mark.slow
def test_s3_round_trip(fsdp_runs, workload, tmp_path, s3_bucket):
    """2 ranks write DCP shards to S3 (moto server), crash, and resume exactly from there."""
    import s3fs

    url, s3_env = s3_bucket
    root = f"{url}/runs/a"
    crashed = workload.run(
        ["--config", str(fsdp_runs.cfg), f"checkpoint.dir={root}", "checkpoint.every=2"],
        _env(tmp_path / "crashed.jsonl", {**s3_env, "LLMCTL_FAIL_AT_STEP": "4"}),
        launcher=workload.torchrun(2),
    )
    assert crashed.returncode != 0 and "LLMCTL_FAIL_AT_STEP=4" in crashed.stderr, crashed.stderr[-3000:]
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/step-2")) == [
        ".complete",
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]

    got = _resume(workload, fsdp_runs, tmp_path, root, 2, extra_env=s3_env)
    assert got["train"] == {s: fsdp_runs.losses["train"][s] for s in (3, 4, 5, 6)}
    assert list_checkpoints(root) == {4: True, 6: True}
