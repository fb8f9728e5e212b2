"""How a tokenized corpus splits into training and validation, as numbers: one definition for the
trainer (``data.cache``, ``data.sampler``) and llmctl's data preflight, which refuses a split too
short for one validation batch before a run exists. Stdlib only.

Text: validation is the last ``int(tokens x data.val_fraction)`` tokens, cut into non-overlapping
windows of ``seq_len + 1`` tokens that share their edge token. Fine-tuning: validation is the last
``int(examples x data.val_fraction)`` examples, packed next-fit into sequences of ``seq_len``
positions (an example of L tokens fills L - 1 of them, at most ``seq_len``).
"""

from __future__ import annotations

from typing import Sequence


def val_count(total: int, val_fraction: float) -> int:
    """Tokens (text) or examples (fine-tuning) held out for validation: the tail of the corpus."""
    return int(total * val_fraction)


def windows(tokens: int, seq_len: int) -> int:
    """Training sequences in a stream of ``tokens`` tokens: each input of ``seq_len`` has its next
    token as target, so the last window needs one token more."""
    return max(0, (tokens - 1) // seq_len)


def next_fit(lengths: Sequence[int], capacity: int) -> list[int]:
    """Boundaries of consecutive runs of ``lengths`` whose sums fit ``capacity`` (each <= capacity):
    ``len(result) - 1`` packed sequences."""
    bounds, used = [0], 0
    for j, n in enumerate(lengths):
        if used + n > capacity:
            bounds.append(j)
            used = 0
        used += n
    if len(lengths):
        bounds.append(len(lengths))
    return bounds


def packed_positions(example_tokens: Sequence[int], seq_len: int) -> list[int]:
    """Positions each example fills in a packed sequence (L tokens: L - 1, at most ``seq_len``);
    an example of one token fills none and is dropped."""
    return [p for p in (min(n - 1, seq_len) for n in example_tokens) if p > 0]


def too_few_for_a_batch(sequences: int, seq_len: int, batch_size: int) -> str:
    """The message for a validation split shorter than one batch (empty when it is long enough)."""
    if sequences >= batch_size:
        return ""
    return (
        f"validation split has {sequences} sequences of seq_len={seq_len}: fewer than one batch of"
        f" {batch_size}. Fix: raise data.val_fraction, or lower train.batch_size (or train.seq_len), or add data"
    )
