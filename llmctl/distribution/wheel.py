"""The wheel the nodes install: the llmctl this controller runs, as it runs here.

From a checkout (our ``pyproject.toml`` above the package, installed editable or not), the project's
own build backend builds it from the working tree, uncommitted changes included (``pip wheel``).
From an installed distribution, pip's unpacked files are packed back into a wheel, with a fresh
RECORD (an installed package keeps no copy of the wheel it came from). Either way the wheel holds the
files whose digest is ``identity.build_id()``; it is kept per build under the user's cache, so every
launch of one build ships the same file and builds it once.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Optional

from llmctl.distribution.identity import build_id
from llmctl.errors import LaunchError

DISTRIBUTION = "llmctl-train"
# written by pip at install time, not part of the wheel (RECORD is written afresh)
INSTALL_ONLY = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


def checkout_root() -> Optional[Path]:
    """The source checkout this llmctl is imported from, or None for an installed distribution."""
    import llmctl

    root = Path(llmctl.__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and f'name = "{DISTRIBUTION}"' in pyproject.read_text() and (root / "workloads").is_dir():
        return root
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmctl" / "wheels"


def wheel_for_nodes(cache: Optional[Path] = None) -> Path:
    """This build's wheel, built (or packed) the first time it is asked for."""
    out = (cache or cache_dir()) / build_id()
    found = sorted(out.glob("*.whl"))
    if found:
        return found[0]
    scratch = out.with_name(f".{out.name}.{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        root = checkout_root()
        if root:
            _build(root, scratch)
        else:
            _repack(scratch)
        try:
            os.replace(scratch, out)
        except OSError:  # another launch of the same build got there first: its wheel is this one
            pass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return sorted(out.glob("*.whl"))[0]


def _build(root: Path, dest: Path) -> None:
    """``pip wheel`` of the checkout: offline with the build backend installed here, else pip fetches it."""
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--quiet",
        *isolation,
        "--wheel-dir",
        str(dest),
        str(root),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0 or not any(dest.glob("*.whl")):
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no wheel written"]
        raise LaunchError(f"building llmctl's wheel for the nodes from {root} failed: {tail[0]}")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _repack(dest: Path) -> None:
    """The installed distribution's files (those inside site-packages) as a wheel."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise LaunchError(f"llmctl is neither a source checkout nor an installed {DISTRIBUTION}") from None
    files = [f for f in dist.files or [] if f.parts and f.parts[0] != ".."]  # scripts live outside
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    name = f"{DISTRIBUTION.replace('-', '_')}-{dist.version}-py3-none-any.whl"
    records = []
    with zipfile.ZipFile(dest / name, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in sorted(files, key=str):
            if "__pycache__" in f.parts or f.suffix == ".pyc" or (f.parts[0] == info and f.name in INSTALL_ONLY):
                continue
            data = Path(str(f.locate())).read_bytes()
            zf.writestr(f.as_posix(), data)
            records.append(_record_line(f.as_posix(), data))
        zf.writestr(f"{info}/RECORD", "\n".join([*records, f"{info}/RECORD,,"]) + "\n")
