"""Checkpoints as MLflow logged models: the run's Models tab lists them, and ``models:/m-...`` names
one for ``llmctl eval`` / ``llmctl export``.

When an attempt closes, the final complete checkpoint and the best one by ``val/loss`` become
external logged models (the weights stay in ``checkpoint.dir``; MLflow keeps where they are, the
step, and the step's metrics, linked to the model). A step already logged is not logged again, so a
resumed run adds its new final checkpoint beside the old ones.
"""

from __future__ import annotations

import tempfile
from typing import Any, Optional

TAG_STEP = "llmctl.step"
TAG_CHECKPOINT = "llmctl.checkpoint"
TAG_ROLE = "llmctl.role"
MODEL_TYPE = "llmctl-checkpoint"
URI_PREFIX = "models:/"
LINKED_METRICS = ("train/loss", "val/loss")


def chosen_steps(complete: list[int], val_loss: dict[int, float]) -> dict[int, str]:
    """{step: role}: the newest complete step ("final") and the complete step of lowest val loss ("best")."""
    if not complete:
        return {}
    roles = {max(complete): "final"}
    scored = [s for s in complete if s in val_loss]
    if scored:
        best = min(scored, key=lambda s: val_loss[s])
        roles[best] = "best" if best not in roles else "final, best"
    return roles


def logged_steps(mc: Any, experiment_id: str, run_id: str) -> set[int]:
    models = mc.search_logged_models(experiment_ids=[experiment_id], filter_string=f"source_run_id = '{run_id}'")
    return {int(m.tags[TAG_STEP]) for m in models if TAG_STEP in m.tags}


def log_checkpoints(mc: Any, experiment_id: str, run_id: str, checkpoint_dir: Optional[str]) -> list[str]:
    """Log the final and best complete checkpoints under ``checkpoint_dir`` as models of the run;
    returns the new models' ids."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric
    from mlflow.models.model import MLMODEL_FILE_NAME
    from mlflow.models.utils import get_external_mlflow_model_spec
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_IS_EXTERNAL

    from llmctl.tracking.mlflow_run import redact
    from workloads.protocol.checkpoint_layout import list_checkpoints, step_dir

    if not checkpoint_dir:
        return []
    complete = [s for s, ok in list_checkpoints(checkpoint_dir).items() if ok]
    history = {name: {m.step: m for m in mc.get_metric_history(run_id, name)} for name in LINKED_METRICS}
    roles = chosen_steps(complete, {s: m.value for s, m in history["val/loss"].items()})
    done = logged_steps(mc, experiment_id, run_id)
    new = []
    for step, role in sorted(roles.items()):
        if step in done:
            continue
        where = redact(step_dir(checkpoint_dir, step))
        model = mc.create_logged_model(
            experiment_id=experiment_id,
            name=f"step-{step}",
            source_run_id=run_id,
            model_type=MODEL_TYPE,
            tags={TAG_STEP: str(step), TAG_CHECKPOINT: where, TAG_ROLE: role, MLFLOW_MODEL_IS_EXTERNAL: "true"},
            params={"step": str(step), "checkpoint": where},
        )
        with tempfile.TemporaryDirectory() as tmp:  # what MLflow's create_external_model writes: an MLmodel stub
            get_external_mlflow_model_spec(model).save(f"{tmp}/{MLMODEL_FILE_NAME}")
            mc.log_model_artifacts(model.model_id, tmp)
        mc.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        # the step's own points (same timestamp: the run's history gains nothing), now also the model's
        points = [
            Metric(m.key, m.value, m.timestamp, m.step, model_id=model.model_id)
            for name in LINKED_METRICS
            if (m := history[name].get(step)) is not None
        ]
        if points:
            mc.log_batch(run_id, metrics=points)
        mc.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])  # the run's outputs list it at its step
        new.append(model.model_id)
    return new


def resolve(mc: Any, uri: str) -> tuple[str, int]:
    """``models:/m-...`` → (source run id, step), or a ConfigError saying what the URI should be."""
    from llmctl.errors import ConfigError

    model_id = uri[len(URI_PREFIX) :].strip("/")
    try:
        model = mc.get_logged_model(model_id)
    except Exception as exc:
        raise ConfigError(
            f"no logged model {model_id!r} in this tracking store ({type(exc).__name__}). Fix: copy "
            f"the model id from the run's Models tab (models:/m-...), or pass the run id"
        ) from None
    if TAG_STEP not in model.tags or not model.source_run_id:
        raise ConfigError(
            f"model {model_id} is not an llmctl checkpoint (no {TAG_STEP} tag / source run). "
            f"Fix: pass the run id or the checkpoint URL instead"
        )
    return model.source_run_id, int(model.tags[TAG_STEP])
