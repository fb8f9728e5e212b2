"""Backends turn a plan into running processes: ``local`` (torchrun here) or ``sky`` (SkyPilot).

Each is a class implementing ``base.Backend``, listed in the explicit ``registry`` below.
"""

from __future__ import annotations

from typing import Any

from llmctl.backends.base import Backend
from llmctl.errors import ConfigError


def registry() -> dict[str, Backend]:
    """Every backend, by ``infra.kind``. Imported when asked for: ``llmctl --help`` loads none."""
    from llmctl.backends.local import LocalBackend
    from llmctl.backends.sky.backend import SkyBackend

    return {b.name: b for b in (LocalBackend(), SkyBackend())}


def backend_for(kind: str) -> Backend:
    """The backend for ``infra.kind``."""
    backends = registry()
    if kind not in backends:
        raise ConfigError(f"Bad value for 'infra.kind': '{kind}' has no backend; known: {', '.join(backends)}")
    return backends[kind]


def backend_of(run: Any) -> Backend:
    """The backend that ran an MLflow run's latest attempt (``llmctl.backend``, set by resume,
    wins over the first launch's ``infra.kind``)."""
    return backend_for(run.data.tags.get("llmctl.backend") or run.data.params.get("infra.kind", "local"))
