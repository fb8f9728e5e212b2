"""``eval.tasks`` during training: lm-eval scores of the run's checkpoints, at their steps.

At a checkpoint step that ``eval.every`` divides (every checkpoint when unset) and at the last
step, rank 0 waits for that checkpoint to be committed, exports it to Hugging Face format in a
scratch directory (tensor by tensor from DCP: no rank gathers the model) and runs
``python -m workloads.pretrain.harness`` on it in a child process, on its own device; the scores go
into the run as ``eval/<task>/<metric>`` at the step, the per-sample logs and results as artifacts
``eval/step-N/lm_eval/``. The other ranks wait at a barrier meanwhile (training pauses: the
benchmark curve is the checkpoints', not a moving model's), on a gloo group of its own whose timeout
is ``SCORING_TIMEOUT``: a benchmark on a large model outlasts the training collectives' 10 minutes,
which would otherwise end a healthy job. Before the child starts, rank 0 returns its allocator's
cached blocks to the device (``release_cached``): the step's activations and gradients are freed
but stay cached, where another process cannot use them; what the trainer keeps (parameter shards,
AdamW states) and the model the child loads are what ``llmctl plan`` counts for this moment
(``memory_plan.scoring_memory``), refusing a launch where they do not fit together. The child's
device memory is freed when it exits, and a failed scoring is reported and does not stop training.

Why a child process and not lm-eval in the trainer: its model (transformers) and its imports
(datasets, evaluate) then never share the training process's memory or state, and what it runs is
exactly ``llmctl eval RUN --tasks``'s path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from workloads.pretrain.harness import log_scores
from workloads.protocol.checkpoint_layout import step_dir
from workloads.protocol.lm_eval_results import TASKS_TIME, harness_command

SCORING_TIMEOUT = timedelta(hours=6)  # how long the other ranks wait for rank 0's scoring


class TaskScorer:
    """Scores ``cfg.eval.tasks`` on checkpoints as training commits them (see the module doc)."""

    def __init__(self, cfg: Any, env: Any, sink: Any, corpus: Any) -> None:
        self.cfg, self.env, self.sink, self.corpus = cfg, env, sink, corpus
        ev = cfg.eval
        self.tasks = list(ev.tasks or [])
        every = ev.every if ev.every is not None else int(cfg.checkpoint.every)
        self.every = int(every or 0)
        self._pg = None
        if self.active and dist.is_initialized() and dist.get_world_size() > 1:  # every rank builds one
            self._pg = dist.new_group(backend="gloo", timeout=SCORING_TIMEOUT)

    @property
    def active(self) -> bool:
        return bool(self.tasks) and bool(self.cfg.checkpoint.dir)

    def due(self, step: int, last: bool) -> bool:
        return self.active and (last or (self.every > 0 and step % self.every == 0))

    def score(self, step: int, checkpointer: Any) -> None:
        """Every rank calls this at a due step, after ``checkpointer.maybe_save``."""
        checkpointer.wait()  # the scored checkpoint is the committed one
        if self.env.rank == 0:
            try:
                self._score_on_this_rank(step)
            except Exception as exc:  # benchmark scores are reported, never a reason to stop training
                print(f"lm-eval | step {step} not scored: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if self._pg is not None:
            dist.barrier(group=self._pg)

    def _score_on_this_rank(self, step: int) -> None:
        release_cached(self.env.device)
        score_step(self.cfg, self.corpus, step, self.env.device, self.sink)


def release_cached(device: Any) -> None:
    """Give the caching allocator's unused blocks on ``device`` back to the driver, so the harness (a
    second process on the same GPU) can have them; nothing to do on CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def score_step(
    cfg: Any, corpus: Any, step: int, device: Any, sink: Any, parallelize: bool = False, stream: bool = False
) -> dict[str, Any]:
    """Export checkpoint ``step`` of ``cfg.checkpoint.dir`` to a scratch directory, score ``cfg.eval``'s
    tasks on it with the harness in a child process on ``device`` (``parallelize``: over the node's GPUs;
    ``stream``: its output goes to this process's, else it is kept out of training's log), log the
    result into the sink's run; the result. Raises when the export or the harness fails. Also
    what ``llmctl eval RUN --tasks`` runs as a job on the run's infra (``workloads.pretrain.score_tasks``)."""
    from workloads.pretrain.evaluate import export_checkpoint

    ev, t0 = cfg.eval, time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix=f"llmctl-tasks-step{step}-"))
    try:
        hf_dir = scratch / "export-hf"
        dtype = "bf16" if device.type == "cuda" else "fp32"
        export_checkpoint(cfg, step_dir(str(cfg.checkpoint.dir), step), corpus, str(hf_dir), dtype)
        out, samples = scratch / "result.json", scratch / "lm_eval"
        cmd = harness_command(
            sys.executable,
            str(hf_dir),
            str(out),
            str(samples),
            list(ev.tasks),
            ev.include_path,
            ev.num_fewshot,
            ev.limit,
            str(ev.batch_size),
            parallelize=parallelize,
            device=None if parallelize else str(device),
        )
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
        done = subprocess.run(cmd, env=env, capture_output=not stream, text=True)
        if done.returncode != 0 or not out.is_file():
            tail = (done.stderr or done.stdout or "").strip().splitlines()[-1:] or ["its output is above"]
            raise RuntimeError(f"the harness exited {done.returncode}: {tail[0]}")
        result = json.loads(out.read_text())
        # its wall time too: the plan's estimate leaves scoring out, and the closing line says so
        sink.log({**result["scores"], TASKS_TIME: time.perf_counter() - t0}, step)
        sink.flush()
        client = sink.client()
        if client is not None:
            log_scores(client, sink.run_id, result, step, samples, metrics=False)
        shown = " | ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in sorted(result["scores"].items()))
        print(f"lm-eval | step {step} in {time.perf_counter() - t0:.1f}s | {shown}", flush=True)
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def scorer(cfg: Any, env: Any, sink: Any, corpus: Any) -> Optional[TaskScorer]:
    """A scorer when ``eval.tasks`` names any; the device is free of the scorer otherwise."""
    s = TaskScorer(cfg, env, sink, corpus)
    if s.tasks and not s.active and env.is_main:  # llmctl's backends always set one; a bare trainer may not
        print("lm-eval | eval.tasks not scored: they score checkpoints, and checkpoint.dir is unset", flush=True)
    return s if s.active else None
