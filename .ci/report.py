"""What CI spent its time on: each stage's wall time (.ci/out/stages.tsv, written by .ci/run's
``stage``) and the ten slowest tests of every JUnit XML under .ci/out. Printed at the end of a run,
passed or failed, so a slower CI says where without a second run."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def stages() -> list[tuple[str, float, str]]:
    path = OUT / "stages.tsv"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        name, seconds, status = line.split("\t")
        rows.append((name, float(seconds), status))
    return rows


def slowest(count: int = 10) -> list[tuple[float, str, str]]:
    tests = []
    for xml in sorted(OUT.glob("*.xml")):
        try:
            root = ET.parse(xml).getroot()
        except ET.ParseError:  # a suite cut short leaves a partial file
            continue
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            tests.append((float(case.get("time") or 0), name, xml.stem))
    return sorted(tests, reverse=True)[:count]


def main() -> int:
    print("== CI stages (wall time)")
    for name, seconds, status in stages():
        print(f"  {seconds:8.0f} s  {name}{'' if status == '0' else f'  (exit {status})'}")
    print("== ten slowest tests")
    for seconds, name, suite in slowest():
        print(f"  {seconds:8.0f} s  {name}  [{suite}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
