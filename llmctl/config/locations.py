"""One check for every key that takes a URL or a path, before anything is created.

A typo in a location used to get through composition and fail later: in a worker (a FAILED run left
behind) or inside MLflow (a traceback). Here each value is parsed once: a URL's scheme must be one
fsspec (data, checkpoints, weights) or MLflow (the tracking store) knows, a URL must be well formed,
and on ``infra=local`` an input that is a local path must exist. fsspec's registry is a plain dict
(no backend is imported); MLflow's schemes are listed here because importing MLflow costs seconds.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

from llmctl.errors import ConfigError

# key -> whether it is read (must exist when local) or written
FSSPEC_KEYS = {
    "data.source": True,
    "data.tokenizer": True,
    "model.init_from": True,
    "eval.source": True,
    "checkpoint.dir": False,
    "data.cache_dir": False,
}
MLFLOW_SCHEMES = {
    "http",
    "https",
    "sqlite",
    "file",
    "postgresql",
    "mysql",
    "mssql",
    "databricks",
    "databricks-uc",
    "uc",
}
BUILTIN = "builtin:"
URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
ALMOST_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)(:/(?!/)|//|:(?!/))")  # s3:/b, s3//b, s3:b (not C:\ or ./x)


def _bad(key: str, value: str, message: str) -> ConfigError:
    return ConfigError(f"Bad value for '{key}': {value!r} {message}")


def _get(cfg: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def check_fsspec(key: str, value: str, read: bool, local: bool) -> None:
    """A data/checkpoint/weights location: a URL fsspec knows (chains like ``simplecache::s3://`` too),
    or a path (which must exist if it is read on this machine)."""
    from fsspec.registry import known_implementations

    if not value.strip():
        raise _bad(key, value, "is empty. Fix: a path, an fsspec URL (s3://bucket/path), or null")
    if value.startswith(BUILTIN):
        if key != "data.source":
            raise _bad(key, value, "is a bundled corpus name; only data.source takes one")
        return
    for part in value.split("::"):
        m = URL.match(part)
        if m:
            scheme = m.group(1).lower()
            if scheme not in known_implementations:
                near = [
                    s for s in ("s3", "gs", "gcs", "az", "abfs", "hf", "http", "https", "file") if s[0] == scheme[0]
                ]
                raise _bad(
                    key,
                    value,
                    f"has a scheme fsspec does not know ({scheme}://)."
                    f" Fix: {' or '.join(f'{s}://' for s in near) or 's3://, gs://, hf://, a local path'}",
                )
            if scheme not in ("file", "local", "memory") and not urlsplit(part).netloc:
                raise _bad(key, value, f"names no bucket or host after {scheme}://")
            continue
        almost = ALMOST_URL.match(part)
        if almost and almost.group(1).lower() in known_implementations:
            scheme = almost.group(1)
            rest = part[almost.end() :].lstrip("/")
            raise _bad(key, value, f"is not a well-formed URL. Fix: {scheme}://{rest}")
    if read and local and "://" not in value and "::" not in value:
        path = Path(value).expanduser()
        if not (path.exists() or (glob.has_magic(value) and glob.glob(str(path), recursive=True))):
            raise _bad(key, value, "does not exist on this machine (infra=local reads it from here)")


def check_tracking_uri(value: Optional[str]) -> None:
    """``tracking.uri``: a store MLflow can open, well formed, so MLflow never starts with a traceback."""
    if value is None:
        return
    key = "tracking.uri"
    if not value.strip():
        raise _bad(key, value, "is empty. Fix: null (./mlflow.db), http://HOST:PORT or sqlite:///PATH")
    m = URL.match(value) or re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", value)
    if not m or re.match(r"^[A-Za-z]:[\\/]", value):  # a path (MLflow's file store), e.g. ./mlruns
        if re.match(r"^[\w.-]+:\d+", value):  # host:port without a scheme
            raise _bad(key, value, f"has no scheme. Fix: tracking.uri=http://{value}")
        return
    scheme = m.group(1).lower().split("+")[0]
    if scheme not in MLFLOW_SCHEMES:
        raise _bad(
            key,
            value,
            f"has a scheme MLflow's tracking stores do not know ({scheme}:)."
            " Fix: http://HOST:PORT, https://..., sqlite:///PATH, postgresql://... or a path",
        )
    if scheme == "sqlite" and not value.startswith("sqlite:///"):
        raise _bad(key, value, "is not a sqlite URL. Fix: sqlite:///relative/path.db or sqlite:////absolute/path.db")
    if scheme in ("http", "https"):
        parts = urlsplit(value)
        try:
            _ = parts.port  # parsing it is the check
        except ValueError:
            raise _bad(key, value, "has a port that is not a number in 1-65535") from None
        if not parts.hostname:
            raise _bad(key, value, f"names no host. Fix: {scheme}://HOST:PORT")


def check(cfg: dict[str, Any]) -> None:
    """Every location key of a resolved config."""
    local = _get(cfg, "infra.kind") == "local"
    for key, read in FSSPEC_KEYS.items():
        value = _get(cfg, key)
        if value is not None:
            check_fsspec(key, str(value), read, local)
    uri = _get(cfg, "tracking.uri")
    check_tracking_uri(None if uri is None else str(uri))
