"""Plain-text tables of trials: which override keys vary, their values, costs. Shared by the sweep's
plan (before it runs) and its status (while and after it runs)."""

from __future__ import annotations

from typing import Optional


def varying(overrides: list[list[str]]) -> list[str]:
    """Override keys whose value differs between trials (the table's columns), in first-seen order."""
    keys: dict[str, set[str]] = {}
    for ovs in overrides:
        for o in ovs:
            k, _, v = o.partition("=")
            keys.setdefault(k, set()).add(v)
    return [k for k, vals in keys.items() if len(vals) > 1]


def values(overrides: list[str], keys: list[str]) -> list[str]:
    given = dict(o.partition("=")[::2] for o in overrides)
    return [given.get(k, "") for k in keys]


def shown(value: str) -> str:
    """A value as a table shows it: a searched float (``0.0031622776601683794``) to 4 significant
    digits; anything else as given (the trial's overrides keep the full value)."""
    if len(value) <= 10:
        return value
    try:
        return f"{float(value):.4g}"
    except ValueError:
        return value


def total_cost(costs: list[Optional[float]]) -> Optional[float]:
    """The sweep's total: unknown if any trial's cost is unknown."""
    if not costs or any(c is None for c in costs):
        return None
    return float(sum(c for c in costs if c is not None))


def fmt_cost(cost: Optional[float], unpriced: bool = False) -> str:
    """Dollars; ``unpriced`` where the infra has no price (Slurm, local GPUs: not $0); else n/a."""
    return "unpriced" if unpriced else "n/a" if cost is None else f"${cost:,.2f}"


def num(v: Optional[float], fmt: str = "{:.4f}") -> str:
    return "-" if v is None else fmt.format(v)


def render(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), *(fmt(r) for r in rows)])
