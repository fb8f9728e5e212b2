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

What is saved: model and optimizer state as FQN-keyed (possibly sharded) DTensors, so a
checkpoint loads into any layout (FSDP -> TP, 2 ranks -> 1, ...); the step (the LR schedule is a
pure function of it); the sampler's position (world-size independent); RNG states. Every rank
seeds identically and the training step draws no random numbers, so all ranks hold the same RNG
state: rank 0's copy (CPU, and CUDA when present) is stored once and restored on every rank,
which stays right under any resharding.
"""

from __future__ import annotations

import json
import time
import warnings
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from workloads.pretrain.components import test_hooks
from workloads.pretrain.contract.checkpoint_layout import (
    MARKER,
    fs_and_path,
    join,
    latest_complete,
    list_checkpoints,
    step_dir,
)
from workloads.pretrain.contract.schema import TrainerCfg

# a one-process run saves without a process group on purpose (no_dist=True); DCP warns on every save
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)


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
        self._pending: tuple[int, Future] | None = None
        self.last_committed: int | None = None  # newest step with a marker (loaded or saved)
        self.save_s = 0.0  # duration of the last save: the emergency save on preemption is judged by it
        # Background saves run collectives from another thread: give them their own gloo group so
        # they never interleave with training's collectives (and work when training uses NCCL).
        self._pg = dist.new_group(backend="gloo") if self.async_save and dist.is_initialized() else None

    # ------------------------------------------------------------------ state

    def _state(self, step: int) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
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
        found = [latest_complete(self.root) if self.env.rank == 0 else None]
        if dist.is_initialized():  # one listing, so every rank loads the same step
            dist.broadcast_object_list(found, src=0)
        step = found[0]
        if step is None:
            return 0
        state = self._state(0)
        dcp.load(state, checkpoint_id=self._step_dir(step), no_dist=not dist.is_initialized())
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.last_committed = step
        self.sampler.load_state_dict(state["train"]["sampler"])
        _set_rng_state(state["train"]["rng"])
        if int(state["train"]["step"]) != step:
            raise RuntimeError(f"{self._step_dir(step)} holds step {state['train']['step']}, not {step}")
        return step

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
            self._pending = (step, getattr(fut, "upload_completion", fut))
        else:
            dcp.save(state, checkpoint_id=path, no_dist=not dist.is_initialized())
            self._barrier()
            self._commit(step)
        self.save_s = time.monotonic() - t0

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        step, fut = self._pending
        self._pending = None
        fut.result()  # on rank 0 this returns after every rank's shards and the metadata are written
        self._commit(step)

    def _commit(self, step: int) -> None:
        """Rank 0: write the marker, then drop all but the newest ``keep`` and stale partial saves."""
        self.last_committed = step
        if self.env.rank != 0:
            return
        pause = test_hooks.checkpoint_pause_s()
        if pause > 0:  # test hook: a SIGKILL now leaves step-N written but unmarked
            print(
                f"checkpoint | step-{step} written, pausing {pause:g}s before its marker ({test_hooks.CKPT_PAUSE_ENV})",
                flush=True,
            )
            time.sleep(pause)
        fs, path = fs_and_path(self._step_dir(step))
        with fs.open(join(path, MARKER), "w") as f:
            json.dump({"step": step, "world_size": self.env.world_size, "time": time.time()}, f)
        ckpts = list_checkpoints(self.root)
        keep = sorted((s for s, ok in ckpts.items() if ok), reverse=True)[: self.keep]
        for s, ok in ckpts.items():
            if s not in keep and (ok or s < step):
                fs.rm(fs_and_path(self._step_dir(s))[1], recursive=True)

    def close(self) -> None:
        """Wait for an async save and commit it (call at exit)."""
        self._finish_pending()
        if self._pg is not None:
            dist.destroy_process_group(self._pg)
            self._pg = None
