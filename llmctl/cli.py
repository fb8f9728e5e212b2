"""The ``llmctl`` command line. Data flows one way: compose → plan → lifecycle → backend → tracking.

Only stdlib and typer at module level: hydra, mlflow and torch load inside the commands that
need them, so ``llmctl --help`` stays instant. Exit codes: 0 ok, 2 usage, 3 bad config (or over
--max-cost), and for a run its outcome's code (``outcomes.RULES``: 0 finished, 1 failed, 4 stopped by
the budget guard, 75 stopped with state saved: preempted, or stopped by ``llmctl down`` (said as
information: the run did not finish, and resumes), 130 interrupted, 143 killed).
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

# Plain click help: Rich's renderer is a slow import for every `--help` (benchmarks/plan_latency.py).
# TYPER_USE_RICH=1 brings Rich back.
os.environ.setdefault("TYPER_USE_RICH", "0")
import typer

from llmctl.errors import ConfigError, LaunchError

EXIT_FAILED = 1
EXIT_CONFIG = 3
EXIT_INTERRUPTED = 130
OVERRIDES_HELP = "Hydra overrides: key=value (train.steps=50), group=option (model=tiny)."
EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}

app = typer.Typer(
    name="llmctl",
    help="Launch, track and cost LLM training runs: here, on clouds, or on Slurm.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect the config tree.", no_args_is_help=True)
app.add_typer(config_app, name="config")
data_app = typer.Typer(help="Prepare training data.", no_args_is_help=True)
app.add_typer(data_app, name="data")


def complete_override(incomplete: str) -> list[str]:
    """Complete group options and schema keys without importing Hydra."""
    from llmctl.config.compose import GROUPS, group_options
    from llmctl.config.root_schema import schema_keys

    if "=" in incomplete:
        key, _, partial = incomplete.partition("=")
        if key in GROUPS:
            return [f"{key}={opt}" for opt in group_options(key) if opt.startswith(partial)]
        return []
    candidates = [f"{g}=" for g in GROUPS] + [f"{k}=" for k in schema_keys() if "." in k]
    return [c for c in candidates if c.startswith(incomplete)]


OverridesArg = typer.Argument(None, help=OVERRIDES_HELP, autocompletion=complete_override, show_default=False)
ConfigDirOpt = typer.Option(None, "--config-dir", help="Extra config directory searched before the bundled conf/.")


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        from llmctl.distribution.identity import describe

        typer.echo(describe())  # the build too: what the nodes compare with the controller's
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
) -> None:
    """Launch, track and cost LLM training runs: here, on clouds, or on Slurm."""


def _compose_and_plan(overrides: Optional[List[str]], config_dir: Optional[str]) -> Any:
    from llmctl.config.compose import compose
    from llmctl.plan.make import make_plan

    try:
        return make_plan(compose(overrides or [], config_dir))
    except ConfigError as exc:
        raise _fail(str(exc), EXIT_CONFIG) from None


MultirunOpt = typer.Option(
    False, "--multirun", "-m", help="Sweep: expand a,b / range() / glob() into trials (see docs/sweeps.md)."
)
MaxParallelOpt = typer.Option(None, "--max-parallel", help="Sweep: trials at once (default: local GPUs, else cores/2).")
SearchOpt = typer.Option(
    "grid",
    "--search",
    help=(
        "Sweep: grid (every combination, as Hydra's basic sweeper) or random/tpe (Optuna's samplers; interval(), "
        "tag(log, ...))."
    ),
)
TrialsOpt = typer.Option(None, "--trials", help="Sweep with --search random|tpe: how many trials.")
PruneOpt = typer.Option(
    "none",
    "--prune",
    help="Sweep with --search random|tpe: stop bad trials early at their val steps: none, median or asha.",
)
IgnoreMemoryPlanOpt = typer.Option(
    False,
    "--ignore-memory-plan",
    help=(
        "Launch even where the memory plan says the job will not fit its devices (its CUDA rules are not yet"
        " measured on a GPU: docs/scale.md). For this launch only; not stored with the run. Sweeps are not held"
        " against the memory plan."
    ),
)
SeedOpt = typer.Option(
    None, "--seed", help="Sweep with --search random|tpe: the sampler's seed (default: a random one, recorded)."
)


@app.command()
def plan(
    overrides: Optional[List[str]] = OverridesArg,
    config_dir: Optional[str] = ConfigDirOpt,
    multirun: bool = MultirunOpt,
    max_parallel: Optional[int] = MaxParallelOpt,
    search: str = SearchOpt,
    trials: Optional[int] = TrialsOpt,
    prune: str = PruneOpt,
    seed: Optional[int] = SeedOpt,
    max_cost: Optional[float] = typer.Option(
        None, "--max-cost", help="Show whether the estimate (USD) is within this."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help=(
            "Also build the real model on meta at the target world size (fake process group) and report each rank's "
            "parameters: seconds, no GPU."
        ),
    ),
) -> None:
    """Show the config, how it runs, memory and cost; changes nothing."""
    if multirun:
        from llmctl.sweep import trial_plans as planning

        try:
            typer.echo(
                planning.plan_text(
                    overrides or [], config_dir, max_parallel, search=search, n_trials=trials, prune=prune, seed=seed
                )
            )
        except ConfigError as exc:
            raise _fail(str(exc), EXIT_CONFIG) from None
        return
    the_plan = _compose_and_plan(overrides, config_dir)
    if max_cost is not None and the_plan.estimate is not None:
        the_plan.estimate.max_cost = max_cost
    typer.echo(the_plan.describe())
    if dry_run:
        from llmctl.plan import memory_fit as memory

        try:
            typer.echo("\n" + memory.dry_run(the_plan))
        except LaunchError as exc:
            raise _fail(str(exc), EXIT_FAILED) from None


@app.command()
def launch(
    overrides: Optional[List[str]] = OverridesArg,
    config_dir: Optional[str] = ConfigDirOpt,
    multirun: bool = MultirunOpt,
    max_parallel: Optional[int] = MaxParallelOpt,
    search: str = SearchOpt,
    trials: Optional[int] = TrialsOpt,
    prune: str = PruneOpt,
    seed: Optional[int] = SeedOpt,
    wait: bool = typer.Option(False, "--wait", help="Sweep: block with a live table until every trial ends."),
    max_cost: Optional[float] = typer.Option(
        None,
        "--max-cost",
        help=(
            "Refuse if the estimated total (USD) is above this, or if the infra is unpriced; a running job stops after "
            "a checkpoint before passing it. With -m: the sweep's total, each trial stopping at its share."
        ),
    ),
    metric: str = typer.Option("val/loss", "--metric", help="Sweep: metric that picks the best trial."),
    mode: str = typer.Option("min", "--mode", help="Sweep: min or max of --metric."),
    ignore_memory_plan: bool = IgnoreMemoryPlanOpt,
) -> None:
    """Train where the config says (default: here), tracked in MLflow. With -m, a sweep."""
    if multirun:
        from llmctl.sweep import control

        try:
            code = control.launch_cli(
                overrides or [],
                config_dir,
                max_parallel,
                wait,
                max_cost,
                metric,
                mode,
                typer.echo,
                search=search,
                n_trials=trials,
                prune=prune,
                seed=seed,
            )
        except ConfigError as exc:
            raise _fail(str(exc), EXIT_CONFIG) from None
        raise typer.Exit(code)
    if search != "grid" or trials is not None or prune != "none" or seed is not None:
        raise _fail("--search, --trials, --prune and --seed are for sweeps. Fix: add -m", EXIT_CONFIG)
    the_plan = _compose_and_plan(overrides, config_dir)
    from llmctl.run import lifecycle

    try:
        code = lifecycle.launch(the_plan, max_cost=max_cost, say=typer.echo, ignore_memory_plan=ignore_memory_plan)
    except ConfigError as exc:  # preflight or --max-cost: refused before anything exists
        raise _fail(str(exc), EXIT_CONFIG) from None
    except KeyboardInterrupt:
        raise _fail("interrupted", EXIT_INTERRUPTED) from None
    raise typer.Exit(code)


@app.command()
def resume(
    run_id: str = typer.Argument(
        ...,
        help=(
            "MLflow run id (or a unique prefix) of a stopped (preempted, failed, killed) run, or a sweep id whose "
            "supervisor died."
        ),
    ),
    overrides: Optional[List[str]] = OverridesArg,
    config_dir: Optional[str] = ConfigDirOpt,
    tracking_uri: Optional[str] = typer.Option(
        None, "--tracking-uri", help="MLflow store of the run (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)."
    ),
    max_cost: Optional[float] = typer.Option(
        None,
        "--max-cost",
        help=(
            "Budget (USD) for the whole run, earlier attempts included (default: the run's own); refuses if what is "
            "left would pass it."
        ),
    ),
    ignore_memory_plan: bool = IgnoreMemoryPlanOpt,
) -> None:
    """Continue a run from its last checkpoint, in the same MLflow run.

    See docs/resume.md.

    Overrides change where and how it runs: infra=aws, parallel.dp_shard=1, train.steps=400.
    A sweep id restarts the sweep's supervisor (docs/sweeps.md).
    """
    if run_id.startswith("sweep-"):
        from llmctl.sweep import control

        if overrides or max_cost is not None:
            raise _fail("resuming a sweep takes no overrides or --max-cost (its trials keep their own)", EXIT_CONFIG)
        try:
            typer.echo(f"llmctl: {control.resume(run_id)}")
        except ConfigError as exc:
            raise _fail(str(exc), EXIT_CONFIG) from None
        return
    from llmctl.run import resume as resume_mod

    try:
        code = resume_mod.resume(
            run_id, overrides or [], config_dir, tracking_uri, max_cost, typer.echo, ignore_memory_plan
        )
    except ConfigError as exc:
        raise _fail(str(exc), EXIT_CONFIG) from None
    except KeyboardInterrupt:
        raise _fail("interrupted", EXIT_INTERRUPTED) from None
    raise typer.Exit(code)


TrackingUriOpt = typer.Option(
    None, "--tracking-uri", help="MLflow store of the run (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)."
)


def _run_and_backend(run_id: str, tracking_uri: Optional[str]) -> Any:
    from llmctl.backends import backend_of
    from llmctl.tracking import runs

    uri = runs.tracking_uri(tracking_uri)
    try:
        run = runs.get_run(run_id, uri)
        return uri, run, backend_of(run)
    except ConfigError as exc:
        raise _fail(str(exc), EXIT_CONFIG) from None


@app.command()
def status(
    run_id: Optional[str] = typer.Argument(
        None, help="MLflow run id (or a unique prefix) or sweep id; omit to list recent runs."
    ),
    tracking_uri: Optional[str] = TrackingUriOpt,
) -> None:
    """Show a run's status: MLflow state, processes, cluster or job.

    Without RUN_ID, lists recent runs.
    """
    from llmctl.tracking import runs
    from llmctl.tracking.mlflow_run import missing_store

    if run_id is None:
        uri = runs.tracking_uri(tracking_uri)
        typer.echo(missing_store(uri) or runs.table(runs.recent(uri)))  # nothing to list: exit 0, as an empty table
        return
    if run_id.startswith("sweep-"):  # a sweep id: every trial's state, metrics and cost
        from llmctl.sweep import state

        try:
            typer.echo(state.status_text(run_id, tracking_uri))
        except ConfigError as exc:
            raise _fail(str(exc), EXIT_CONFIG) from None
        return
    uri, run, backend = _run_and_backend(run_id, tracking_uri)
    run_id = run.info.run_id  # the full id, when a prefix was given
    job = backend.status(run, uri)
    lines = job.lines
    if run.info.status == "RUNNING" and job.ended:  # the job ended while nobody was watching
        from llmctl.run import attached, closing, outcomes

        outcome = outcomes.Outcome.FINISHED if job.ok else outcomes.Outcome.FAILED
        closed = closing.close_ended(uri, run, outcome, f"job {job.ended}", job.ended_at)
        if closed is None:
            lines.append("mlflow:      its controller is closing the run")
        else:
            lines.append(f"mlflow:      run closed as {outcomes.RULES[closed].mlflow_status}")
    elif run.info.status != "RUNNING":  # an eval job's attempt whose controller was killed
        from llmctl.run import attached, closing, outcomes

        closed_line = attached.close_orphaned(uri, run)
        if closed_line:
            lines.append(closed_line)
    from llmctl.cost import hooks as cost

    lines += cost.status_lines(uri, runs.get_run(run_id, uri))  # estimate vs ledger; refreshes cost/*
    typer.echo(runs.describe(runs.get_run(run_id, uri), lines))


@app.command()
def logs(
    run_id: str = typer.Argument(..., help="MLflow run id (or a unique prefix)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep streaming until the run ends."),
    tracking_uri: Optional[str] = TrackingUriOpt,
) -> None:
    """Print a run's output (local log, cluster or managed job)."""
    uri, run, backend = _run_and_backend(run_id, tracking_uri)
    try:
        raise typer.Exit(backend.logs(run, uri, follow))
    except LaunchError as exc:
        raise _fail(str(exc), EXIT_FAILED) from None


