"""The GPU suite (``pytest -m gpu``): every test here is marked ``gpu`` and skips without CUDA.

Default runs (CI) deselect the mark (pyproject ``addopts``); should one be selected anyway on a
machine without CUDA, this hook skips it before any fixture runs, with the reason.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
