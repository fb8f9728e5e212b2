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
(``check_tasks``) live here too: the trainer and the controller read one definition of which
tasks exist and which read their data from the Hugging Face Hub. Imports nothing from llmctl.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

# datasets' packaged builders: a task whose ``dataset_path`` is one of these reads local files
# (``dataset_kwargs.data_files``), not the Hub
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas"}
OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
LM_EVAL_MISSING = "lm-eval is not installed: pip install 'llmctl[eval]' (lm-evaluation-harness), then run again"


def metric_name(task: str, key: str) -> Optional[tuple[str, str]]:
    """lm-eval's ``acc,none`` / ``acc_stderr,none`` / ``exact_match,strict-match`` → (``eval/<task>/<metric>``,
    its stderr's name); None for what is not a metric (``alias``, ``samples``) or is a stderr itself."""
    metric, _, filt = key.partition(",")
    if not filt or metric.endswith("_stderr"):
        return None
    suffix = "" if filt == "none" else f"/{filt}"
    return f"eval/{task}/{metric}{suffix}", f"eval/{task}/{metric}_stderr{suffix}"


def scores_of(results: dict[str, Any]) -> dict[str, float]:
    """Every numeric metric of lm-eval's ``results`` (groups too), and its stderr where lm-eval has one."""
    out: dict[str, float] = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            names = metric_name(task, key)
            if names is None or not _number(value):
                continue
            out[names[0]] = float(value)
            metric, _, filt = key.partition(",")
            err = metrics.get(f"{metric}_stderr,{filt}")
            if _number(err):
                out[names[1]] = float(err)
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # NaN: not a score


# ----------------------------------------------------------------------------- checks before any work


def _tasks_of(index: dict[str, Any], name: str, depth: int = 0) -> list[Any]:
    """The leaf task entries a task, group or tag name stands for (lm-eval's task index)."""
    entry = index.get(name)
    if entry is None or depth > 8:
        return []
    kind = getattr(getattr(entry, "kind", None), "name", "")
    if kind == "TASK" or (isinstance(entry.cfg, dict) and "dataset_path" in entry.cfg):
        return [entry]
    members: list[str] = []
    if isinstance(entry.cfg, dict):
        for sub in entry.cfg.get("task") or []:
            members.append(sub if isinstance(sub, str) else (sub.get("task") if isinstance(sub, dict) else ""))
    if kind == "TAG" or not members:
        members += [n for n, e in index.items() if name in (getattr(e, "tags", None) or ())]
    return [leaf for m in members if m for leaf in _tasks_of(index, m, depth + 1)]


def _reads_hub(cfg: dict[str, Any]) -> Optional[str]:
    """The Hub data set a task reads, or None when its data is local (a packaged builder over local
    files, a local directory, or a custom loader)."""
    if cfg.get("custom_dataset"):
        return None
    path = str(cfg.get("dataset_path") or "")
    if not path:
        return None
    if path in LOCAL_BUILDERS:
        files = (cfg.get("dataset_kwargs") or {}).get("data_files") or {}
        urls = files.values() if isinstance(files, dict) else files if isinstance(files, list) else [files]
        flat = [u for v in urls for u in (v if isinstance(v, list) else [v])]
        remote = [u for u in flat if urlparse(str(u)).scheme in ("http", "https", "hf")]
        return str(remote[0]) if remote else None
    return None if Path(path).expanduser().exists() else path


def hub_unreachable(timeout_s: float = 5.0) -> Optional[str]:
    """Why the Hugging Face Hub cannot be read from here, or None: offline mode set, or no TCP
    connection to ``HF_ENDPOINT`` (default huggingface.co) within ``timeout_s``."""
    for var in OFFLINE_ENV:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var} is set"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        return f"no connection to {host}:{port} ({type(exc).__name__})"
    return None


def check_tasks(tasks: list[str], include_path: Optional[str], flag: str = "--include-path") -> Optional[str]:
    """One line saying what is wrong with ``tasks``, or None: lm-eval missing, an unknown task (with
    lm-eval's closest names), a task reading the Hub where the Hub cannot be reached. ``flag``: how
    the caller's user names the include path (``--include-path``, ``eval.include_path=``)."""
    if not tasks:
        return "no task named: --tasks T1,T2 (lm-eval task, group or tag names)"
    flag += "" if flag.endswith("=") else " "
    if include_path and not Path(include_path).expanduser().is_dir():
        return f"{flag}{include_path}: no such directory (lm-eval task YAMLs)"
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        return LM_EVAL_MISSING
    import difflib

    manager = TaskManager(include_path=str(Path(include_path).expanduser()) if include_path else None)
    index = manager.task_index
    unknown = [t for t in tasks if t not in index]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(index), n=3)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        local = "" if include_path else f"; a task of your own: {flag}DIR with its YAML"
        return f"unknown lm-eval task '{unknown[0]}'.{hint} Fix: `lm_eval ls tasks` lists them{local}"
    hub = [(t, ds) for t in tasks for leaf in _tasks_of(index, t) if (ds := _reads_hub(leaf.cfg or {}))]
    if hub:
        why = hub_unreachable()
        if why:
            task, ds = hub[0]
            return (
                f"task '{task}' reads its data set '{ds}' from the Hugging Face Hub, which cannot be reached"
                f" from here ({why}). Fix: run where the Hub is reachable, or point a task YAML at local"
                f" files (dataset_path: json, data_files) and pass {flag}DIR"
            )
    return None


# ----------------------------------------------------------------------------- scoring


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
    from lm_eval.tasks import TaskManager

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
        task_manager=TaskManager(include_path=include_path),
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
