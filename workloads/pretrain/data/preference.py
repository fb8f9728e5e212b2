"""Preference pairs (``data.format=preference``) as batches for DPO: each pair two sequences.

The cache holds pair j as examples 2j (the prompt and its chosen answer) and 2j + 1 (the same
prompt and its rejected answer), with the answer's tokens as targets (``chat.encode_pair``).
A batch of pairs is TRL's concatenated batch: the chosen rows first, then the rejected rows in the
same order, each row one example right-padded to ``train.seq_len`` positions (no packing: the
two rows of a pair are what the loss compares). ``train.batch_size`` counts pairs, so the
sampler's sequences are the pairs and a batch's ``global_targets`` is its global count of pairs:
the loss is the mean over the global batch's pairs at any world size and micro-batching.

An answer longer than the row is cut (its end not learned, in both the policy's and the
reference's log-probability alike) and counted for the trainer's warning; a prompt that leaves
no answer token in the row is refused, naming its ``file:line``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workloads.planner import data_split
from workloads.pretrain.data.chat import ExampleError
from workloads.pretrain.data.sampler import Batch
from workloads.pretrain.model.losses import IGNORE_INDEX


@dataclass
class PairBatch(Batch):
    """A batch of ``pairs`` pairs: rows ``[:pairs]`` chosen, ``[pairs:]`` rejected."""

    pairs: int = 0

    def split(self, micro_batch_size: int | None) -> list[Batch]:
        """Micro-batches of ``micro_batch_size`` pairs, each again chosen rows then rejected rows."""
        if not micro_batch_size or micro_batch_size >= self.pairs:
            return [self]
        out: list[Batch] = []
        for start in range(0, self.pairs, micro_batch_size):
            rows = list(range(start, min(start + micro_batch_size, self.pairs)))
            rows += [self.pairs + r for r in rows]
            out.append(PairBatch(self.inputs[rows], self.targets[rows], self.global_targets, pairs=len(rows) // 2))
        return out


class PreferencePairs:
    """Pairs ``[first, first + n)`` of the cached examples, as rows of ``seq_len`` positions."""

    def __init__(
        self,
        tokens: np.ndarray,
        mask: np.ndarray,
        offsets: np.ndarray,
        first: int,
        n: int,
        seq_len: int,
        pad_id: int,
    ):
        self.tokens, self.mask, self.offsets = tokens, mask, offsets
        self.first, self.n, self.seq_len, self.pad_id = first, n, seq_len, pad_id
        lengths = np.diff(offsets[2 * first : 2 * (first + n) + 1]) - 1  # positions each example needs
        self.truncated = int((lengths.reshape(-1, 2) > seq_len).any(axis=1).sum())  # pairs with an answer cut
        self.longest = int(lengths.max()) if len(lengths) else 0

    def __len__(self) -> int:
        return self.n

    def targets_in(self, indices) -> int:
        """Pairs, not tokens: DPO's loss is the mean over the global batch's pairs."""
        return len(list(indices))

    def batch(self, indices, global_targets: int, device) -> PairBatch:
        pairs = [self.first + int(i) for i in indices]
        rows = [self._row(2 * j) for j in pairs] + [self._row(2 * j + 1) for j in pairs]
        x, y = (torch.from_numpy(np.stack(col)).to(device) for col in zip(*rows))
        return PairBatch(x, y, global_targets, pairs=len(pairs))

    def _row(self, example: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = int(self.offsets[example]), int(self.offsets[example + 1])
        length = min(end - start - 1, self.seq_len)  # input t predicts token t + 1
        x = np.full(self.seq_len, self.pad_id, np.int64)
        y = np.full(self.seq_len, IGNORE_INDEX, np.int64)
        x[:length] = self.tokens[start : start + length]
        nxt = self.tokens[start + 1 : start + 1 + length].astype(np.int64)
        y[:length] = np.where(self.mask[start + 1 : start + 1 + length] > 0, nxt, IGNORE_INDEX)
        return x, y


@dataclass
class PairSource:
    """Per cached pair: its prompt's length in tokens and where it came from (``file:line``)."""

    prompt_tokens: np.ndarray
    origins: list[str]

    def split(
        self, tokens: np.ndarray, mask: np.ndarray, offsets: np.ndarray, val_fraction: float, seq_len: int, pad_id: int
    ) -> tuple[PreferencePairs, PreferencePairs]:
        """(train, val) pairs: val is the last ``val_fraction`` of them. A prompt that leaves no
        answer token within ``seq_len`` positions is refused first (``ExampleError``)."""
        too_long = np.flatnonzero(self.prompt_tokens > seq_len)
        if len(too_long):
            j = int(too_long[0])
            longest = int(self.prompt_tokens.max())
            raise ExampleError(
                f"{self.origins[j]}: the prompt is {int(self.prompt_tokens[j])} tokens, longer than "
                f"train.seq_len={seq_len}, so no answer token fits ({len(too_long)} pair(s) like it). Fix: "
                f"train.seq_len={longest + 64} or more, or shorten or drop those prompts"
            )
        n = len(self.prompt_tokens)
        n_val = data_split.val_count(n, val_fraction)
        if n_val <= 0 or n_val >= n:
            raise ValueError(f"data.val_fraction={val_fraction} of {n} pairs leaves no validation or no training pairs")
        cut = n - n_val
        return (
            PreferencePairs(tokens, mask, offsets, 0, cut, seq_len, pad_id),
            PreferencePairs(tokens, mask, offsets, cut, n_val, seq_len, pad_id),
        )
