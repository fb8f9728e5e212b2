"""Runs after launch: find one by MLflow run id; list and describe runs.

The run's params and tags say which backend ran it (``backends.backend_of``) and where it lives
(``llmctl.sky.*``), so an id is all a user needs to give.
"""

from __future__ import annotations

from typing import Any, Optional

from llmctl.errors import ConfigError
from llmctl.tracking import client, redact, resolve_uri

RECENT = 20


def tracking_uri(given: Optional[str]) -> str:
    return resolve_uri(given)


def get_run(run_id: str, uri: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client(uri).get_run(run_id)
    except MlflowException:
        raise ConfigError(f"no run '{run_id}' in {redact(uri)}. Fix: `llmctl status` lists runs;"
                          " pass --tracking-uri (or set MLFLOW_TRACKING_URI) if the run is tracked elsewhere") from None


def recent(uri: str, limit: int = RECENT) -> list[Any]:
    mc = client(uri)
    exps = mc.search_experiments()
    if not exps:
        return []
    return mc.search_runs([e.experiment_id for e in exps], max_results=limit, order_by=["attributes.start_time DESC"])


def describe(run: Any, backend_lines: list[str]) -> str:
    tags, params = run.data.tags, run.data.params
    lines = [
        f"run:         {run.info.run_id} ({run.info.run_name})",
        f"mlflow:      {run.info.status}" + (f" - {tags['llmctl.status']}" if tags.get("llmctl.status") else ""),
        f"infra:       {tags.get('llmctl.infra', '?')} (backend {params.get('infra.kind', 'local')})",
    ]
    return "\n".join(lines + backend_lines)


def table(runs: list[Any]) -> str:
    rows = [f"{'run id':<34} {'status':<9} {'infra':<8} {'where':<22} name"]
    for r in runs:
        where = r.data.tags.get("llmctl.sky.cluster") or ("managed job " + r.data.tags["llmctl.sky.managed_job_id"]
                                                          if r.data.tags.get("llmctl.sky.managed_job_id") else "local")
        rows.append(f"{r.info.run_id:<34} {r.info.status:<9} {r.data.tags.get('llmctl.infra', '?'):<8}"
                    f" {where:<22} {r.info.run_name or ''}")
    return "\n".join(rows)