@app.command()
def down(
    run_id: str = typer.Argument(..., help="MLflow run id (or a unique prefix) or sweep id."),
    tracking_uri: Optional[str] = TrackingUriOpt,
) -> None:
    """Stop a run and release its processes, cluster or managed job. A sweep id cancels every trial."""
    if run_id.startswith("sweep-"):
        from llmctl.sweep import control

        try:
            typer.echo(f"llmctl: {control.down(run_id, tracking_uri)}")
        except ConfigError as exc:
            raise _fail(str(exc), EXIT_CONFIG) from None
        return
    uri, run, backend = _run_and_backend(run_id, tracking_uri)
    run_id = run.info.run_id  # the full id, when a prefix was given
    from llmctl.backends.base import ENDED
    from llmctl.run import closing, outcomes
    from llmctl.tracking import runs
    from llmctl.tracking.mlflow_run import client

    if run.info.status not in ENDED:  # its controller then reports a stop the user asked for, not an error
        outcomes.request_stop(client(uri), run_id, "llmctl down")
    try:
        what = backend.down(run, uri)  # an ended run: no process is signalled (a kept cluster is released)
    except ConfigError as exc:
        raise _fail(str(exc), EXIT_CONFIG) from None
    if run.info.status in ENDED:  # its pid may be another process's by now; its status stays as it ended
        detail = run.data.tags.get("llmctl.status")
        typer.echo(
            f"llmctl: run {run_id} has already ended: {run.info.status}{f' ({detail})' if detail else ''}; {what}"
        )
        return
    # a live controller closes the run itself (one closer per run); if none is left, nobody else will
    if closing.close_ended(uri, runs.get_run(run_id, uri), outcomes.Outcome.KILLED, "llmctl down") is None:
        what += "; its controller closes the run"
    typer.echo(f"llmctl: {what}")


