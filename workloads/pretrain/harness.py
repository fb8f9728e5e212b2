"""Benchmark scores: EleutherAI's lm-evaluation-harness on a Hugging Face export of a checkpoint.

``python -m workloads.pretrain.harness --hf DIR --tasks T1,T2 --out result.json [--include-path DIR]
[--num-fewshot K] [--limit N] [--batch-size B] [--samples-dir DIR]`` runs lm-eval's own ``hf`` model
(transformers + accelerate) on the export, with lm-eval's names and meanings for the flags, and
writes one JSON result: the scores under llmctl's metric names, the task versions, the shots, the
lm-eval version; ``--samples-dir`` gets lm-eval's per-sample log, one ``samples_<task>.jsonl`` each.

Why lm-eval's ``hf`` model on the export and not an ``LM`` adapter over the trainer's model: the
scores are then the ones a user gets from ``lm_eval --model hf`` on ``llmctl export`` by
construction (the comparison users make), every request type works (loglikelihood, rolling,
generate_until with lm-eval's stop handling, chat templates), and a model bigger than one device
is spread over the node's devices by lm-eval's own ``parallelize=True`` (accelerate's device map:
layers over GPUs, no copy gathered on one device), which ``--parallelize`` turns on. The export
itself reads the checkpoint one tensor at a time (``hf_export``), so no process builds the
trainer's model to write it. The trainer's forward equals transformers' on the export
(tests/trainer/test_generate_export.py), so the scores are the checkpoint's.

The checks ``llmctl eval`` and ``llmctl launch eval.tasks=...`` run before anything is created
and the metric names live in the contract (``contract/lm_eval_tasks.py``): the trainer and the
controller read one definition. Imports nothing from llmctl.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from workloads.pretrain.contract.lm_eval_tasks import scores_of


def task_manager(tasks: list[str], include_path: Optional[str]) -> Any:
    """lm-eval's ``TaskManager`` for ``tasks``: of the include path alone when it defines all of them
    (and every member of its groups), else with lm-eval's built-in tasks too. Indexing the built-ins
    parses ~14,700 task YAMLs (seconds to tens of seconds of CPU) on every scoring; the tasks run are
    the same YAMLs either way."""
    from lm_eval.tasks import TaskManager

    from workloads.pretrain.contract.lm_eval_index import complete, summarize

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(complete(summarize(local.task_index), t) for t in tasks):
            return local
    return TaskManager(include_path=include_path)


def run(
    hf_dir: str,
    tasks: list[str],
    include_path: Optional[str] = None,
    num_fewshot: Optional[int] = None,
    limit: Optional[int] = None,
    batch_size: str = "1",
    device: Optional[str] = None,
    parallelize: bool = False,
    samples_dir: Optional[str] = None,
) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` with its ``hf`` model on ``hf_dir`` (the weights' own dtype)."""
    import lm_eval
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_args: dict[str, Any] = {"pretrained": hf_dir, "dtype": "auto"}
    if parallelize:
        model_args["parallelize"] = True
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=model_args,
        tasks=tasks,
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=batch_size if batch_size == "auto" else int(batch_size),
        device=None if parallelize else device,
        task_manager=task_manager(tasks, include_path),
        log_samples=samples_dir is not None,
    )
    if out is None:  # a non-zero rank of lm-eval's data-parallel mode
        return {}
    if samples_dir is not None:
        _write_samples(out.get("samples") or {}, Path(samples_dir))
    return {
        "scores": scores_of(out.get("results") or {}),
        "results": out.get("results") or {},
        "versions": {k: str(v) for k, v in (out.get("versions") or {}).items()},
        "n_shot": {k: v for k, v in (out.get("n-shot") or {}).items()},
        "lm_eval_version": getattr(lm_eval, "__version__", "unknown"),
        "tasks": tasks,
        "limit": limit,
        "num_fewshot": num_fewshot,
    }


def _write_samples(samples: dict[str, list[dict[str, Any]]], root: Path) -> None:
    """lm-eval's per-sample log, written by lm-eval's own ``EvaluationTracker`` (the format
    ``lm_eval --log_samples`` writes), one ``samples_<task>.jsonl`` per task."""
    from lm_eval.loggers import EvaluationTracker

    root.mkdir(parents=True, exist_ok=True)
    tracker = EvaluationTracker(output_path=str(root / "results.json"))  # a .json path: files go beside it
    tracker.date_id = "llmctl"  # set by its save_results_aggregated, which llmctl does not call (it logs them)
    for task, rows in samples.items():
        tracker.save_results_samples(task_name=task, samples=rows)
        (root / f"samples_{task}_llmctl.jsonl").replace(root / f"samples_{task}.jsonl")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workloads.pretrain.harness", description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True, help="a Hugging Face export (llmctl export --format hf)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task, group or tag names")
    p.add_argument("--include-path", default=None, help="a directory of lm-eval task YAMLs")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=int, default=None, help="examples per task")
    p.add_argument("--batch-size", default="1")
    p.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    p.add_argument("--parallelize", action="store_true", help="spread the model over the node's GPUs")
    p.add_argument("--samples-dir", default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    tasks = [t for t in a.tasks.split(",") if t]
    result = run(
        a.hf, tasks, a.include_path, a.num_fewshot, a.limit, a.batch_size, a.device, a.parallelize, a.samples_dir
    )
    Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    for name, value in sorted(result.get("scores", {}).items()):
        print(f"lm-eval | {name} {value:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
