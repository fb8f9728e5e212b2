"""``llmctl resume RUN_ID [OVERRIDES]``: continue a stopped run from its newest complete checkpoint,
in the same MLflow run, here or on other infra, at the same or another world size (docs/resume.md).

Order: find the run → its config (the ``config.yaml`` artifact: the config it last ran with) →
re-compose it with the overrides through the normal compose/validate path → plan → the checkpoint
it will start from → the estimate of what is left → ``lifecycle.resume`` (preflight, budget,
attempt n+1, run, close). Everything that can refuse does so before the run is touched.
"""

from __future__ import annotations

import tempfile
from typing import Any, Callable, Optional

from llmctl.errors import ConfigError
from workloads.planner import schedule
from workloads.protocol.checkpoint_layout import latest_complete
from workloads.protocol.config import typed, with_values

# groups whose sections are re-derived when changed; experiment/model cannot change under a checkpoint
RESECTION = {"infra": ("infra", "parallel"), "parallel": ("parallel",), "data": ("data",), "train": ("train",)}


# ----------------------------------------------------------------------------- config


def _hydra_value(v: Any) -> str:
    """A resolved value as Hydra override text (strings quoted, so paths and URLs survive)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(x)}" for k, x in v.items()) + "}"
    return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"


def compose_resume(
    stored: dict[str, Any], choices: dict[str, str], overrides: list[str], config_dir: Optional[str] = None
) -> Any:
    """The stored config + overrides, through ``config.compose`` (same checks, same messages).

    Compose input: the run's group choices, then every stored value as ``key=value``, then the
    user's overrides. A group override (``infra=aws``) drops the stored values of its sections so
    the new option's values apply (changing infra re-derives ``parallel`` too: its stored values are
    the old machine's layout). ``model=`` and ``experiment=`` are refused: a checkpoint only loads
    into the model that wrote it.
    """
    from llmctl.config.compose import GROUPS, compose, free_form, parse_overrides
    from llmctl.config.root_schema import drop_retired

    user = list(overrides)
    dropped: set[str] = set()
    for raw, ov in zip(user, parse_overrides(user)):
        group = ov.key_or_group
        if group in ("model", "experiment"):
            raise ConfigError(
                f"'{raw}': a resumed run keeps its {group} (its checkpoint only loads into the"
                f" same model); set individual keys instead, or launch a new run"
            )
        if group in GROUPS:
            dropped.update(RESECTION.get(group, (group,)))
    base = [
        f"{g}={c}"
        for g, c in choices.items()
        if g in GROUPS and g not in ("experiment",) and g not in dropped and c not in (None, "None", "null")
    ]
    # section.key = value, two levels as the schema has them: a map value (infra.accelerator_aliases)
    # stays one override, not one per entry
    base += [
        f"{section}.{key}={_hydra_value(v)}"
        for section, values in drop_retired(stored).items()
        if section not in dropped
        for key, v in values.items()
        if not free_form(f"{section}.{key}.")
    ]
    # a user program's flags and variables (``workload.args``, ``workload.env``): one override each,
    # as they were given (the schema has no names for them to merge a whole map into)
    base += [
        f"{section}.{key}.{name}={_hydra_value(v)}"
        for section, values in drop_retired(stored).items()
        if section not in dropped
        for key, entries in values.items()
        if free_form(f"{section}.{key}.") and isinstance(entries, dict)
        for name, v in entries.items()
    ]
    return compose(base + user, config_dir)


def _stored_config(mc: Any, run: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = mc.download_artifacts(run.info.run_id, "config.yaml", tmp)
        except Exception as exc:
            raise ConfigError(
                f"run {run.info.run_id} has no config.yaml artifact ({type(exc).__name__}); it was"
                " not launched by llmctl, or its artifact store is unreachable"
            ) from None
        return OmegaConf.to_container(OmegaConf.load(path))  # type: ignore[return-value]


# ----------------------------------------------------------------------------- resume


def _check_not_running(run: Any, uri: str) -> None:
    """A RUNNING run whose job is alive must be stopped first: two jobs never write one checkpoint."""
    from llmctl.backends import backend_of

    if run.info.status != "RUNNING" or not backend_of(run).alive(run, uri):
        return  # finished, or its controller died without closing it: safe to take over
    rid = run.info.run_id
    raise ConfigError(
        f"run {rid} is still running on {run.data.tags.get('llmctl.infra', '?')}; stop it first"
        f" (llmctl down {rid}) so two jobs never write one checkpoint directory"
    )


def resume(
    run_id: str,
    overrides: list[str],
    config_dir: Optional[str],
    tracking_uri: Optional[str],
    max_cost: Optional[float],
    echo: Callable[..., None],
    ignore_memory_plan: bool = False,
) -> int:
    """The whole command; returns the exit code. ConfigError (→ 3) before anything is changed."""
    from llmctl.config.compose import Composed
    from llmctl.config.workload import is_command
    from llmctl.plan.make import estimate_for, make_plan
    from llmctl.run import closing, lifecycle, outcomes
    from llmctl.tracking import mlflow_run as tracking
    from llmctl.tracking import runs

    uri = runs.tracking_uri(tracking_uri)
    run = runs.get_run(run_id, uri)
    run_id = run.info.run_id  # the full id, when a prefix was given
    _check_not_running(run, uri)
    stored = _stored_config(tracking.client(uri), run)
    choices = {k[len("llmctl.choice.") :]: v for k, v in run.data.tags.items() if k.startswith("llmctl.choice.")}
    if (stored.get("model") or {}).get("init_from"):  # tagged with the checkpoint's name, not a conf/model option:
        choices.pop("model", None)  # the stored model values (the checkpoint's shape) are all there is to it
    composed = compose_resume(stored, choices, overrides, config_dir)
    root = composed.cfg["checkpoint"]["dir"]
    if is_command(composed.cfg):  # a user's program finds its own state: LLMCTL_RESUME=1, LLMCTL_CHECKPOINT_DIR
        if run.info.status == "FINISHED" and not overrides:
            # its program exited 0: a rerun would be billed as attempt n+1 and log its steps again
            raise ConfigError(
                f"run {run_id} finished (its program exited 0): nothing to resume. To run it further, change"
                f" what it runs: llmctl resume {run_id} workload.args.<name>=<value>"
            )
        plan = make_plan(Composed(cfg=composed.cfg, choices=choices, overrides=overrides, typed=composed.typed))
        where = f"(the program continues from its own state in {tracking.redact(str(root or '-'))})"
        return lifecycle.resume(
            plan,
            uri,
            run,
            from_step=None,
            remaining=plan.estimate,
            max_cost=max_cost,
            say=echo,
            where=where,
            ignore_memory_plan=ignore_memory_plan,
        )
    if not root:
        raise ConfigError(f"run {run_id} has no checkpoint.dir: there is nothing to resume from; launch it again")
    try:
        step = latest_complete(str(root))
    except Exception as exc:
        raise ConfigError(
            f"cannot list checkpoints in {tracking.redact(str(root))}: {type(exc).__name__}: {exc}"
        ) from None
    pin, said = schedule.extension(typed(stored).train, composed.typed.train, step or 0)
    pinned = composed.typed
    if pin is not None:
        composed.cfg["train"]["schedule_steps"] = pin
        pinned = with_values(composed.typed, "train", schedule_steps=pin)
    plan = make_plan(Composed(cfg=composed.cfg, choices=choices, overrides=overrides, typed=pinned))
    total = int(plan.cfg["train"]["steps"])
    if step is not None and step >= total and run.info.status != "FINISHED":
        # the work is done (e.g. killed after its last checkpoint): close the run, nothing to rerun
        closing.close_run(
            uri,
            run_id,
            outcomes.Outcome.FINISHED,
            f"finished: complete checkpoint at step {step} of {total}",
            closing.ended_at_of(run),  # billed to when its job ended, not to now
        )
        echo(f"llmctl: run {run_id} already has its final checkpoint (step {step} of {total}); marked FINISHED")
        return 0
    if step is not None and step >= total:
        raise ConfigError(
            f"run {run_id} already has a complete checkpoint at step {step} of train.steps={total}:"
            f" nothing to resume. To train further, raise it: llmctl resume {run_id} train.steps=<N>"
        )
    left = {**plan.cfg, "train": {**plan.cfg["train"], "steps": total - (step or 0)}}
    remaining = estimate_for(plan, cfg=left) if plan.estimate is not None else None
    if said:
        echo(f"llmctl: {said}")
    where = (
        f"from step {step} ({tracking.redact(str(root))})"
        if step is not None
        else f"from step 0: no complete checkpoint in {tracking.redact(str(root))}, so the run restarts"
        " within the same MLflow run"
    )
    return lifecycle.resume(
        plan,
        uri,
        run,
        from_step=step,
        remaining=remaining,
        max_cost=max_cost,
        say=echo,
        where=where,
        ignore_memory_plan=ignore_memory_plan,
    )