SinceOpt = typer.Option(None, "--since", help="Only runs started since: 30m, 12h, 7d, 2w or a date (2026-11-01).")
JsonOpt = typer.Option(False, "--json", help="Print JSON instead of a table.")


@app.command("runs")
def runs_cmd(
    since: Optional[str] = SinceOpt,
    experiment: Optional[str] = typer.Option(None, "--experiment", "-e", help="Only this MLflow experiment."),
    limit: int = typer.Option(50, "--limit", help="At most this many runs, newest first."),
    as_json: bool = JsonOpt,
    tracking_uri: Optional[str] = TrackingUriOpt,
) -> None:
    """List runs: status, loss, tokens/s, MFU, estimated vs actual cost."""
    import json

    from llmctl.cost import report
    from llmctl.tracking.mlflow_run import resolve_uri

    uri = resolve_uri(tracking_uri)
    _no_store_yet(uri, as_json)
    try:
        rows = report.runs_rows(uri, since, experiment, limit)
    except ConfigError as exc:
        raise _fail(str(exc), EXIT_CONFIG) from None
    typer.echo(json.dumps(rows, indent=2) if as_json else report.runs_table(rows))


def _no_store_yet(uri: str, as_json: bool) -> None:
    """``runs``/``cost`` where no store exists yet: one line saying so (exit 0, as for no runs; with
    --json an empty list, the line on stderr), and no store created."""
    from llmctl.tracking.mlflow_run import missing_store

    missing = missing_store(uri)
    if missing is None:
        return
    if as_json:
        typer.echo("[]")
    typer.echo(missing, err=as_json)
    raise typer.Exit(0)


