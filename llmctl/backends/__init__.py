"""Backends: each turns a plan into running processes (local torchrun, or SkyPilot).

Every backend module offers ``plan(composed) -> Plan``, ``finalize(plan, handle) -> cfg``,
``launch(plan, handle) -> int``, ``run_dir(run_id)`` and, by MLflow run, ``status(run, uri)``,
``logs(run, uri, follow)``, ``down(run, uri)``; optionally ``preflight(plan)`` (checks that must
pass before an MLflow run is created).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from llmctl.errors import ConfigError

BACKENDS = {"local": "llmctl.backends.local", "sky": "llmctl.backends.sky"}


def backend_for(kind: str) -> ModuleType:
    """The backend module for ``infra.kind``, imported only when used."""
    if kind not in BACKENDS:
        raise ConfigError(f"Bad value for 'infra.kind': '{kind}' has no backend; known: {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[kind])
