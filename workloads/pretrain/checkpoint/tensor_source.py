"""Where an export's weights come from, one tensor at a time.

The Hugging Face export (``hf_export``) never asks for the whole model: it asks a source which
tensors exist (name, shape, dtype: enough to plan the output shards before reading anything) and
then reads them one by one, so a 70B checkpoint is written holding about one output shard, not
280 GB. Two sources:

* ``StateDictSource``: a state dict already in memory (tests, a model in hand).
* ``DcpSource``: the model part of a DCP checkpoint (``step-N/``, local or any fsspec URL). Each
  read is a ``dcp.load`` of one key into a plain tensor, so DCP copies in that tensor's pieces
  from whichever ranks' files hold them (FSDP, TP, one process: any saving layout).

A source is also the seam for anything that changes weights on the way out (e.g. merging LoRA
adapters into the base): wrap a source, hide the names that should not be exported from
``specs`` and return the changed tensor from ``read``. Names are native (``layers.0.attention.wq.weight``);
``hf_export`` renames and re-lays them out.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Mapping, Protocol

import torch


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n


class TensorSource(Protocol):
    def specs(self) -> dict[str, TensorSpec]:
        """Every tensor the source holds: native name -> shape and dtype, in model order."""
        ...

    def read(self, name: str) -> torch.Tensor:
        """One whole tensor (CPU), not kept by the source after it is returned."""
        ...


class StateDictSource:
    """A state dict in memory (plain tensors; a DTensor is gathered when read)."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self._state = state

    def specs(self) -> dict[str, TensorSpec]:
        return {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in self._state.items()}

    def read(self, name: str) -> torch.Tensor:
        t = self._state[name].detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        return t.to("cpu")


class DcpSource:
    """The tensors under ``prefix`` (the trainer saves the model as ``{"model": ...}``) of a DCP
    checkpoint directory, read one key per ``dcp.load``."""

    def __init__(self, step_dir: str, prefix: str = "model"):
        from torch.distributed.checkpoint._storage_utils import _storage_setup
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.step_dir, self.prefix = str(step_dir), prefix
        # the reader dcp.load(checkpoint_id=...) would pick: a local path or an fsspec URL
        self._reader = _storage_setup(None, self.step_dir, reader=True)
        metadata = self._reader.read_metadata()
        # dcp.load reads .metadata again on every call; one read serves every tensor (it can be
        # megabytes for a checkpoint of many ranks, and an export makes one call per tensor)
        self._reader.read_metadata = lambda *args, **kwargs: metadata
        head = f"{prefix}."
        self._specs = {
            key[len(head) :]: TensorSpec(tuple(meta.size), meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(head) and isinstance(meta, TensorStorageMetadata)
        }
        if not self._specs:
            raise ValueError(f"{self.step_dir} holds no '{prefix}' tensors: not a checkpoint of this trainer")

    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def read(self, name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        spec = self._specs[name]
        out = torch.empty(spec.shape, dtype=spec.dtype)
        with warnings.catch_warnings():  # this process reads on its own: DCP warns that it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({self.prefix: {name: out}}, storage_reader=self._reader, no_dist=True)
        return out
