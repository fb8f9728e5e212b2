"""``llmctl eval RUN --tasks ...`` on the controller side: check the request, export, score, log.

The request is checked before anything is written (one line, exit 3): ``--limit`` below 1, a bad
``--batch-size`` (``parse_request``), then, where the scoring runs (``check_request``), an unknown
task, a task that reads the Hugging Face Hub where the Hub cannot be reached
(``llmctl.plan.task_check.check_tasks``: the same check ``launch eval.tasks=...`` runs); a job on the
run's infra needs neither lm-eval nor the Hub here.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from llmctl.errors import ConfigError, LaunchError
from llmctl.plan.task_check import NO_TASK, check_tasks
from workloads.protocol.lm_eval_results import harness_command


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
    """The flags checked: a ConfigError (one line) before any work. The tasks are checked once it is
    known where they are scored (``check_request``)."""
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit {limit}: examples per task, at least 1. Fix: --limit 1, or leave it out for all")
    if num_fewshot is not None and num_fewshot < 0:
        raise ConfigError(f"--num-fewshot {num_fewshot}: shots per example, 0 or more")
    if batch_size != "auto" and not (batch_size.isdigit() and int(batch_size) >= 1):
        raise ConfigError(f"--batch-size {batch_size}: a number of requests (1 or more) or auto")
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise ConfigError(NO_TASK)
    return TaskRequest(names, include_path, num_fewshot, limit, batch_size, parallelize)


def check_request(request: TaskRequest, on_nodes: bool) -> None:
    """The tasks, checked for where they are scored (``task_check.check_tasks``): a ConfigError (one
    line) before any work. ``on_nodes``: by a job on the run's infra, which installs lm-eval and reads
    the Hub there."""
    why = check_tasks(request.tasks, request.include_path, on_nodes=on_nodes)
    if why:
        raise ConfigError(why)


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
        log_to=(t.run_id, step) if t.run_id else None,  # the harness writes the scores into the run
    )
    env = {**ev._env(1), "MLFLOW_TRACKING_URI": t.uri}
    with open(t.workdir / "lm_eval.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.startswith("lm-eval | "):
                echo(line.rstrip("\n"))
        code = proc.wait()
    if code != 0 or not out.is_file():
        raise LaunchError(f"lm-eval exited with code {code} (log: {t.workdir / 'lm_eval.log'})")
    result = json.loads(out.read_text())
    if not hf:  # the scored export is scratch: `llmctl export` writes one to keep
        shutil.rmtree(hf_dir, ignore_errors=True)
    return result, step


# ----------------------------------------------------------------------------- on the run's infra


def on_infra(t: Any) -> bool:
    """Whether ``--tasks`` scores a run on its own infra (a cloud or Slurm run's latest attempt), not here."""
    return bool(t.run_id) and str((t.cfg.get("infra") or {}).get("kind") or "local") != "local"


def job_config(t: Any, request: TaskRequest, step: Optional[int]) -> dict[str, Any]:
    """The run's config (with the eval's overrides: ``infra.accelerators=A10G:1`` to score on another
    GPU) as the score job needs it: the request in ``eval.*``, the checkpoint ``step`` pinned (None: the
    node takes the newest), one node, a cluster job (a managed run's too, torn down after), the default
    mesh (the job is one process: the training's mesh need not fit one node), and one GPU of the run's
    kind unless ``--parallelize`` spreads the model over a node's (a new cluster is not rented at the
    training's 8 GPUs to score on one; the run's cluster, while it is up, is reused as it is)."""
    cfg, r = dict(t.cfg), request
    include = str(Path(r.include_path).expanduser().resolve()) if r.include_path else None
    cfg["eval"] = {
        **cfg["eval"],
        "tasks": list(r.tasks),
        "include_path": include,
        "num_fewshot": r.num_fewshot,
        "limit": r.limit,
        "batch_size": r.batch_size,
        "step": step if step is not None else cfg["eval"].get("step"),
        "every": None,
    }
    infra = {**cfg["infra"], "nodes": 1, "managed": False}
    gpu = str(infra.get("accelerators") or "")
    if gpu and not r.parallelize:
        infra["accelerators"] = f"{gpu.partition(':')[0]}:1"
        if infra.get("nproc_per_node"):
            infra["nproc_per_node"] = 1
    if cfg["infra"].get("managed"):  # its cluster was the jobs controller's: this one goes when the job ends
        infra["down"] = True
    cfg["infra"] = infra
    cfg["parallel"] = {**cfg["parallel"], "dp_replicate": 1, "dp_shard": -1, "tp": 1}
    return cfg


def _step_checked_here(t: Any) -> Optional[int]:
    """The checkpoint to score, checked here when this machine can read it (a URL; a directory here, as a
    Slurm cluster's shared filesystem is): a missing step is refused before any job starts. A path only
    the nodes have (checkpoints kept on a cluster that is still up) is checked by the job itself: None."""
    from llmctl.run import eval_and_export as ev

    root = str((t.cfg.get("checkpoint") or {}).get("dir") or "")
    local = "://" not in root or root.startswith("file://")
    if local and not Path(root.removeprefix("file://")).expanduser().is_dir():
        return None
    return ev.check_checkpoint(t)


def _check_nodes_kept_them(t: Any, run: Any) -> None:
    """Checkpoints written to the nodes' own disks (``checkpoint.dir`` unset, no ``infra.bucket``) can be
    scored only on the cluster that wrote them, while it is up: refused when it is gone, before a cluster
    is paid for to find nothing."""
    from llmctl.backends.sky.backend import cluster_kept

    root = str((t.cfg.get("checkpoint") or {}).get("dir") or "")
    if "://" in root or Path(root).expanduser().is_absolute() or cluster_kept(run):
        return
    raise ConfigError(
        f"run {t.run_id} kept its checkpoints on its nodes' disks ({root}: no checkpoint.dir, no infra.bucket)"
        " and its cluster is gone: there is nothing to score. Next time: checkpoint.dir=<a bucket URL or a"
        " shared path>, infra.bucket=..., or infra.down=false to keep the cluster"
    )


def score_on_infra(t: Any, request: TaskRequest, say: Callable[..., None]) -> int:
    """``llmctl eval RUN --tasks`` for a run on a cloud or Slurm: lm-eval runs as a job of its own on the
    run's infra (``workloads.pretrain.score_tasks`` on one node), attached to the run and billed as one
    more of its attempts (``attached.attach``); the job logs the scores into the run. The exit code."""
    from llmctl.config.compose import Composed
    from llmctl.plan.make import make_plan
    from llmctl.run import attached
    from llmctl.tracking import runs

    run = runs.get_run(t.run_id, t.uri)
    attached.check_attachable(run, "eval")  # before the checks below read checkpoints or SkyPilot
    _check_nodes_kept_them(t, run)
    step = _step_checked_here(t)
    plan = make_plan(Composed(job_config(t, request, step)))
    plan.job, plan.parallelize = "score", request.parallelize
    return attached.attach(plan, t.uri, run, kind="eval", say=say)
