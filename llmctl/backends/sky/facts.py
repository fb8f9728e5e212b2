"""SkyPilot's answers that ``llmctl plan`` needs, remembered on disk: ``import sky`` alone takes
seconds, longer than the rest of ``plan``.

Each answer (providers, a provider's declared capabilities, accelerator counts, offers and prices,
the task YAML through SkyPilot's loader) is keyed by the question and reused only while nothing it
came from has changed: SkyPilot's installed package, its catalog files under ``~/.sky/catalogs``
and its config file (size and mtime of each). Entries also expire after ``TTL_S``, so SkyPilot is
asked again on its own schedule and can refresh a stale catalog as it normally would. Only answers
are stored, never errors: a refused config asks SkyPilot every time and gets SkyPilot's own message.
The file lives in ``$LLMCTL_CACHE_DIR`` (else ``~/.cache/llmctl``); ``LLMCTL_SKY_FACTS=0`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

TTL_S = 3600.0
FILE_NAME = "sky-facts.json"


def cache_file() -> Path:
    from workloads.protocol.run_contract import cache_home

    return cache_home() / FILE_NAME


def _stat(path: str) -> Optional[list[int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def fingerprint() -> str:
    """What every answer depends on: SkyPilot's installed version and its catalogs and config on disk."""
    import importlib.util

    spec = importlib.util.find_spec("sky")  # finds the package without importing it
    parts: dict[str, Any] = {"sky": _stat(spec.origin) if spec and spec.origin else None}
    sky_home = os.path.join(os.path.expanduser("~"), ".sky")
    for config in (os.environ.get("SKYPILOT_CONFIG"), os.path.join(sky_home, "config.yaml")):
        if config:
            parts[config] = _stat(config)
    for folder, _, files in os.walk(os.path.join(sky_home, "catalogs")):
        for name in files:
            path = os.path.join(folder, name)
            parts[path] = _stat(path)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save(path: Path, data: dict[str, Any]) -> None:
    """Atomic replace: concurrent plans may lose each other's new entries, never corrupt the file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".sky-facts-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache dir costs speed, not correctness


def remembered(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a function of JSON-able arguments whose JSON-able answer depends only on them and on
    SkyPilot's installation (``fingerprint``); tuples come back as lists."""

    @functools.wraps(fn)
    def answer(*args: Any) -> Any:
        if os.environ.get("LLMCTL_SKY_FACTS", "1") == "0":
            return fn(*args)
        # hashed: a task's envs may hold credentials, and they must not land in a cache file
        key = hashlib.sha256(
            json.dumps([fn.__module__, fn.__qualname__, args], sort_keys=True, default=str).encode()
        ).hexdigest()
        path, now, stamp = cache_file(), time.time(), fingerprint()
        data = _load(path)
        hit = data.get(key)
        if isinstance(hit, dict) and hit.get("fingerprint") == stamp and now - hit.get("at", 0) < TTL_S:
            return hit["value"]
        value = fn(*args)
        data = {
            k: v
            for k, v in _load(path).items()
            if isinstance(v, dict) and v.get("fingerprint") == stamp and now - v.get("at", 0) < TTL_S
        }
        data[key] = {"fingerprint": stamp, "at": now, "value": value}
        _save(path, data)
        return value

    answer.uncached = fn  # type: ignore[attr-defined]
    return answer
