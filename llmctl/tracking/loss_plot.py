"""A loss-curve picture per run, as a small self-contained SVG (no plotting library needed).

MLflow's UI can chart metrics, but an artifact travels: it opens in any browser, diff tool or
report, and it is there for runs whose store you no longer have a UI for.
"""

from __future__ import annotations

from html import escape
from typing import Sequence

Series = Sequence[tuple[int, float]]
WIDTH, HEIGHT, PAD = 640, 360, 48
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


def _scale(value: float, lo: float, hi: float, out_lo: float, out_hi: float) -> float:
    span = hi - lo or 1.0
    return out_lo + (value - lo) * (out_hi - out_lo) / span


def loss_curve_svg(curves: dict[str, Series], title: str) -> str:
    """Plot each named (step, value) series on shared axes; empty series are skipped."""
    curves = {name: sorted(points) for name, points in curves.items() if points}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
    ]
    if not curves:
        parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no points</text></svg>')
        return "\n".join(parts)
    steps = [s for pts in curves.values() for s, _ in pts]
    values = [v for pts in curves.values() for _, v in pts]
    x0, x1, y0, y1 = min(steps), max(steps), min(values), max(values)
    left, right, top, bottom = PAD + 10, WIDTH - PAD / 2, PAD, HEIGHT - PAD
    parts.append(f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>')
    parts.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="black"/>')
    for label, y in ((f"{y1:.3g}", top), (f"{y0:.3g}", bottom)):
        parts.append(f'<text x="{left - 6}" y="{y + 4}" text-anchor="end">{label}</text>')
    for label, x in ((str(x0), left), (str(x1), right)):
        parts.append(f'<text x="{x}" y="{bottom + 16}" text-anchor="middle">{label}</text>')
    parts.append(f'<text x="{(left + right) / 2}" y="{HEIGHT - 8}" text-anchor="middle">step</text>')
    for i, (name, pts) in enumerate(curves.items()):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{_scale(s, x0, x1, left, right):.1f},{_scale(v, y0, y1, bottom, top):.1f}" for s, v in pts)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>')
        parts.append(
            f'<text x="{right - 4}" y="{top + 14 * (i + 1)}" text-anchor="end" fill="{color}">{escape(name)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)
