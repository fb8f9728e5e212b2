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
and the metric names live in the protocol (``workloads/protocol/lm_eval_results.py``): the trainer and
the controller read one definition. ``--run-id RUN --step N`` logs the result into that MLflow run
(``log_scores``, the one writer every place that scores uses: llmctl asks the harness, the trainer
calls it). Imports nothing from llmctl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

from workloads.protocol.lm_eval_results import TAG_LAST_STEP, scores_of, version_params


def task_manager(tasks: list[str], include_path: Optional[str]) -> Any:
    """lm-eval's ``TaskManager`` for ``tasks``: of the include path alone when it defines all of them
    (and every member of its groups), else with lm-eval's built-in tasks too. Indexing the built-ins
    parses ~14,700 task YAMLs (seconds to tens of seconds of CPU) on every scoring; the tasks run are
    the same YAMLs either way."""
    from lm_eval.tasks import TaskManager

    from workloads.planner.lm_eval_index import complete, summarize

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


def log_scores(
    client: Any, run_id: str, result: dict[str, Any], step: int, samples: Optional[Path], metrics: bool = True
) -> None:
    """The harness's result into the run (an MLflow client's calls; mlflow is the caller's): the scores
    at ``step`` (``metrics=False``: the caller's metric sink logs them), the versions as params, the
    results and per-sample logs as artifacts ``eval/step-N/lm_eval/``. One writer of these for every
    place that scores: ``llmctl eval --tasks`` here, its job on the run's infra, ``eval.tasks`` in training.

    A param cannot change: when a later lm-eval (or task) version scores the run, its version goes to
    a ``<param>.step-N`` tag instead; a param logged meanwhile by a concurrent scoring of the same
    value is not an error."""
    from mlflow.entities import Metric, Param

    if metrics:
        ts = int(time.time() * 1000)
        points = [Metric(k, float(v), ts, step) for k, v in result["scores"].items()]
        for i in range(0, len(points), 1000):
            client.log_batch(run_id, metrics=points[i : i + 1000])
    params = version_params(result)
    logged = client.get_run(run_id).data.params
    new = [Param(k, str(v)) for k, v in params.items() if k not in logged]
    if new:
        try:
            client.log_batch(run_id, params=new)
        except Exception:  # logged by a concurrent scoring of the same run meanwhile
            logged = client.get_run(run_id).data.params
    for k, v in params.items():
        if k in logged and logged[k] != str(v):
            client.set_tag(run_id, f"{k}.step-{step}", str(v))
    client.log_dict(run_id, result, f"eval/step-{step}/lm_eval/results.json")
    if samples is not None and samples.is_dir():
        client.log_artifacts(run_id, str(samples), f"eval/step-{step}/lm_eval")
    client.set_tag(run_id, TAG_LAST_STEP, str(step))


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
    p.add_argument("--run-id", default=None, help="log the result into this MLflow run (with --step)")
    p.add_argument("--step", type=int, default=None, help="the scored checkpoint's step")
    a = p.parse_args(argv)
    if a.run_id is not None and a.step is None:
        p.error("--run-id needs --step")
    tasks = [t for t in a.tasks.split(",") if t]
    result = run(
        a.hf, tasks, a.include_path, a.num_fewshot, a.limit, a.batch_size, a.device, a.parallelize, a.samples_dir
    )
    Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    if a.run_id is not None:
        from mlflow.tracking import MlflowClient

        samples = Path(a.samples_dir) if a.samples_dir else None
        log_scores(MlflowClient(), a.run_id, result, a.step, samples)  # MLFLOW_TRACKING_URI's server
    for name, value in sorted(result.get("scores", {}).items()):
        print(f"lm-eval | {name} {value:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
