"""Which llmctl this is: the version (one place, ``llmctl.__version__``, which the wheel's metadata
reads too) and a build id, a digest of the package's files as this process imports them.

The nodes of a run must run exactly the controller's llmctl. The version string alone cannot say so:
a checkout with uncommitted changes, or two builds of one release, share it. The build id is the same
for a checkout and for the wheel built from it (the checkout's ``conf/`` is the wheel's
``llmctl/conf/``), so a node compares it with the controller's before it starts anything."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

from llmctl import __version__

# what the wheel holds (pyproject's [tool.hatch.build.targets.wheel]); the checkout's conf/ goes inside llmctl/
PACKAGES = ("llmctl", "workloads")
# never in a wheel (the build's .gitignore rules): bytecode and build leftovers
SKIPPED_DIRS = {"__pycache__"}
SKIPPED_SUFFIXES = (".pyc", ".pyo", ".egg-info")


def _files_under(top: Path, prefix: str) -> Iterator[tuple[str, Path]]:
    for path in sorted(top.rglob("*")):
        rel = path.relative_to(top)
        if not path.is_file() or SKIPPED_DIRS & set(rel.parts) or any(p.endswith(SKIPPED_SUFFIXES) for p in rel.parts):
            continue
        yield f"{prefix}/{rel.as_posix()}", path


def package_files() -> list[tuple[str, Path]]:
    """``(name inside the wheel, file)`` for every file of llmctl's packages, from where they are imported."""
    import llmctl
    import workloads

    files: list[tuple[str, Path]] = []
    for package, name in ((llmctl, "llmctl"), (workloads, "workloads")):
        files += _files_under(Path(package.__file__).resolve().parent, name)
    checkout_conf = Path(llmctl.__file__).resolve().parents[1] / "conf"
    if not any(name.startswith("llmctl/conf/") for name, _ in files) and checkout_conf.is_dir():
        files += _files_under(checkout_conf, "llmctl/conf")
    return sorted(files)


def build_id() -> str:
    """A digest of every package file's name and content: equal builds, equal ids (12 hex digits)."""
    digest = hashlib.sha256()
    for name, path in package_files():
        digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:12]


def describe() -> str:
    """What ``llmctl --version`` prints, and what every node prints into the run's log before it starts."""
    return f"llmctl {__version__} (build {build_id()})"