@app.command("cost")
def cost_cmd(
    since: Optional[str] = SinceOpt,
    by: str = typer.Option("experiment", "--by", help="Group by experiment, infra or accelerator."),
    as_json: bool = JsonOpt,
    tracking_uri: Optional[str] = TrackingUriOpt,
) -> None:
    """Spend over a period by experiment, infra or accelerator."""
    import json

    from llmctl.cost import report
    from llmctl.tracking.mlflow_run import resolve_uri

    uri = resolve_uri(tracking_uri)
    if by not in report.GROUPS:
        raise _fail(f"--by '{by}': one of {', '.join(report.GROUPS)}", EXIT_CONFIG)
    _no_store_yet(uri, as_json)
    try:
        rows = report.cost_rows(uri, since, by)
    except ConfigError as exc:
        raise _fail(str(exc), EXIT_CONFIG) from None
    typer.echo(json.dumps(rows, indent=2) if as_json else report.cost_table(rows, by, since))


@app.command("eval")
def eval_cmd(
    target: str = typer.Argument(
        ...,
        help=(
            "MLflow run id (or a unique prefix), a checkpoint's model URI (models:/m-...), or a checkpoint URL (root "
            "or step-N directory)."
        ),
    ),
    overrides: Optional[List[str]] = OverridesArg,
    nproc: int = typer.Option(1, "--nproc", help="Eval processes (torchrun); any number loads any checkpoint."),
    hf: Optional[str] = typer.Option(
        None, "--hf", help="Score this Hugging Face export (transformers + accelerate) instead."
    ),
    tasks: Optional[str] = typer.Option(
        None, "--tasks", help="lm-evaluation-harness tasks, groups or tags (comma-separated), scored on an HF export."
    ),
    include_path: Optional[str] = typer.Option(
        None, "--include-path", help="lm-eval: a directory of your own task YAMLs (local data works offline)."
    ),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", help="lm-eval: examples in each prompt."),
    limit: Optional[int] = typer.Option(None, "--limit", help="lm-eval: score the first N examples of each task."),
    batch_size: str = typer.Option("1", "--batch-size", help="lm-eval: requests per forward (a number, or auto)."),
    parallelize: bool = typer.Option(
        False, "--parallelize", help="lm-eval: spread a model bigger than one GPU over this node's GPUs."
    ),
    here: bool = typer.Option(
        False,
        "--here",
        help="--tasks of a cloud or Slurm run: score on this machine, not as a job on the run's infra.",
    ),
    config_dir: Optional[str] = ConfigDirOpt,
    tracking_uri: Optional[str] = TrackingUriOpt,
) -> None:
    """Score a checkpoint: loss, perplexity, bits/byte; lm-eval tasks.

    --tasks of a cloud or Slurm run runs as a job on the run's infra, billed to the run (--here: on this machine).
    """
    from llmctl.run import eval_and_export as ev
    from llmctl.run.scoring import evaluate
    from llmctl.sweep.state import untrained

    try:
        if hf:
            ev.require_transformers()  # before any work: the message names the install (--tasks: where it scores)
        request = None
        if tasks is not None:
            from llmctl.run import benchmark_scores

            request = benchmark_scores.parse_request(tasks, include_path, num_fewshot, limit, batch_size, parallelize)
        code = evaluate(
            target,
            overrides or [],
            request=request,
            hf=hf,
            here=here,
            nproc=nproc,
            tracking_uri=tracking_uri,
            config_dir=config_dir,
            untrained=untrained,
            say=typer.echo,
        )
    except ConfigError as exc:
        raise _fail(str(exc), EXIT_CONFIG) from None
    except LaunchError as exc:
        raise _fail(str(exc), EXIT_FAILED) from None
    except KeyboardInterrupt:
        raise _fail("eval interrupted", EXIT_INTERRUPTED) from None
    if code:
        raise typer.Exit(code)


