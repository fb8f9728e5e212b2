"""What CI spent its time on: each stage's wall time (.ci/out/stages.tsv, written by .ci/run's
``stage``), the ten slowest tests of every JUnit XML under .ci/out, and the ten that used the most
CPU (.ci/out/cpu, the main suite's ``--cpu-report``: on 2 cores the suite is CPU-bound, so CPU is
what a faster CI cuts). Printed at the end of a run, passed or failed, so a slower CI says where
without a second run.

``python .ci/report.py unit-times`` prints each work unit's wall time in that run (a test file, or one
documentation session: ``tests/ci_policy.work_unit``), longest first, as ``tests/unit_times.tsv``
holds them: the suite starts its longest units first (tests/conftest.py). Refresh that file from a CI
run's ``.ci/out`` when the suite's shape changes."""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def stages() -> list[tuple[str, float, str, str]]:
    """Each stage's name, wall seconds, exit status and CPU seconds (its reaped processes')."""
    path = OUT / "stages.tsv"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        name, seconds, status, cpu = (line.split("\t") + [""])[:4]
        rows.append((name, float(seconds), status, cpu))
    return rows


def _busy_and_total(stat: str) -> tuple[float, float]:
    """The machine's busy and total CPU seconds since boot, from /proc/stat's first line."""
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in stat.split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq + steal
    return busy / tick, (busy + idle + iowait) / tick


def machine_cpu() -> tuple[float, float] | None:
    """The whole machine's busy CPU seconds since .ci/run started, and the CPU seconds its cores had."""
    start = OUT / "machine-cpu-start"
    if not start.exists():
        return None
    busy0, total0 = _busy_and_total(start.read_text().splitlines()[0])
    busy1, total1 = _busy_and_total(Path("/proc/stat").read_text().splitlines()[0])
    return busy1 - busy0, total1 - total0


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


def hungriest(count: int = 10) -> tuple[float, list[tuple[float, float, str]]]:
    """The main suite's CPU seconds in all, and its ``count`` tests that used the most (CPU, wall, test)."""
    rows = []
    for tsv in sorted((OUT / "cpu").glob("*.tsv")):
        for line in tsv.read_text().splitlines():
            nodeid, wall, cpu = line.split("\t")
            rows.append((float(cpu), float(wall), nodeid))
    return sum(r[0] for r in rows), sorted(rows, reverse=True)[:count]


def unit_times() -> list[tuple[float, str]]:
    """Each work unit's wall seconds in the main suite's CPU report, longest first."""
    sys.path.insert(0, str(OUT.parents[1] / "tests"))
    from ci_policy import work_unit

    units: dict[str, float] = {}
    for tsv in sorted((OUT / "cpu").glob("*.tsv")):
        for line in tsv.read_text().splitlines():
            nodeid, wall, _cpu = line.split("\t")
            units[work_unit(nodeid)] = units.get(work_unit(nodeid), 0.0) + float(wall)
    return sorted(((seconds, unit) for unit, seconds in units.items()), reverse=True)


def main() -> int:
    if sys.argv[1:] == ["unit-times"]:
        for seconds, unit in unit_times():
            print(f"{unit}\t{seconds:.0f}")
        return 0
    print("== CI stages (wall time; CPU seconds of the processes each waited for)")
    for name, seconds, status, cpu in stages():
        cpu_text = f"{cpu:>6} CPU-s" if cpu else " " * 12
        print(f"  {seconds:8.0f} s {cpu_text}  {name}{'' if status == '0' else f'  (exit {status})'}")
    whole = machine_cpu()
    if whole:
        busy, had = whole
        print(f"  the machine: {busy:.0f} CPU-s busy of {had:.0f} ({busy / max(had, 1):.0%}), whatever ran them")
    print("== ten slowest tests")
    for seconds, name, suite in slowest():
        print(f"  {seconds:8.0f} s  {name}  [{suite}]")
    total, top = hungriest()
    if top:
        print(f"== ten most CPU-hungry tests (the main suite's tests: {total:.0f} CPU-s in all)")
        for cpu, wall, name in top:
            print(f"  {cpu:8.0f} CPU-s {wall:6.0f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
