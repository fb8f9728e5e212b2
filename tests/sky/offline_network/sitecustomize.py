"""Test-only: on PYTHONPATH of the SkyPilot API server that the Slurm managed-job test starts.

SkyPilot's managed-job controller probes the internet (HTTPS to public DNS resolvers) before each
status poll and skips the poll while that fails. This machine has no internet, but the localhost
Slurm cluster is reachable, so the probe is the one boundary that cannot exist here: it is made to
succeed once ``sky.backends.backend_utils`` is imported. Nothing else is changed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "sky.backends.backend_utils"


def _patch(module: object) -> None:
    async def _async_ok() -> None:
        return None

    module.check_network_connection = lambda: None  # type: ignore[attr-defined]
    module.async_check_network_connection = _async_ok  # type: ignore[attr-defined]


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:  # type: ignore[no-untyped-def]
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
