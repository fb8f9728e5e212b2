"""``llmctl eval RUN --tasks ...`` as a job on the run's own infra: lm-eval on one checkpoint, into the run.

``python -m workloads.pretrain.score_tasks --config CONFIG [--parallelize]`` (what a node runs for
``LLMCTL_WORKLOAD=score``, ``node_run.sh``): the run's config, with ``eval.tasks``,
``eval.include_path``, ``eval.num_fewshot``, ``eval.limit``, ``eval.batch_size`` and ``eval.step``
(None: the newest complete checkpoint) set by the controller. It checks the task names here (the
controller may have no lm-eval), exports that checkpoint, runs the
harness on it on this node's device and logs the scores, versions and per-sample logs into
``MLFLOW_RUN_ID`` at the checkpoint's step: the same code as ``eval.tasks`` during training
(``components.task_scores.score_step``), in one process. Exit 0 when the scores are logged, 1 on
any failure (the controller closes the job's attempt with it). Imports nothing from llmctl.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Optional

import torch

from workloads.pretrain.components.metrics import MetricSink
from workloads.pretrain.components.task_scores import score_step
from workloads.pretrain.data import prepare_corpus
from workloads.pretrain.evaluate import resolve_step_dir
from workloads.protocol.config import parse_args


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workloads.pretrain.score_tasks", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--parallelize", action="store_true", help="spread the model over this node's GPUs")
    try:
        args, cfg = parse_args(parser, argv, config_required=True)
        if not cfg.eval.tasks or not cfg.checkpoint.dir:
            raise ValueError("nothing to score: the config needs eval.tasks and checkpoint.dir")
        check_tasks_here(list(cfg.eval.tasks), cfg.eval.include_path)
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        _, step = resolve_step_dir(str(cfg.checkpoint.dir), cfg.eval.step)
        print(
            f"lm-eval | scoring step {step} of {cfg.checkpoint.dir} on {device}: {','.join(cfg.eval.tasks)}", flush=True
        )
        sink = MetricSink()
        if not sink.active:
            raise ValueError("MLFLOW_RUN_ID is unset: the scores would go nowhere")
        score_step(cfg, prepare_corpus(cfg.data), step, device, sink, args.parallelize, stream=True)
        return 0
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return 1


def check_tasks_here(tasks: list[str], include_path: Optional[str]) -> None:
    """The tasks checked where they are scored, before a checkpoint is exported: the controller may
    have no lm-eval to ask (``llmctl.plan.task_check``: ``on_nodes``). ValueError naming the task."""
    from workloads.planner.lm_eval_index import task_summary

    index = task_summary(include_path)
    unknown = [t for t in tasks if t not in index]
    if unknown:
        raise ValueError(f"unknown lm-eval task '{unknown[0]}' on this node: `lm_eval ls tasks` lists them")


if __name__ == "__main__":
    from workloads.protocol.process_exit import exit_process

    exit_process(main())
