"""Trial run names: the overrides that vary across the sweep (``lr=3e-4,seed=1``, the sweep table's
columns), so MLflow's run list tells trials apart instead of showing one shared ``sweep-…`` prefix."""

from __future__ import annotations

from typing import Any, Sequence

from llmctl.sweep import table

MAX_NAME_CHARS = 250  # MLflow's run-name limit


def names(trials: Sequence[dict[str, Any]], fallback_prefix: str) -> dict[int, str]:
    """Run name by trial index: ``key=value`` of each varying override (the last part of a dotted
    key), ``<prefix>-t<index>`` when nothing varies; a name two trials would share gets ``-t<index>``."""
    keys = table.varying([list(t["overrides"]) for t in trials])
    short = [k.lstrip("+~").rsplit(".", 1)[-1] for k in keys]
    by_index = {}
    for t in trials:
        vals = table.values(list(t["overrides"]), keys)
        name = ",".join(f"{k}={v}" for k, v in zip(short, vals) if v)[:MAX_NAME_CHARS]
        by_index[t["index"]] = name or f"{fallback_prefix}-t{t['index']}"
    taken = list(by_index.values())
    return {i: (n if taken.count(n) == 1 else f"{n}-t{i}") for i, n in by_index.items()}


def searched_name(searched: Sequence[str]) -> str:
    """A search trial's name from its suggested ``key=value`` overrides: ``lr=0.0003162,warmup_steps=10``."""
    parts = []
    for override in searched:
        key, _, value = override.partition("=")
        try:
            value = f"{float(value):.4g}" if "." in value or "e" in value.lower() else value
        except ValueError:
            pass
        parts.append(f"{key.lstrip('+~').rsplit('.', 1)[-1]}={value}")
    return ",".join(parts)[:MAX_NAME_CHARS]
