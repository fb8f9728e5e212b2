"""Batches from a tokenized corpus: random training sequences resumable exactly, a fixed validation set.

Two kinds of sequences (``data.format``):

* ``Windows`` (text): consecutive ``seq_len + 1``-token windows of the token stream; documents run
  together, separated by the end-of-text token, every position is a target (pretraining). With
  ``data.document_mask`` each token also carries its document's index and its position in it, as
  packed examples do: attention stays inside the document (its end-of-text token included, the
  first token of the next one predicted from it) and RoPE restarts at each.
* ``PackedExamples`` (sft): whole fine-tuning examples packed into sequences of ``seq_len``
  positions, in order, as many as fit (next-fit). Each packed token carries its position within its
  example (RoPE restarts at 0) and its example's index, and attention stays inside the example
  (block-causal mask), so a packed sequence computes exactly what the examples would one at a time.
  Targets outside the loss mask, across example boundaries and on padding are ``IGNORE_INDEX``.
  An example longer than ``seq_len + 1`` tokens is truncated to its first ``seq_len + 1``.

Every global batch carries its global count of targets (``Batch.global_targets``): the loss is
the sum over the global batch divided by that count, whatever the number of ranks or micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from workloads.planner import data_split
from workloads.pretrain.model.losses import IGNORE_INDEX


@dataclass
class Batch:
    """This rank's slice of one global batch, each tensor [local_batch, seq_len]."""

    inputs: torch.Tensor
    targets: torch.Tensor  # IGNORE_INDEX where no loss is taken
    global_targets: int  # targets (not ignored) in the whole global batch, over all ranks
    positions: Optional[torch.Tensor] = None  # position of each token in its example (packed only)
    doc_ids: Optional[torch.Tensor] = None  # example of each token; attention stays within it

    def split(self, micro_batch_size: int | None) -> list["Batch"]:
        """Micro-batches of ``micro_batch_size`` sequences (all of it for None); each keeps the
        global count of targets, so their losses add up to the step's."""
        if not micro_batch_size or micro_batch_size >= self.inputs.shape[0]:
            return [self]
        parts = [
            t.split(micro_batch_size) if t is not None else None
            for t in (self.inputs, self.targets, self.positions, self.doc_ids)
        ]
        return [
            Batch(
                parts[0][i],
                parts[1][i],
                self.global_targets,
                parts[2][i] if parts[2] else None,
                parts[3][i] if parts[3] else None,
            )
            for i in range(len(parts[0]))
        ]

    def model_kwargs(self) -> dict:
        """The packing arguments of ``Transformer.forward`` (none for plain windows)."""
        return {} if self.positions is None else {"positions": self.positions, "doc_ids": self.doc_ids}


class Windows:
    """Non-overlapping ``seq_len + 1``-token windows of a token stream: every position a target.
    ``eos_id`` (``data.document_mask``): attention and positions stay inside each document."""

    def __init__(self, tokens: np.ndarray, seq_len: int, eos_id: Optional[int] = None):
        self.tokens, self.seq_len, self.eos_id = tokens, seq_len, eos_id
        self.n = data_split.windows(len(tokens), seq_len)

    def __len__(self) -> int:
        return self.n

    def targets_in(self, indices) -> int:
        return len(indices) * self.seq_len

    def batch(self, indices, global_targets: int, device) -> Batch:
        rows = np.stack([self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1] for i in indices])
        rows = torch.from_numpy(rows.astype(np.int64))
        inputs, targets = rows[:, :-1], rows[:, 1:]
        if self.eos_id is None:
            return Batch(inputs.to(device), targets.to(device), global_targets)
        positions, doc_ids = documents(inputs, self.eos_id)
        return Batch(inputs.to(device), targets.to(device), global_targets, positions.to(device), doc_ids.to(device))


