"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP) on any fsspec location.

Layout, under ``checkpoint.dir`` (local path, ``file://``, ``s3://``, ``gs://`` ...; finding the
newest complete step is ``checkpoint_layout``'s job)::

    step-<N>/.metadata, __<rank>_0.distcp   DCP files: every rank writes its own shards
    step-<N>/.complete                      JSON marker, written LAST by rank 0

A checkpoint counts only once its marker exists. Rank 0 writes it after DCP's save has
finished on every rank (DCP's final gather to rank 0, followed by a barrier for synchronous saves;
for async saves, once the background save's future has resolved). A run killed mid-save leaves a
directory without a marker: it is ignored on load and deleted by the next successful save.
Likewise an async save still in flight when the run fails is never committed.

How long a save takes to become durable (written, uploaded and marked: for an async save the
background part too, measured when its future resolves) is kept for the emergency save on
preemption (``emergency_save_s``, ``components/preempt.py``) and recorded in the marker, so the
next attempt's first decision starts from a measured time instead of guessing.

What is saved: model and optimizer state as FQN-keyed (possibly sharded) DTensors, so a
checkpoint loads into any layout (FSDP -> TP, 2 ranks -> 1, ...); the step (the LR schedule is a
pure function of it); the sampler's position (world-size independent); RNG states. Every rank
seeds identically and the training step draws no random numbers, so all ranks hold the same RNG
state: rank 0's copy (CPU, and CUDA when present) is stored once and restored on every rank,
which stays right under any resharding.

With LoRA (``model.lora.rank > 0``) the model part holds only what trains, the adapters
(``ignore_frozen_params``), and the optimizer state holds only theirs: the frozen base is not
written a second time (it would be the bulk of every checkpoint: 16 GB for an 8B base in bf16,
for adapters of tens of MB). Resume rebuilds the base first, as the run's start does (read from
``model.init_from``, NF4-quantized again for QLoRA, or drawn from ``train.seed`` without it), then
loads adapters, optimizer, sampler and RNG over it (``strict=False`` for the base's keys only:
every adapter key must be in the checkpoint, DCP refuses a missing one).
"""

from __future__ import annotations

import json
import time
import warnings
from concurrent.futures import Future
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from workloads.protocol.checkpoint_layout import (
    MARKER,
    fs_and_path,
    join,
    latest_complete,
    list_checkpoints,
    step_dir,
)
from workloads.protocol.schema import TrainerCfg

# a one-process run saves without a process group on purpose (no_dist=True); DCP warns on every save
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)


# Before any save of this run has been measured, a save is assumed to take a fixed start-up cost plus
# the rank's share of the state written at this rate: an assumption on the slow side (one process
# writing to an object store through fsspec), so that an emergency save is skipped rather than cut
# off by the platform's kill. One measured save replaces it (docs/resume.md).
ASSUMED_WRITE_BYTES_PER_S = 200e6
ASSUMED_SAVE_OVERHEAD_S = 1.0


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t`` (its shard of a DTensor): what it writes into a checkpoint."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _rng_state() -> dict[str, bytes | None]:
    """Bytes, not tensors: DCP stores them as one object per key, whatever the device."""
    cuda = torch.cuda.get_rng_state().numpy().tobytes() if torch.cuda.is_available() else None
    return {"cpu": torch.get_rng_state().numpy().tobytes(), "cuda": cuda}


def _set_rng_state(state: dict[str, bytes | None]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["cpu"]), dtype=torch.uint8))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))


class Checkpointer:
    """Save every ``checkpoint.every`` steps (and always at the last), keep the newest ``keep``,
    resume from the newest complete checkpoint. Inert when ``checkpoint.dir`` is unset.

    ``sampler`` needs ``state_dict``/``load_state_dict``; ``env`` needs ``rank``/``world_size``.
    """

    def __init__(
        self, cfg: TrainerCfg, env: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sampler: Any
    ):
        ck = cfg.checkpoint
        self.root = str(ck.dir) if ck.dir else None
        self.every, self.keep, self.async_save = int(ck.every), int(ck.keep), bool(ck.async_save)
        self.env, self.model, self.optimizer, self.sampler = env, model, optimizer, sampler
        # the dtype this run computes in, on the device its parameters are on (``train.dtype=auto``
        # resolved): recorded in each marker, so an export de-quantizes a QLoRA base as training did
        # whichever machine exports it
        device = next(model.parameters()).device.type
        self.compute_dtype = cfg.train.dtype.on("cuda" if device == "cuda" else "cpu")
        # LoRA: the frozen base stays out of the checkpoint (see the module docstring)
        self.options = StateDictOptions(ignore_frozen_params=True, strict=False) if cfg.model.lora.rank else None
        self._pending: tuple[int, Future, float] | None = None  # (step, upload future, start time)
        self._uploaded_at: Optional[float] = None  # when the pending save's future resolved
        self.last_committed: int | None = None  # newest step with a marker (loaded or saved)
        # The emergency save on preemption is judged by how long a save takes to become durable:
        # the last one of this attempt (for an async save: staging, background write and commit),
        # else the loaded checkpoint's (its marker: seconds, world size), else an estimate by size.
        self.save_s: Optional[float] = None
        self.stage_s = 0.0  # the part of the last async save that blocked training (staging)
        self.previous_save: Optional[tuple[float, int]] = None
        self._state_bytes: Optional[int] = None
        # Background saves run collectives from another thread: give them their own gloo group so
        # they never interleave with training's collectives (and work when training uses NCCL).
        self._pg = dist.new_group(backend="gloo") if self.async_save and dist.is_initialized() else None

    # ------------------------------------------------------------------ state

    def _state(self, step: int) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "train": {"step": step, "sampler": self.sampler.state_dict(), "rng": _rng_state()},
        }

    def _step_dir(self, step: int) -> str:
        return step_dir(self.root, step)

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    # ------------------------------------------------------------------ load

    def load(self) -> int:
        """Restore the newest complete checkpoint; returns its step, or 0 when there is none."""
        if not self.root:
            return 0
        found = [self._find_latest() if self.env.rank == 0 else None]
        if dist.is_initialized():  # one listing, so every rank loads the same step
            dist.broadcast_object_list(found, src=0)
        step, self.previous_save = found[0] or (None, None)
        if step is None:
            return 0
        state = self._state(0)
        dcp.load(state, checkpoint_id=self._step_dir(step), no_dist=not dist.is_initialized())
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self.options,
        )
        self.last_committed = step
        self.sampler.load_state_dict(state["train"]["sampler"])
        _set_rng_state(state["train"]["rng"])
        if int(state["train"]["step"]) != step:
            raise RuntimeError(f"{self._step_dir(step)} holds step {state['train']['step']}, not {step}")
        return step

    def _find_latest(self) -> Optional[tuple[int, Optional[tuple[float, int]]]]:
        """Rank 0: the newest complete step and the save time its marker records (None in markers
        written before it was recorded, or unreadable)."""
        step = latest_complete(self.root)
        if step is None:
            return None
        try:
            fs, path = fs_and_path(self._step_dir(step))
            with fs.open(join(path, MARKER)) as f:
                marker = json.load(f)
            return step, (float(marker["save_s"]), int(marker["world_size"]))
        except (OSError, ValueError, KeyError, TypeError):
            return step, None

    # ------------------------------------------------------------------ emergency save

    def emergency_save_s(self) -> float:
        """Seconds from now until an emergency save of the current step would be durable: what is
        left of a save still in flight (the new one waits for it) plus one whole save. Every rank
        computes its own; the ranks' agreement takes the largest (``preempt.Preemption.check``)."""
        one = self._one_save_s()
        if self._pending is not None and not self._pending[1].done():
            return one + max(0.0, one - (time.monotonic() - self._pending[2]))
        return one

    def _one_save_s(self) -> float:
        if self.save_s is not None:
            return self.save_s
        if self.previous_save is not None:  # fewer ranks than then: each writes more
            seconds, world = self.previous_save
            return seconds * max(1.0, world / self.env.world_size)
        return ASSUMED_SAVE_OVERHEAD_S + self.state_bytes() / ASSUMED_WRITE_BYTES_PER_S

    def state_bytes(self) -> int:
        """Bytes of model and optimizer state this rank writes (an upper bound: DCP writes a
        replicated shard once). Counted once the optimizer has its state (after the first step)."""
        if self._state_bytes is not None:
            return self._state_bytes
        saved = (p for p in self.model.parameters() if p.requires_grad or self.options is None)  # LoRA: adapters
        params = sum(_local_bytes(p) for p in saved)
        optim = sum(
            _local_bytes(v) for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)
        )
        if self.optimizer.state:
            self._state_bytes = params + optim
        return params + optim

    def describe_save_estimate(self) -> str:
        """Where ``emergency_save_s`` comes from, for the preemption log line."""
        if self.save_s is not None:
            how = f"the last save took {self.save_s:.1f}s to become durable"
            if self.async_save:
                how += f": {self.stage_s:.1f}s staging, the rest writing in the background"
        elif self.previous_save is not None:
            seconds, world = self.previous_save
            how = f"no save yet in this attempt; step-{self.last_committed}'s took {seconds:.1f}s on {world} ranks"
        else:
            how = (
                f"no save measured yet: {self.state_bytes() / 1e9:.2f} GB of state on this rank, assumed written at"
                f" {ASSUMED_WRITE_BYTES_PER_S / 1e6:.0f} MB/s + {ASSUMED_SAVE_OVERHEAD_S:.0f}s"
            )
        if self._pending is not None and not self._pending[1].done():
            how += f", after step-{self._pending[0]}'s save still in flight"
        return how

    # ------------------------------------------------------------------ save

    def maybe_save(self, step: int, *, last: bool = False) -> None:
        """Save at multiples of ``every`` (0: never mid-run) and at the last step."""
        if not self.root:
            return
        if self._pending and self._pending[1].done():
            self._finish_pending()
        if last or (self.every > 0 and step % self.every == 0):
            self.save(step)

    def save(self, step: int) -> None:
        self._finish_pending()  # at most one save in flight; it must be complete before the next
        t0 = time.monotonic()
        path = self._step_dir(step)
        if self.env.rank == 0:  # leftovers of a crashed save of this step
            fs, p = fs_and_path(path)
            if fs.exists(p):
                fs.rm(p, recursive=True)
        self._barrier()  # before any rank creates the directory again
        state = self._state(step)
        if self.async_save:
            fut = dcp.async_save(state, checkpoint_id=path, process_group=self._pg, no_dist=not dist.is_initialized())
            upload = getattr(fut, "upload_completion", fut)
            self._uploaded_at = None
            upload.add_done_callback(self._on_uploaded)  # the durable time, not the next step's
            self._pending = (step, upload, t0)
            self.stage_s = time.monotonic() - t0
        else:
            dcp.save(state, checkpoint_id=path, no_dist=not dist.is_initialized())
            self._barrier()
            self._commit(step, time.monotonic() - t0)

    def _on_uploaded(self, _fut: Future) -> None:
        self._uploaded_at = time.monotonic()

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        step, fut, t0 = self._pending
        self._pending = None
        fut.result()  # on rank 0 this returns after every rank's shards and the metadata are written
        self._commit(step, (self._uploaded_at or time.monotonic()) - t0)

    def _commit(self, step: int, written_s: float) -> None:
        """Rank 0: write the marker, then drop all but the newest ``keep`` and stale partial saves.
        ``written_s``: how long the save took up to here; with the commit, that is ``save_s``."""
        t0 = time.monotonic()
        self.last_committed = step
        if self.env.rank != 0:
            self.save_s = written_s
            return
        self._write_marker(step, t0, written_s)
        fs = fs_and_path(self._step_dir(step))[0]
        ckpts = list_checkpoints(self.root)
        keep = sorted((s for s, ok in ckpts.items() if ok), reverse=True)[: self.keep]
        for s, ok in ckpts.items():
            if s not in keep and (ok or s < step):
                fs.rm(fs_and_path(self._step_dir(s))[1], recursive=True)
        self.save_s = written_s + time.monotonic() - t0  # the pruning too: the run waits for it on a stop

    def _write_marker(self, step: int, since: float, written_s: float) -> None:
        """Rank 0: step-N's completion marker, the moment the checkpoint starts to count (a crash before
        it leaves a written but unmarked save, which ``load`` skips). ``save_s`` in it is the whole save:
        ``written_s`` plus the time since ``since``."""
        fs, path = fs_and_path(self._step_dir(step))
        save_s = written_s + time.monotonic() - since
        with fs.open(join(path, MARKER), "w") as f:
            json.dump(
                {
                    "step": step,
                    "world_size": self.env.world_size,
                    "time": time.time(),
                    "save_s": save_s,
                    "compute_dtype": self.compute_dtype,
                },
                f,
            )

    def wait(self) -> None:
        """Commit an async save still in flight (its step is then ``last_committed``)."""
        self._finish_pending()

    def settle(self) -> None:
        """Every rank waits until rank 0 has committed the last save (only rank 0 writes markers)."""
        self._barrier()

    def close(self) -> None:
        """Wait for an async save and commit it (call at exit)."""
        self._finish_pending()
        if self._pg is not None:
            dist.destroy_process_group(self._pg)
            self._pg = None
