"""Backends: each turns a plan into running processes (local torchrun now; SkyPilot later).

Every backend module offers ``plan(composed) -> Plan`` and ``launch(plan, handle) -> int``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from llmctl.errors import ConfigError

BACKENDS = {"local": "llmctl.backends.local"}


def backend_for(kind: str) -> ModuleType:
    """The backend module for ``infra.kind``, imported only when used."""
    if kind not in BACKENDS:
        raise ConfigError(f"Bad value for 'infra.kind': '{kind}' has no backend; known: {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[kind])