@app.command("export")
def export_cmd(
    target: str = typer.Argument(
        ..., help="MLflow run id (or a unique prefix), a checkpoint's model URI (models:/m-...), or a checkpoint URL."
    ),
    fmt: str = typer.Option(
        "hf",
        "--format",
        help="hf: transformers Llama (sharded safetensors + config + tokenizer; a LoRA run's adapters merged in);"
        " peft: a LoRA run's adapters (adapter_config.json + adapter_model.safetensors) for PEFT or vLLM.",
    ),
    out: Optional[str] = typer.Option(None, "--out", help="Directory (default: llmctl-runs/<run>/export-<format>)."),
    step: Optional[int] = typer.Option(None, "--step", help="Checkpoint step (default: newest complete)."),
    dtype: str = typer.Option(
        "bf16", "--dtype", help="Weights: bf16 (default), fp16 or fp32; config.json's torch_dtype says which."
    ),
    upload: bool = typer.Option(False, "--upload", help="Also copy the files into the run's artifacts (export/hf)."),
    config_dir: Optional[str] = ConfigDirOpt,
    tracking_uri: Optional[str] = TrackingUriOpt,
) -> None:
    """Export a checkpoint for transformers, lm-eval or vLLM."""
    from llmctl.run import eval_and_export as ev
    from llmctl.sweep.state import untrained

    if fmt not in ("hf", "peft"):
        raise _fail(f"--format {fmt}: choose hf or peft", 2)
    t = None
    try:
        ev.check_export_dtype(dtype)  # before anything is created
        overrides = [f"eval.step={step}"] if step is not None else []
        t = ev.resolve_target(target, overrides, tracking_uri, config_dir, untrained)
        if fmt == "peft":
            out_dir, got = ev.export_peft(t, out, typer.echo)
        else:
            out_dir, got = ev.export_hf(t, out, typer.echo, dtype)
        if upload:
            ev.upload_export(t, out_dir, fmt)
    except ConfigError as exc:
        ev.discard(t)
        raise _fail(str(exc), EXIT_CONFIG) from None
    except LaunchError as exc:
        raise _fail(str(exc), EXIT_FAILED) from None
    typer.echo(
        f"llmctl: exported step {got} to {out_dir}"
        + (f" (tag llmctl.export.{fmt} on run {t.run_id})" if t.run_id else "")
    )


