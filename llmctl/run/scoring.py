"""Where ``llmctl eval`` scores a checkpoint, and what it reports.

lm-eval tasks (``--tasks``) of a run on a cloud or Slurm run as a job of their own on the run's
infra, billed to the run (``--here``: on this machine); other ``--tasks`` are scored here on a Hugging
Face export (``--hf``: that export); without tasks, the trainer's own eval measures loss, perplexity
and bits/byte on the checkpoint (``--hf``: on an export, through transformers). The CLI only parses
the flags and prints; the exit code and the lines come from here.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

Say = Callable[..., None]  # typer.echo's shape: say(text, err=False)


def evaluate(
    target: str,
    overrides: list[str],
    *,
    request: Any,
    hf: Optional[str],
    here: bool,
    nproc: int,
    tracking_uri: Optional[str],
    config_dir: Optional[str],
    untrained: Callable[..., Any],
    say: Say,
) -> int:
    """Score ``target`` (a run, a model URI, a checkpoint URL) per ``request`` (a parsed ``--tasks``
    request, or None); the exit code. ConfigError (nothing logged: the resolved target is discarded)
    and LaunchError pass to the caller. ``untrained``: the sweep's test for a trial run that never
    trained (``resolve_target`` refuses it), passed in: this stage does not import the sweep's."""
    from llmctl.errors import ConfigError
    from llmctl.run import eval_and_export as ev

    t = None
    try:
        t = ev.resolve_target(target, overrides, tracking_uri, config_dir, untrained)
        if request is not None:
            return _score_tasks(t, request, hf, here, say)
        if hf:
            result = ev.run_workload(t, 1, ["--hf", str(hf)], say)
            result["step"] = ev.export_step(hf) or 0
        else:
            result = ev.run_workload(t, nproc, [], say)
        ev.log_result(t, result, ev.metric_prefix(t.cfg, bool(hf)))
    except ConfigError:
        ev.discard(t)
        raise
    say(f"llmctl: eval of {result.get('checkpoint') or hf} logged to {_where(t, result.get('step'))}")
    return 0


def _score_tasks(t: Any, request: Any, hf: Optional[str], here: bool, say: Say) -> int:
    """lm-eval tasks: as a job on the run's infra when the run lives there, else here."""
    from llmctl.run import benchmark_scores
    from llmctl.run import eval_and_export as ev

    on_nodes = not hf and not here and benchmark_scores.on_infra(t)
    benchmark_scores.check_request(request, on_nodes)
    if on_nodes:  # the job exports and scores there: this machine needs neither transformers nor lm-eval
        code = benchmark_scores.score_on_infra(t, request, say)
        if code == 0:
            say(f"llmctl: lm-eval scores of {', '.join(request.tasks)} logged to run {t.run_id}")
        return code
    ev.require_transformers()
    result, step = benchmark_scores.score(t, request, hf, say)
    say(f"llmctl: {len(result['scores'])} lm-eval scores of {', '.join(request.tasks)} logged to {_where(t, step)}")
    return 0


def _where(t: Any, step: Any) -> str:
    return f"run {t.run_id} at step {step}" if t.run_id else "nothing (no run: a bare checkpoint URL)"
