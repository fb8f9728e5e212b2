"""The loss-curve SVG: valid XML, one line per series, points scaled into the frame."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from llmctl.tracking.loss_plot import HEIGHT, WIDTH, loss_curve_svg


def test_svg_has_one_polyline_per_series_inside_the_frame() -> None:
    svg = loss_curve_svg(
        {"train/loss": [(1, 8.0), (2, 7.0), (3, 6.5)], "val/loss": [(0, 8.3), (3, 6.9)], "empty": []}, "run x"
    )
    root = ET.fromstring(svg)
    lines = [el for el in root.iter() if el.tag.endswith("polyline")]
    assert len(lines) == 2
    for line in lines:
        for pair in line.attrib["points"].split():
            x, y = map(float, pair.split(","))
            assert 0 <= x <= WIDTH and 0 <= y <= HEIGHT
    # the highest loss is drawn at the top of the plot area, the lowest at the bottom
    ys = [float(p.split(",")[1]) for p in lines[1].attrib["points"].split()]
    assert ys[0] < ys[-1]


def test_svg_without_points_says_so() -> None:
    assert "no points" in loss_curve_svg({"train/loss": []}, "r")
