"""SkyPilot test fixtures: a private HOME with the fixture catalogs, telemetry off, and the
``--no-slurm`` switch for the real-Slurm test (CI runs it; locally ``--no-slurm`` or
``LLMCTL_SKIP_SLURM=1`` skips it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest
from sky_helpers import install_catalog


@pytest.fixture(scope="session")
def sky_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """In-process SkyPilot reads HOME once, at import: point it at a temp dir for this session."""
    home = tmp_path_factory.mktemp("sky-home")
    install_catalog(home)
    saved = {
        k: os.environ.get(k)
        for k in ("HOME", "SKYPILOT_DISABLE_USAGE_COLLECTION", "DO_NOT_TRACK", "AWS_EC2_METADATA_DISABLED")
    }
    os.environ.update(
        {
            "HOME": str(home),
            "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
            "DO_NOT_TRACK": "1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    )
    import sky.catalog  # noqa: F401  (binds the catalog dir to this HOME)

    yield home
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture()
def sky_env(cli_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """Environment for the real CLI: private HOME with catalogs, no cloud credentials, no MLflow env."""
    home = Path(cli_env["HOME"])
    install_catalog(home)
    env = {k: v for k, v in cli_env.items() if not k.startswith(("AWS_", "SKYPILOT_API", "RUNPOD", "LAMBDA"))}
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    return env
