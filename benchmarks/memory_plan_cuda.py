"""The memory plan's CUDA rules against the CUDA allocator, world 1 to 8 on one GPU.

    python benchmarks/memory_plan_cuda.py [--json PATH]

``benchmarks/memory_plan.py`` holds the plan to torch's memory tracker on fake tensors, with the
CPU rules. The CUDA rules (bf16 FSDP gathers, fused RMSNorm, larger loss chunks) can only be checked
against a real CUDA allocator, and one GPU cannot host the 2-8 NCCL ranks the FSDP and TP cases
need. torch's fake process group can, with *real* tensors: FSDP and TP allocate their real
shards, all-gather and reduce-scatter buffers, and the collectives do nothing (the values are
garbage, which memory does not care about). That is ``memory_tracker.tracked_peak(..., fake=False)``,
the same code the CPU check runs, here with ``device="cuda"``.

Per case: the plan (``plan_memory(cfg, world, device="cuda")``), the tracker's peak, and the
allocator's ``max_memory_allocated`` and ``max_memory_reserved`` over the same (last) step, in GiB;
the plan's error against the allocator (the goal: within 5%) and the tracker's (what the tracker
itself misses on CUDA: cuDNN/cuBLAS workspaces, allocator rounding). Cases: every case of
``memory_tracker.CASES`` (world 1-8, FSDP, TP, FSDP+TP, HSDP, AC none/selective/full, micro-batches,
masks) plus the 1B shape the benchmarks run (batch 2 x seq 4096, bf16), the GPU tests' 125M shape and
the 8B width cut to a few blocks under FSDP 8 and TP 4. Compile off (the plan models eager), the
loss kernel ``chunked`` (the plan models ours, not Liger's).

Without CUDA it runs the same path on CPU at tiny shapes (the CPU rules; no allocator figures), so
the script is exercised wherever the tests run. ``MEMPLAN_CASES`` (comma list of case names) picks
cases on either device.

Last line: ``memory_plan_cuda_max_error: X%`` (largest |plan / max_memory_allocated - 1|), or
``memory_plan_cpu_max_error: X%`` (plan against the tracker) without CUDA.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the oracle: tests/oracles/memory_tracker.py

GIB = 2**30


def _conf_model(name: str, **overrides: Any) -> dict:
    from omegaconf import OmegaConf

    return {**OmegaConf.to_container(OmegaConf.load(ROOT / f"conf/model/{name}.yaml")), **overrides}


def _case(name: str, world: int, model: dict, train: dict, parallel: dict | None = None, data: dict | None = None):
    cfg = {"model": model, "train": train, "parallel": parallel or {}}
    if data:
        cfg["data"] = data
    return {"name": name, "world_size": world, "cfg": cfg}


def cuda_cases() -> list[dict]:
    from oracles.memory_tracker import CASES

    return [
        *CASES,
        _case("w1 1b bf16 b2 s4096", 1, _conf_model("1b"), {"batch_size": 2, "seq_len": 4096, "dtype": "bf16"}),
        _case(
            "w1 125m v4096 bf16 b16 s512",
            1,
            _conf_model("125m", vocab_size=4096),
            {"batch_size": 16, "seq_len": 512, "dtype": "bf16"},
        ),
        _case(
            "fsdp8 8b-cut4 selective bf16 b8 s4096",
            8,
            _conf_model("8b", n_layers=4),
            {"batch_size": 8, "seq_len": 4096, "dtype": "bf16"},
            {"ac": "selective"},
        ),
        _case(
            "tp4 8b-cut2 full bf16 b2 s4096",
            4,
            _conf_model("8b", n_layers=2),
            {"batch_size": 2, "seq_len": 4096, "dtype": "bf16"},
            {"ac": "full", "tp": 4},
        ),
    ]


_TINY = {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 2048, "max_seq_len": 256}


def cpu_cases() -> list[dict]:
    """Tiny shapes, a few seconds on a busy 2-core machine: world 1 and FSDP 2 through the same code."""
    return [
        _case("w1 tiny none fp32", 1, _TINY, {"batch_size": 2, "seq_len": 256}),
        _case("fsdp2 tiny selective", 2, _TINY, {"batch_size": 4, "seq_len": 256}, {"ac": "selective"}),
    ]


def _select(cases: list[dict]) -> list[dict]:
    want = [n.strip() for n in os.environ.get("MEMPLAN_CASES", "").split(",") if n.strip()]
    if not want:
        return cases
    names = [c["name"] for c in cases]
    unknown = [n for n in want if n not in names]
    if unknown:
        print(f"MEMPLAN_CASES: unknown case(s) {unknown}; known: {names}", file=sys.stderr)
        sys.exit(3)
    return [c for c in cases if c["name"] in want]


def run_case(case: dict, device: str) -> dict:
    """Plan, tracker and (on CUDA) allocator peaks of one case's last step, in bytes."""
    import torch
    from oracles.memory_tracker import tracked_peak, trainer_cfg

    from workloads.planner.memory_plan import plan_memory

    cfg = {**case["cfg"], "model": {**case["cfg"]["model"], "loss_kernel": "chunked", "compile": False}}
    world = case["world_size"]
    plan = plan_memory(trainer_cfg(cfg), world, device=device)
    row: dict[str, Any] = {"case": case["name"], "world": world, "device": device, "plan": plan.total}
    steps = 2
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()

        def before_step(i: int) -> None:  # the allocator's peak over the same step as the tracker's
            if i == steps - 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

        tracked = tracked_peak(cfg, world, device=device, steps=steps, fake=False, before_step=before_step)
        torch.cuda.synchronize()
        row.update(
            alloc=torch.cuda.max_memory_allocated() - base,
            reserved=torch.cuda.max_memory_reserved(),
            base=base,
        )
    else:
        tracked = tracked_peak(cfg, world, device=device, steps=steps, fake=False)
    row["tracker"] = tracked["total"]
    row["plan_parts"] = plan.parts()
    row["tracker_parts"] = {k: v for k, v in tracked.items() if k not in ("raw", "total")}
    row["phase"] = plan.phase
    return row


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="also write one JSON object per case to this file")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cases = _select(cuda_cases() if cuda else cpu_cases())
    if cuda:
        torch.cuda.set_device(0)
        free, total = torch.cuda.mem_get_info()
        name = torch.cuda.get_device_name(0)
        print(f"{name} | torch {torch.__version__} | free {free / GIB:.2f} of {total / GIB:.2f} GiB")
        # cuBLAS's workspace, made once per handle and kept: allocate it before the first baseline,
        # so every case counts it the same way (not at all)
        for dt in (torch.float32, torch.bfloat16):
            torch.ones(64, 64, device="cuda", dtype=dt) @ torch.ones(64, 64, device="cuda", dtype=dt)
    else:
        torch.set_num_threads(1)
        print(f"no CUDA: CPU rules, tiny shapes (plan against the tracker, real tensors) | torch {torch.__version__}")
    head = f"{'case':<42s}{'plan':>9s}{'tracker':>9s}"
    if cuda:
        head += f"{'alloc':>9s}{'reserved':>10s}{'plan/alloc-1':>14s}{'tracker/alloc-1':>17s}"
    else:
        head += f"{'plan/tracker-1':>16s}"
    print(f"GiB per device, last of 2 steps\n{head}", flush=True)
    rows, errors = [], []
    out = args.json.open("w") if args.json else None
    for case in cases:
        t0 = time.perf_counter()
        try:
            row = run_case(case, device)
        except Exception as e:  # report and go on: the other cases still count
            traceback.print_exc(limit=4)
            print(f"{case['name']:<42s} FAILED {type(e).__name__}: {e}", flush=True)
            errors.append(float("inf"))
            row = {"case": case["name"], "error": f"{type(e).__name__}: {e}"}
        else:
            ref = row["alloc"] if cuda else row["tracker"]
            row["plan_error"] = row["plan"] / ref - 1
            errors.append(abs(row["plan_error"]))
            line = f"{case['name']:<42s}{row['plan'] / GIB:9.3f}{row['tracker'] / GIB:9.3f}"
            if cuda:
                row["tracker_error"] = row["tracker"] / ref - 1
                line += (
                    f"{row['alloc'] / GIB:9.3f}{row['reserved'] / GIB:10.3f}"
                    f"{row['plan_error'] * 100:+13.1f}%{row['tracker_error'] * 100:+16.1f}%"
                )
            else:
                line += f"{row['plan_error'] * 100:+15.1f}%"
            print(f"{line}   ({time.perf_counter() - t0:.1f} s; plan's peak: {row['phase']})", flush=True)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
    if out:
        out.close()
    if cuda:
        free, total = torch.cuda.mem_get_info()
        print(f"free after: {free / GIB:.2f} of {total / GIB:.2f} GiB")
    worst = max(errors) if errors else float("nan")
    failed = sum(e == float("inf") for e in errors)
    tag = "memory_plan_cuda_max_error" if cuda else "memory_plan_cpu_max_error"
    print(f"{tag}: {'FAILED ' + str(failed) + ' case(s)' if failed else f'{worst * 100:.1f}%'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
