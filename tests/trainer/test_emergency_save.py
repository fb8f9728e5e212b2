"""The emergency save's decision on preemption uses the time a save takes to become durable: an
async save's background write and commit included, the loaded checkpoint's recorded time before
this attempt has saved, and an estimate from the state's size when nothing was ever measured.

In process, one rank, real checkpoints. A save is made slow from here (``_slow_commits``: a pause
before the marker, which for an async save runs after its background write has finished), so "at
least the pause" is a bound no scheduler can break.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from workloads.pretrain.checkpoint import dcp as dcp_checkpoint
from workloads.pretrain.checkpoint.dcp import Checkpointer
from workloads.pretrain.components import preempt
from workloads.pretrain.components.optim import build_optimizer
from workloads.pretrain.data import Sampler
from workloads.pretrain.model.transformer import build_model
from workloads.protocol.checkpoint_layout import MARKER

ONE_PROCESS = SimpleNamespace(rank=0, world_size=1)
PAUSE_S = 0.5
NO_HOST = torch.device("meta")  # one process decides without a tensor


def _slow_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every commit waits ``PAUSE_S`` before its completion marker (the seam tests/inject uses too)."""
    write_marker = Checkpointer._write_marker

    def pause_then_mark(self, *args):
        time.sleep(PAUSE_S)
        write_marker(self, *args)

    monkeypatch.setattr(Checkpointer, "_write_marker", pause_then_mark)


def _trained(cfg):
    """A tiny model, its AdamW state after one step, and a sampler: what a checkpoint holds."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, "cpu")
    opt = build_optimizer(model, cfg.train)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, 20_000).astype(np.uint16)
    sampler = Sampler(tokens, cfg.train.seq_len, cfg.train.batch_size, cfg.train.seed)
    b = sampler.next_batch()
    model(b.inputs, b.targets).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt, sampler


def _signalled(monkeypatch) -> preempt.Preemption:
    """A fresh flag, signalled now, installed as the one ``preempt.stop`` reads."""
    p = preempt.Preemption()
    p.signal_at, p.signame = time.monotonic(), "SIGTERM"
    monkeypatch.setattr(preempt, "PREEMPTION", p)
    return p


def test_first_save_of_an_attempt_is_estimated_from_the_state_size(workload, tmp_path, monkeypatch):
    cfg = workload.cfg(**{"checkpoint.dir": str(tmp_path / "ck")})
    model, opt, sampler = _trained(cfg)
    ck = Checkpointer(cfg, ONE_PROCESS, model, opt, sampler)

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert ck.state_bytes() >= 3 * params  # the weights and AdamW's two moments, all fp32
    need = ck.emergency_save_s()
    expected = dcp_checkpoint.ASSUMED_SAVE_OVERHEAD_S + ck.state_bytes() / dcp_checkpoint.ASSUMED_WRITE_BYTES_PER_S
    assert need == pytest.approx(expected) and need > 0  # not "instant", as the first save used to be

    p = _signalled(monkeypatch)
    assert p.check(NO_HOST, grace_s=need / 2, save_s=need) is False  # not enough grace: stop unsaved
    stopped = preempt.stop(ck, 1, False)
    assert not stopped.saved and stopped.checkpoint is None
    assert stopped.note.startswith("emergency save skipped") and "no save measured yet" in stopped.note
    assert "MB/s" in stopped.note and "checkpoint.preempt_grace_s" in stopped.note
    assert not (tmp_path / "ck" / "step-1").exists()

    assert p.check(NO_HOST, grace_s=need + 60, save_s=need) is True  # enough: save, and say why
    stopped = preempt.stop(ck, 1, True)
    assert stopped.saved and stopped.checkpoint == 1
    assert stopped.note.startswith("emergency save: needs") and "no save measured yet" in stopped.note


def test_async_save_counts_until_durable_not_just_staging(workload, tmp_path, monkeypatch):
    cfg = workload.cfg(**{"checkpoint.dir": str(tmp_path / "ck"), "checkpoint.async_save": True})
    model, opt, sampler = _trained(cfg)
    ck = Checkpointer(cfg, ONE_PROCESS, model, opt, sampler)
    _slow_commits(monkeypatch)  # the commit, after the background write, is slow
    ck.maybe_save(1, last=True)
    ck.close()

    assert ck.save_s >= PAUSE_S  # staging alone (what used to count) ends before the commit starts
    assert ck.emergency_save_s() == ck.save_s
    marker = json.loads((tmp_path / "ck" / "step-1" / MARKER).read_text())
    assert PAUSE_S <= marker["save_s"] <= ck.save_s and marker["world_size"] == 1

    p = _signalled(monkeypatch)
    assert p.check(NO_HOST, grace_s=PAUSE_S / 2, save_s=ck.emergency_save_s()) is False
    stopped = preempt.stop(ck, 2, False)
    assert "the last save took" in stopped.note and "staging" in stopped.note, stopped.note
    assert stopped.checkpoint == 1  # the previous checkpoint stands


def test_the_next_attempt_starts_from_the_recorded_save_time(workload, tmp_path, monkeypatch):
    cfg = workload.cfg(**{"checkpoint.dir": str(tmp_path / "ck")})
    model, opt, sampler = _trained(cfg)
    _slow_commits(monkeypatch)
    Checkpointer(cfg, ONE_PROCESS, model, opt, sampler).maybe_save(1, last=True)
    monkeypatch.undo()
    recorded = json.loads((tmp_path / "ck" / "step-1" / MARKER).read_text())["save_s"]
    assert recorded >= PAUSE_S

    model2, opt2, sampler2 = _trained(cfg)
    resumed = Checkpointer(cfg, ONE_PROCESS, model2, opt2, sampler2)
    assert resumed.load() == 1
    assert resumed.save_s is None  # nothing measured in this attempt yet
    assert resumed.emergency_save_s() == pytest.approx(recorded)  # not the size estimate
    p = _signalled(monkeypatch)
    assert p.check(NO_HOST, grace_s=PAUSE_S / 2, save_s=resumed.emergency_save_s()) is False
    note = preempt.stop(resumed, 2, False).note
    assert "no save yet in this attempt; step-1's took" in note, note

    # a marker from before save times were recorded: back to the estimate by size
    marker = tmp_path / "ck" / "step-1" / MARKER
    marker.write_text(json.dumps({"step": 1, "world_size": 1, "time": 0.0}))
    model3, opt3, sampler3 = _trained(cfg)
    old = Checkpointer(cfg, ONE_PROCESS, model3, opt3, sampler3)
    assert old.load() == 1 and old.previous_save is None
    expected = dcp_checkpoint.ASSUMED_SAVE_OVERHEAD_S + old.state_bytes() / dcp_checkpoint.ASSUMED_WRITE_BYTES_PER_S
    assert old.emergency_save_s() == pytest.approx(expected)
