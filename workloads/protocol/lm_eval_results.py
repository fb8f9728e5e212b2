"""lm-eval's results as a run's metrics and params, and the harness's command line: one definition for
every place that scores (``llmctl eval --tasks`` here, its job on the run's infra, ``eval.tasks`` during
training), which the trainer's harness (``workloads.pretrain.harness``) writes and llmctl reads.
Standard library only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

# the metric (seconds, at the scored step) of each in-training scoring: the plan's estimate leaves it out
TASKS_TIME = "time/tasks_s"
TAG_LAST_STEP = "llmctl.eval.last_step"  # the step the newest scores were logged at


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


# ----------------------------------------------------------------------------- the harness, as a command


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
    log_to: Optional[tuple[str, int]] = None,
) -> list[str]:
    """``python -m workloads.pretrain.harness ...``: one spelling of the harness's command line for
    ``llmctl eval --tasks`` and for the trainer's ``eval.tasks`` (an include path made absolute: the
    child may run elsewhere). ``log_to``: (run id, step) for a caller that has no MLflow writer of
    its own (llmctl): the harness logs the scores into that run itself, on the tracking server its
    environment names (``MLFLOW_TRACKING_URI``: never on a command line, where a password shows)."""
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
    if log_to:
        cmd += ["--run-id", log_to[0], "--step", str(log_to[1])]
    return cmd + (["--parallelize"] if parallelize else [])


def version_params(result: dict[str, Any]) -> dict[str, str]:
    """What computed the scores, as run params: lm-eval's version and each task's."""
    params = {"lm_eval.version": str(result["lm_eval_version"])}
    params.update({f"lm_eval.task.{k}.version": str(v) for k, v in result["versions"].items()})
    return params