def documents(inputs: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of ``inputs`` [b, s]: its position within its document and the document's index in
    the row. An end-of-text token is the last token of its document; a row starts a document."""
    ends = inputs == eos_id
    starts = torch.zeros_like(ends)
    starts[:, 1:] = ends[:, :-1]
    starts[:, 0] = True
    index = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    first = torch.cummax(torch.where(starts, index, 0), dim=1).values  # where each token's document began
    return index - first, torch.cumsum(starts, dim=1) - 1


class PackedExamples:
    """Fine-tuning examples (``offsets[j]:offsets[j+1]`` of ``tokens``, loss where ``mask``) packed
    next-fit, in order, into sequences of ``seq_len`` positions."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, offsets: np.ndarray, seq_len: int, pad_id: int = 0):
        self.tokens, self.mask, self.seq_len, self.pad_id = tokens, mask, seq_len, pad_id
        starts = np.asarray(offsets[:-1], dtype=np.int64)
        # an example of L tokens fills L - 1 positions (input t predicts token t + 1)
        positions = np.minimum(np.diff(np.asarray(offsets, dtype=np.int64)) - 1, seq_len)
        keep = positions > 0
        self.truncated = int((np.diff(offsets) - 1 > seq_len).sum())
        self.longest = int(np.diff(offsets).max()) - 1 if len(offsets) > 1 else 0  # positions it needs
        self.starts, self.lengths = starts[keep], positions[keep]
        self.bins = _next_fit(self.lengths, seq_len)  # [n_bins + 1] example boundaries
        self.n = len(self.bins) - 1
        mask_cum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
        per_example = mask_cum[self.starts + 1 + self.lengths] - mask_cum[self.starts + 1]
        cum = np.concatenate([[0], np.cumsum(per_example)])
        self._bin_targets = cum[self.bins[1:]] - cum[self.bins[:-1]]
        self.fill = float(self.lengths.sum()) / max(1, self.n * seq_len)  # share of positions not padding

    def __len__(self) -> int:
        return self.n

    def targets_in(self, indices) -> int:
        return int(self._bin_targets[np.asarray(list(indices), dtype=np.int64)].sum())

    def batch(self, indices, global_targets: int, device) -> Batch:
        rows = [self._row(int(i)) for i in indices]
        x, y, pos, doc = (torch.from_numpy(np.stack(col)).to(device) for col in zip(*rows))
        return Batch(x, y, global_targets, pos, doc)

    def _row(self, b: int):
        n = self.seq_len
        x = np.full(n, self.pad_id, np.int64)
        y = np.full(n, IGNORE_INDEX, np.int64)
        pos = np.arange(n, dtype=np.int64)
        doc = np.full(n, self.bins[b + 1] - self.bins[b], np.int64)  # padding: its own block
        at = 0
        for d, j in enumerate(range(self.bins[b], self.bins[b + 1])):
            s, length = self.starts[j], self.lengths[j]
            x[at : at + length] = self.tokens[s : s + length]
            nxt = self.tokens[s + 1 : s + 1 + length].astype(np.int64)
            y[at : at + length] = np.where(self.mask[s + 1 : s + 1 + length] > 0, nxt, IGNORE_INDEX)
            pos[at : at + length] = np.arange(length)
            doc[at : at + length] = d
            at += length
        pos[at:] = np.arange(n - at)
        return x, y, pos, doc


def _next_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Boundaries of consecutive runs of ``lengths`` whose sums fit ``capacity`` (each <= capacity)."""
    return np.asarray(data_split.next_fit(lengths.tolist(), capacity), dtype=np.int64)


Sequences = Union[Windows, PackedExamples]


def _as_sequences(data: Union[np.ndarray, Sequences], seq_len: int) -> Sequences:
    return Windows(data, seq_len) if isinstance(data, np.ndarray) else data


class EpochOrder:
    """A seeded permutation of ``[0, n)`` computed one index at a time: O(1) memory for any ``n``.

    At 1T tokens and seq 8192 an epoch holds about 1.2e8 windows; materialising an int64
    permutation of them costs about 1 GB per rank and a second of CPU at every epoch. This order
    instead encrypts the index: a balanced Feistel network of ``ROUNDS`` rounds over ``2**(2h)``
    values (``h`` bits a half, the least with ``4**h >= n``) is a bijection of that domain whatever
    its round function; cycle-walking (encrypt again while the value is ``>= n``) restricts it to a
    bijection of ``[0, n)``, about two encryptions an index on average and at most four expected.
    The round function is the splitmix64 finaliser of (half, round key); the round keys come from
    ``SeedSequence([seed, epoch])``. An affine map ``(a * i + b) mod n`` would be cheaper but keeps
    neighbours at a fixed stride (the difference between consecutive outputs is always ``a``), so
    batches would repeat the same window spacing; the Feistel order has no such structure.
    """

    ROUNDS = 6

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"an epoch order needs at least one element, not {n}")
        self.n = int(n)
        self.half_bits = max(1, (max(1, (self.n - 1).bit_length()) + 1) // 2)
        self._mask = np.uint64((1 << self.half_bits) - 1)
        keys = np.random.SeedSequence([seed, epoch]).generate_state(self.ROUNDS, np.uint64)
        self._keys = [np.uint64(k) for k in keys]

    def __getitem__(self, i: int) -> int:
        return int(self.take(np.asarray([i]))[0])

    def take(self, indices) -> np.ndarray:
        """The order's values at ``indices`` (each in ``[0, n)``), as int64."""
        x = np.asarray(indices, dtype=np.uint64).copy()
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"index {int(x.max())} is outside an epoch of {self.n}")
        todo = np.arange(x.size)
        while todo.size:  # cycle-walk: a value >= n is encrypted again until it falls in [0, n)
            x[todo] = self._encrypt(x[todo])
            todo = todo[x[todo] >= self.n]
        return x.astype(np.int64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half_bits)
        left, right = x >> shift, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << shift) | right


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit (uint64, wrapping)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Sampler:
    """Random training sequences (``Windows`` of a token array, or ``PackedExamples``), resumable exactly.

    The k-th sequence of training is ``order_e[k mod n]`` with ``e = k // n`` and ``order_e`` the
    ``EpochOrder`` seeded by (seed, e): a permutation computed per index, so no rank ever holds one.
    A global batch is ``global_batch_size`` consecutive k's, so it depends only on (seed, sequences
    consumed), never on the world size; data-parallel rank r takes the contiguous slice
    [r * local, (r + 1) * local). ``state_dict`` is that one counter.
    """

    def __init__(
        self,
        data: Union[np.ndarray, Sequences],
        seq_len: int,
        global_batch_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if global_batch_size % dp_size:
            raise ValueError(f"train.batch_size={global_batch_size} is not divisible by {dp_size} data-parallel ranks")
        self.sequences = _as_sequences(data, seq_len)
        self.n_windows = len(self.sequences)
        if self.n_windows < 1:
            raise ValueError(f"the training split holds less than one sequence of seq_len={seq_len}")
        self.seq_len, self.seed = seq_len, seed
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.consumed = 0
        self._orders: dict[int, EpochOrder] = {}

    def order(self, epoch: int) -> EpochOrder:
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = EpochOrder(self.n_windows, self.seed, epoch)
        return self._orders[epoch]

    def window_indices(self, start: int, count: int) -> np.ndarray:
        """The sequences the ``count`` training draws from draw ``start`` on take (int64)."""
        k = np.arange(start, start + count, dtype=np.int64)
        epochs, within = np.divmod(k, self.n_windows)
        out = np.empty(count, dtype=np.int64)
        for e in range(start // self.n_windows, (start + count - 1) // self.n_windows + 1):
            at = epochs == e
            out[at] = self.order(e).take(within[at])
        return out

    def next_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """(this rank's sequences, the whole global batch's) of the next step; advances one step."""
        every = self.window_indices(self.consumed, self.global_batch_size)
        self.consumed += self.global_batch_size
        return every[self.dp_rank * self.local_batch_size : (self.dp_rank + 1) * self.local_batch_size], every

    def next_batch(self, device="cpu") -> Batch:
        """This rank's slice of the next global batch; advances one step."""
        mine, every = self.next_indices()
        return self.sequences.batch(mine.tolist(), self.sequences.targets_in(every.tolist()), device)

    @property
    def epoch(self) -> float:
        return self.consumed / self.n_windows

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seq_len", self.seq_len) != self.seq_len or state.get("seed", self.seed) != self.seed:
            raise ValueError(f"sampler state {state} does not match seq_len={self.seq_len}, seed={self.seed}")
        self.consumed = int(state["consumed"])


def val_batches(
    data: Union[np.ndarray, Sequences],
    seq_len: int,
    global_batch_size: int,
    n_batches: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    device="cpu",
) -> list[Batch]:
    """The fixed validation set: the first ``n_batches * global_batch_size`` sequences, in order.

    Returns this rank's slice of each batch. Fewer batches are used if the split is short.
    """
    sequences = _as_sequences(data, seq_len)
    n = min(n_batches, len(sequences) // global_batch_size)
    if n < 1:
        raise ValueError(data_split.too_few_for_a_batch(len(sequences), seq_len, global_batch_size))
    local = global_batch_size // dp_size
    out = []
    for b in range(n):
        every = range(b * global_batch_size, (b + 1) * global_batch_size)
        mine = every[dp_rank * local : (dp_rank + 1) * local]
        out.append(sequences.batch(mine, sequences.targets_in(every), device))
    return out
