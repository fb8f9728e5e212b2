"""``llmctl eval RUN --tasks ...`` on the controller side: check the request, export, score, log.

The request is checked before anything is written (one line, exit 3): ``--limit`` below 1, a bad
``--batch-size``, an unknown task, a task that reads the Hugging Face Hub where the Hub cannot be
reached (``workloads.pretrain.contract.lm_eval_tasks.check_tasks``: the same check ``launch eval.tasks=...`` runs).
Then the checkpoint is exported to Hugging Face format in the eval's scratch directory (``--hf DIR``
skips that: an export already made), ``python -m workloads.pretrain.harness`` scores it in a
process of its own, and the result goes into the run the checkpoint belongs to:

    eval/<task>/<metric>[/<filter>]         at the checkpoint's step; ``<metric>_stderr`` beside it
    params lm_eval.version, lm_eval.task.<task>.version
    artifact eval/step-<N>/lm_eval/         results.json (scores, versions, shots, flags), samples_<task>.jsonl

torch and mlflow are imported inside functions (``llmctl --help`` stays fast).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from llmctl.errors import ConfigError, LaunchError
from workloads.pretrain.contract.lm_eval_tasks import check_tasks, harness_command, version_params


@dataclass
class TaskRequest:
    """What to score, with lm-eval's names and meanings for its flags."""

    tasks: list[str]
    include_path: Optional[str] = None
    num_fewshot: Optional[int] = None
    limit: Optional[int] = None  # examples per task
    batch_size: str = "1"  # an int, or lm-eval's "auto"
    parallelize: bool = False  # spread the model over this node's GPUs (lm-eval's hf parallelize=True)


def parse_request(
    tasks: str,
    include_path: Optional[str],
    num_fewshot: Optional[int],
    limit: Optional[int],
    batch_size: str,
    parallelize: bool = False,
) -> TaskRequest:
    """The flags checked, lm-eval's task index included: a ConfigError (one line) before any work."""
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit {limit}: examples per task, at least 1. Fix: --limit 1, or leave it out for all")
    if num_fewshot is not None and num_fewshot < 0:
        raise ConfigError(f"--num-fewshot {num_fewshot}: shots per example, 0 or more")
    if batch_size != "auto" and not (batch_size.isdigit() and int(batch_size) >= 1):
        raise ConfigError(f"--batch-size {batch_size}: a number of requests (1 or more) or auto")
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    why = check_tasks(names, include_path)
    if why:
        raise ConfigError(why)
    return TaskRequest(names, include_path, num_fewshot, limit, batch_size, parallelize)


def _export_dtype() -> str:
    """The scored export's weights: bf16 where a GPU scores it, fp32 on CPU (bf16 matmuls there
    are slow and round differently from what a GPU computes)."""
    import torch

    return "bf16" if torch.cuda.is_available() else "fp32"


def score(t: Any, request: TaskRequest, hf: Optional[str], echo: Callable[[str], None]) -> tuple[dict[str, Any], int]:
    """Export (unless ``hf``), run the harness in its own process, log into the run; (result, step)."""
    from llmctl.run import eval_and_export as ev

    if hf:
        hf_dir, step = Path(hf), ev.export_step(hf) or 0
    else:
        hf_dir, step = ev.export_hf(t, str(t.workdir / "export-hf"), echo, _export_dtype(), tag=False)
    out, samples = t.workdir / "lm_eval.json", t.workdir / "lm_eval"
    r = request
    cmd = harness_command(
        sys.executable,
        str(hf_dir),
        str(out),
        str(samples),
        r.tasks,
        r.include_path,
        r.num_fewshot,
        r.limit,
        r.batch_size,
        r.parallelize,
    )
    with open(t.workdir / "lm_eval.log", "w") as log:
        proc = subprocess.Popen(
            cmd, env=ev._env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.startswith("lm-eval | "):
                echo(line.rstrip("\n"))
        code = proc.wait()
    if code != 0 or not out.is_file():
        raise LaunchError(f"lm-eval exited with code {code} (log: {t.workdir / 'lm_eval.log'})")
    result = json.loads(out.read_text())
    if t.run_id:
        log_scores(t.uri, t.run_id, result, step, samples)
    if not hf:  # the scored export is scratch: `llmctl export` writes one to keep
        shutil.rmtree(hf_dir, ignore_errors=True)
    return result, step


def log_scores(uri: str, run_id: str, result: dict[str, Any], step: int, samples: Optional[Path]) -> None:
    """Scores at ``step``, versions as params, results and per-sample logs as artifacts."""
    from mlflow.entities import Metric, Param
    from mlflow.exceptions import MlflowException

    from llmctl.tracking.mlflow_run import client

    mc = client(uri)
    ts = int(time.time() * 1000)
    metrics = [Metric(k, float(v), ts, step) for k, v in result["scores"].items()]
    for i in range(0, len(metrics), 1000):
        mc.log_batch(run_id, metrics=metrics[i : i + 1000])
    params = version_params(result)
    logged = mc.get_run(run_id).data.params
    new = [Param(k, str(v)) for k, v in params.items() if k not in logged]
    changed = {k: v for k, v in params.items() if k in logged and logged[k] != str(v)}
    if new:
        try:
            mc.log_batch(run_id, params=new)
        except MlflowException:
            pass  # logged by a concurrent eval of the same run meanwhile: same values
    for k, v in changed.items():  # a param cannot change: a later lm-eval's versions go to tags
        mc.set_tag(run_id, f"{k}.step-{step}", str(v))
    mc.log_dict(run_id, result, f"eval/step-{step}/lm_eval/results.json")
    if samples is not None and samples.is_dir():
        mc.log_artifacts(run_id, str(samples), f"eval/step-{step}/lm_eval")
    mc.set_tag(run_id, "llmctl.eval.last_step", str(step))
