"""Runs after launch: find one by MLflow run id (or a unique prefix of it); list and describe runs.

The run's params and tags say which backend ran it (``backends.backend_of``) and where it lives
(``llmctl.sky.*``), so an id is all a user needs to give.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from llmctl.errors import ConfigError
from llmctl.tracking.mlflow_run import client, missing_store, redact, resolve_uri

RECENT = 20


def tracking_uri(given: Optional[str]) -> str:
    return resolve_uri(given)


MIN_PREFIX = 4  # as git: fewer characters name too many runs to be worth guessing
_PREFIX_CHARS = re.compile(r"^[A-Za-z0-9-]+$")  # run ids are hex; nothing a LIKE pattern would read as a wildcard


def get_run(ref: str, uri: str) -> Any:
    """The run ``ref`` names: its full MLflow id, or a unique prefix of it (as git and docker take).
    Every command that takes a run id resolves it here, so the short ids the tables print work
    wherever an id is asked for. ConfigError (exit 3) when no run or several runs match."""
    from mlflow.exceptions import MlflowException

    missing = missing_store(uri, f"no run '{ref}'")
    if missing:  # opening it would create an empty store, then report it
        raise ConfigError(
            f"{missing} (no runs yet here). Fix: run llmctl where the run was launched, or pass --tracking-uri"
            " (or set MLFLOW_TRACKING_URI) if it is tracked elsewhere"
        )
    mc = client(uri)
    try:
        return mc.get_run(ref)
    except MlflowException:
        pass
    matches: list[Any] = []
    if len(ref) >= MIN_PREFIX and _PREFIX_CHARS.match(ref):
        try:
            matches = _by_prefix(mc, ref)
        except MlflowException:  # an unreachable server: the same answer as for an unknown id
            pass
    if len(matches) == 1:
        return matches[0]
    if matches:
        listed = "\n".join(f"  {r.info.run_id}  {r.info.status:<8} {r.info.run_name or ''}" for r in matches[:20])
        more = f"\n  ... and {len(matches) - 20} more" if len(matches) > 20 else ""
        raise ConfigError(
            f"run id '{ref}' is ambiguous: {len(matches)} runs in {redact(uri)} start with it:\n"
            f"{listed}{more}\nFix: give more characters of the id"
        )
    short = f" (a prefix needs at least {MIN_PREFIX} characters)" if len(ref) < MIN_PREFIX else ""
    raise ConfigError(
        f"no run '{ref}' in {redact(uri)}{short}. Fix: `llmctl runs` (or `llmctl status`) lists runs;"
        " pass --tracking-uri (or set MLFLOW_TRACKING_URI) if the run is tracked elsewhere"
    )


def _by_prefix(mc: Any, prefix: str) -> list[Any]:
    """Runs of every experiment whose id starts with ``prefix`` (the store filters; checked here too,
    since LIKE is case-insensitive in sqlite)."""
    exps = [e.experiment_id for e in mc.search_experiments()]
    if not exps:
        return []
    found = mc.search_runs(exps, f"attributes.run_id LIKE '{prefix}%'", max_results=1000)
    return [r for r in found if r.info.run_id.startswith(prefix)]


def recent(uri: str, limit: int = RECENT) -> list[Any]:
    if missing_store(uri):
        return []
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
        where = r.data.tags.get("llmctl.sky.cluster") or (
            "managed job " + r.data.tags["llmctl.sky.managed_job_id"]
            if r.data.tags.get("llmctl.sky.managed_job_id")
            else "local"
        )
        status = "PRUNED" if r.data.tags.get("llmctl.pruned") else r.info.status  # as `runs` and a sweep's status say
        rows.append(
            f"{r.info.run_id:<34} {status:<9} {r.data.tags.get('llmctl.infra', '?'):<8}"
            f" {where:<22} {r.info.run_name or ''}"
        )
    return "\n".join(rows)
