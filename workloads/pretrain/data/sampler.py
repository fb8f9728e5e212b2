"""Batches from a tokenized corpus: random training windows resumable exactly, a fixed validation set."""

from __future__ import annotations

import numpy as np
import torch


def _window(tokens: np.ndarray, index: int, seq_len: int) -> np.ndarray:
    start = index * seq_len
    return tokens[start : start + seq_len + 1]


def _to_xy(windows: list[np.ndarray], device) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.from_numpy(np.stack(windows).astype(np.int64))
    return batch[:, :-1].to(device), batch[:, 1:].to(device)


class Sampler:
    """Random windows of ``seq_len + 1`` tokens (targets never overlap), resumable exactly.

    The k-th sequence of training is window ``perm_e[k mod n]`` with ``e = k // n`` and ``perm_e``
    a permutation seeded by (seed, e). A global batch is ``global_batch_size`` consecutive k's, so
    it depends only on (seed, sequences consumed), never on the world size; data-parallel rank r
    takes the contiguous slice [r * local, (r + 1) * local). ``state_dict`` is that one counter.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch_size: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1):
        if global_batch_size % dp_size:
            raise ValueError(f"train.batch_size={global_batch_size} is not divisible by {dp_size} data-parallel ranks")
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"{len(tokens)} training tokens is less than one window of seq_len={seq_len}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.consumed = 0
        self._perms: dict[int, np.ndarray] = {}

    def _window_index(self, k: int) -> int:
        epoch, i = divmod(k, self.n_windows)
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        return int(self._perms[epoch][i])

    def next_batch(self, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets), each [local_batch, seq_len] int64; advances one step."""
        first = self.consumed + self.dp_rank * self.local_batch_size
        ks = range(first, first + self.local_batch_size)
        self.consumed += self.global_batch_size
        return _to_xy([_window(self.tokens, self._window_index(k), self.seq_len) for k in ks], device)

    @property
    def epoch(self) -> float:
        return self.consumed / self.n_windows

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seq_len", self.seq_len) != self.seq_len or state.get("seed", self.seed) != self.seed:
            raise ValueError(f"sampler state {state} does not match seq_len={self.seq_len}, seed={self.seed}")
        self.consumed = int(state["consumed"])


def val_batches(tokens: np.ndarray, seq_len: int, global_batch_size: int, n_batches: int,
                dp_rank: int = 0, dp_size: int = 1, device="cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation set: the first ``n_batches * global_batch_size`` windows, in order.

    Returns this rank's slice of each batch. Fewer batches are used if the split is short.
    """
    n_windows = (len(tokens) - 1) // seq_len
    n = min(n_batches, n_windows // global_batch_size)
    if n < 1:
        raise ValueError(
            f"validation split has {n_windows} windows of seq_len={seq_len}: fewer than one batch of "
            f"{global_batch_size}; raise data.val_fraction or lower train.batch_size"
        )
    local = global_batch_size // dp_size
    out = []
    for b in range(n):
        first = b * global_batch_size + dp_rank * local
        out.append(_to_xy([_window(tokens, k, seq_len) for k in range(first, first + local)], device))
    return out
