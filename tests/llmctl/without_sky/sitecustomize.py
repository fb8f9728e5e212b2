"""Test-only: on PYTHONPATH of a CLI subprocess, this Python cannot find SkyPilot, as in a venv
installed without the ``cloud`` extra.

The path finder (what finds installed packages) answers "not found" for ``sky`` and its
submodules, so ``importlib.util.find_spec("sky")`` is None and ``import sky`` raises
``ModuleNotFoundError: No module named 'sky'``, exactly what a venv without the extra sees.
Nothing else is changed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


class _WithoutSky(importlib.abc.MetaPathFinder):
    def __init__(self, inner: type[importlib.machinery.PathFinder]) -> None:
        self.inner = inner

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name == "sky" or name.startswith("sky."):
            return None
        return self.inner.find_spec(name, path, target)

    def invalidate_caches(self) -> None:
        self.inner.invalidate_caches()


sys.meta_path[:] = [_WithoutSky(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
