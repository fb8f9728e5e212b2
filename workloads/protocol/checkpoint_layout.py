"""Where checkpoints live and which of them are complete; fsspec only, no torch.

Layout under ``checkpoint.dir`` (a path or any fsspec URL)::

    step-<N>/...        DCP files (``checkpoint.py`` writes them)
    step-<N>/.complete  the marker, written last: only a step with it is loadable (JSON: the step,
                        the world size, when and how long the save took, and the dtype the run
                        computed in, ``compute_dtype``: what a QLoRA base was de-quantized to)

This layout is part of the trainer's contract: a launcher (``llmctl resume``) finds the newest
complete step with these functions without importing torch.
"""

from __future__ import annotations

import re
from typing import Any

MARKER = ".complete"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def fs_and_path(url: str) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(url)


def join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def step_dir(root: str, step: int) -> str:
    return join(root, f"step-{step}")


def split_step_dir(url: str) -> tuple[str, int | None]:
    """(root, N) for a ``.../step-N`` directory; (url, None) for anything else."""
    url = str(url).rstrip("/")
    root, _, last = url.rpartition("/")
    m = _STEP_DIR.match(last)
    return (root or ".", int(m.group(1))) if m else (url, None)


def list_checkpoints(root: str) -> dict[int, bool]:
    """{step: complete} for every ``step-<N>`` directory under ``root`` (empty if none)."""
    fs, path = fs_and_path(root)
    fs.invalidate_cache()  # s3fs caches listings; another process may have written since
    if not fs.exists(path):
        return {}
    steps = {}
    for entry in fs.ls(path, detail=False):
        m = _STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if m:
            steps[int(m.group(1))] = fs.exists(join(entry, MARKER))
    return steps


def latest_complete(root: str) -> int | None:
    """The newest step whose marker exists, or None."""
    done = [s for s, ok in list_checkpoints(root).items() if ok]
    return max(done) if done else None


def read_marker(step_url: str) -> dict[str, Any]:
    """A complete step's marker (``step-<N>/.complete``) as written; ``{}`` when it is not JSON (an
    empty marker of an older layout) or cannot be read."""
    import json

    fs, path = fs_and_path(step_url)
    try:
        with fs.open(join(path, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}
