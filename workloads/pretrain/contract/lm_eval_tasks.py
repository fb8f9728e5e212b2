"""Which lm-eval tasks a request names and whether they can run here; lm-eval's results as llmctl's
metric names. Read by both sides: ``llmctl eval --tasks`` and ``launch eval.tasks=...`` check a
request here before anything is created, and the trainer's harness (``workloads.pretrain.harness``)
names its scores here. The standard library at import; ``check_tasks`` imports lm-eval's task index
(no torch) when called.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
# the metric (seconds, at the scored step) of each in-training scoring: the plan's estimate leaves it out
TASKS_TIME = "time/tasks_s"
LM_EVAL_MISSING = "lm-eval is not installed: pip install 'llmctl-train[eval]' (lm-evaluation-harness), then run again"


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
        import lm_eval  # noqa: F401  (the package alone: its task index is what costs)
    except ImportError:
        return LM_EVAL_MISSING
    import difflib

    from workloads.pretrain.contract.lm_eval_index import leaves, task_summary

    index = task_summary(include_path)
    unknown = [t for t in tasks if t not in index]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(index), n=3)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        local = "" if include_path else f"; a task of your own: {flag}DIR with its YAML"
        return f"unknown lm-eval task '{unknown[0]}'.{hint} Fix: `lm_eval ls tasks` lists them{local}"
    hub = [(t, leaf["hub"]) for t in tasks for leaf in leaves(index, t) if leaf["hub"]]
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


def harness_command(
    python: str,
    hf_dir: str,
    out: str,
    samples_dir: str,
    tasks: list[str],
    include_path: Optional[str] = None,
    num_fewshot: Optional[int] = None,
    limit: Optional[int] = None,
    batch_size: str = "1",
    parallelize: bool = False,
    device: Optional[str] = None,
) -> list[str]:
    """``python -m workloads.pretrain.harness ...``: one spelling of the harness's command line for
    ``llmctl eval --tasks`` and for the trainer's ``eval.tasks`` (an include path made absolute: the
    child may run elsewhere)."""
    cmd = [python, "-m", "workloads.pretrain.harness", "--hf", hf_dir, "--out", out, "--samples-dir", samples_dir]
    cmd += ["--tasks", ",".join(tasks), "--batch-size", str(batch_size)]
    if include_path:
        cmd += ["--include-path", str(Path(include_path).expanduser().resolve())]
    if num_fewshot is not None:
        cmd += ["--num-fewshot", str(num_fewshot)]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    if device:
        cmd += ["--device", device]
    return cmd + (["--parallelize"] if parallelize else [])


def version_params(result: dict[str, Any]) -> dict[str, str]:
    """What computed the scores, as run params: lm-eval's version and each task's."""
    params = {"lm_eval.version": str(result["lm_eval_version"])}
    params.update({f"lm_eval.task.{k}.version": str(v) for k, v in result["versions"].items()})
    return params


TAG_LAST_STEP = "llmctl.eval.last_step"  # the step the newest scores were logged at


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