@data_app.command("prepare")
def data_prepare(overrides: Optional[List[str]] = OverridesArg, config_dir: Optional[str] = ConfigDirOpt) -> None:
    """Tokenize data.source into the cache now, so launches start training at once."""
    from llmctl.config.compose import compose

    try:
        composed = compose(overrides or [], config_dir)
    except ConfigError as exc:
        raise _fail(str(exc), EXIT_CONFIG) from None
    from llmctl.backends.trainer_entry import run_trainer_entry

    try:  # the trainer's own entry point prints its progress and the cache path
        run_trainer_entry("prepare", composed.cfg, capture=False)
    except LaunchError:
        raise typer.Exit(EXIT_FAILED) from None


@app.command()
def smoke(
    overrides: Optional[List[str]] = OverridesArg,
    min_loss_drop: float = typer.Option(0.5, "--min-loss-drop", help="Fail unless val/loss falls by this much (nats)."),
    junit_xml: Optional[str] = typer.Option(None, "--junit-xml", help="Write the stages as JUnit XML here."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow store (default as for launch)."),
) -> None:
    """CI gate: launch, resume, eval; fails if the loss does not fall."""
    from llmctl import smoke as smoke_mod

    result = smoke_mod.run_smoke(overrides or [], min_loss_drop, tracking_uri, typer.echo)
    if junit_xml:
        smoke_mod.write_junit(result, junit_xml)
    typer.echo(smoke_mod.summary(result))
    raise typer.Exit(0 if result.ok else EXIT_FAILED)


@config_app.command("show")
def config_show(overrides: Optional[List[str]] = OverridesArg, config_dir: Optional[str] = ConfigDirOpt) -> None:
    """Print the composed, validated config as YAML."""
    from llmctl.config.compose import compose, to_yaml

    try:
        composed = compose(overrides or [], config_dir)
    except ConfigError as exc:
        raise _fail(str(exc), EXIT_CONFIG) from None
    from llmctl.config.notify import masked

    typer.echo(to_yaml(masked(composed.cfg)).rstrip())


@config_app.command("groups")
def config_groups(config_dir: Optional[str] = ConfigDirOpt) -> None:
    """List the config groups and their options (choose with group=option)."""
    from llmctl.config.compose import GROUPS, group_options

    for group in GROUPS:
        typer.echo(f"{group:<11} {', '.join(group_options(group, config_dir))}")


def main() -> None:
    from workloads.protocol.process_exit import exit_process

    try:
        app(prog_name="llmctl")  # Typer ends with SystemExit
    except SystemExit as done:
        exit_process(done.code)


if __name__ == "__main__":
    main()
