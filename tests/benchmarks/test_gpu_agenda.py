"""``benchmarks/gpu_agenda.sh`` on a machine without CUDA, end to end, so the GPU hour's script cannot rot.

GPU time is rare and short (four 10-minute commands), so the script must not be found broken on
the GPU. Here each part runs for real with ``OUT`` in a temporary folder: the CUDA-only steps (the
GPU suite, both torchtitan comparisons, FP8) record themselves as skipped, and the rest runs its
CPU branch at tiny shapes (the probe, the memory plan's fake-process-group check with real tensors,
the document mask's benchmark through ``DOCUMENT_MASK_SHAPE=tiny``, LoRA and QLoRA built by the
trainer's ``init_sharded`` and stepped through ``GPU_LORA_SHAPES=tiny``). No wheel folder is given, so
the install step records that it had none; the wheels' pins are checked against the repo's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import titan_sides as ts

AGENDA = ROOT / "benchmarks" / "gpu_agenda.sh"
# Per part: every step in order, and which of them need CUDA.
PARTS = {
    "A": (["install", "probe", "gpu-suite", "memplan"], {"gpu-suite"}),
    "B": (["install", "titan-sdpa", "titan-flex"], {"titan-sdpa", "titan-flex"}),
    "C": (["install", "fp8", "document-mask"], {"fp8"}),
    "D": (["install", "lora-1b", "lora-8b"], set()),
}
# What each step that runs on CPU ends with.
CPU_LAST = {
    "install": "skipped: no wheels in",
    "probe": "gpu_probe: no CUDA",
    "memplan": "memory_plan_cpu_max_error: ",
    "document-mask": "document_mask: ",
    "lora-1b": "gpu_lora: ",
    "lora-8b": "gpu_lora: ",
}
SUMMARY_LINE = re.compile(r"^(?P<name>[\w-]+): rc=(?P<rc>\d+) (?P<secs>\d+)s \| (?P<last>.*)$")


def _agenda(part: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    wheels = tmp_path / "no-wheels"
    wheels.mkdir()
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "GPU_AGENDA_WHEELS": str(wheels),
        "GPU_AGENDA_SITE": str(tmp_path / "site"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "DOCUMENT_MASK_SHAPE": "tiny",
        "GPU_LORA_SHAPES": "tiny",
    }
    cmd = ["bash", str(AGENDA), part]
    return subprocess.run(cmd, cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("part", sorted(PARTS))
def test_each_part_runs_on_cpu_skipping_what_needs_cuda(part: str, tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the part would run for real (minutes), not skip")
    proc = _agenda(part, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    lines = (out / "summary.txt").read_text().splitlines()
    steps, cuda_only = PARTS[part]
    parsed = [SUMMARY_LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [m["name"] for m in parsed] == steps, lines  # one line per step, in order
    for m in parsed:
        assert m["rc"] == "0", (m.string, (out / "summary.txt").read_text())
        if m["name"] in cuda_only:
            assert m["last"] == "skipped: no CUDA", m.string
        else:
            assert m["last"].startswith(CPU_LAST[m["name"]]), m.string
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files  # the device tool brings back at most 8


def test_unknown_part_is_refused_with_the_usage() -> None:
    proc = subprocess.run(["bash", str(AGENDA), "E"], text=True, capture_output=True, timeout=30)
    assert proc.returncode == 3
    assert proc.stderr.strip().startswith("usage: bash benchmarks/gpu_agenda.sh A|B|C|D (got 'E')"), proc.stderr


def test_wheel_pins_are_the_repos_pins() -> None:
    """gpu_wheels.sh sends what the benchmarks and pyproject pin (torchtitan with its imports,
    torchao), never triton."""
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads pyproject.toml")
    script = (ROOT / "benchmarks" / "gpu_wheels.sh").read_text()
    pins = set(re.search(r"PINS=\(([^)]*)\)", script)[1].split())
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert ts.TORCHTITAN in pins and set(extras["fp8"]) <= pins, pins
    assert {p for p in ts.TORCHTITAN_IMPORTS if not p.startswith("triton")} <= pins, pins
    assert not any(p.startswith("triton") for p in pins), pins
    assert {p.split("==")[0] for p in pins} >= {"liger-kernel", "omegaconf"}, pins
