"""PyPI's simple index as pip on this interpreter can use it: the same pages, less the files pip
would pass over for this interpreter, served on loopback for ``pip --index-url``.

Why: resolving one install line of llmctl-train's size makes pip evaluate every file of every release
of ~220 projects, and its CPU goes to parsing the versions and checking the tags of files it then
rejects or ranks below another file of the same release. Left out, each for the reason pip has to pass
it over:

- a wheel whose tags this interpreter does not support (numpy, grpcio, pydantic-core: dozens of
  platform wheels per release);
- a file whose ``Requires-Python`` excludes this interpreter (pip skips it unless told to ignore it; an
  unparsable one pip keeps, and so does this page);
- a file in a format pip does not install (``.egg``, ``.exe``, ``.msi``, ``.rpm``, ...);
- a source archive of a release that also has a wheel for this interpreter, that wheel not yanked (or
  both yanked): pip ranks any such wheel above any source archive of that release, so the release's
  candidate is the wheel either way.

So pip's candidates, its choices and its report are the ones it makes against PyPI itself; each page
is fetched and filtered once for all the resolutions of a test. Files keep their absolute
``files.pythonhosted.org`` URLs (pip reads metadata and wheels from there), and projects PyPI does not
have answer 404 as PyPI does.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

PYPI = "https://pypi.org/simple"
JSON_PAGE = "application/vnd.pypi.simple.v1+json"


# what pip installs from an index besides wheels (pip's SUPPORTED_EXTENSIONS: zip and tar archives)
SOURCE_ARCHIVES = (
    ".zip", ".tar.gz", ".tgz", ".tar", ".tar.bz2", ".tbz", ".tar.xz", ".txz", ".tlz", ".tar.lz", ".tar.lzma"
)  # fmt: skip


@dataclass(frozen=True)
class Interpreter:
    """What pip checks a file against: the wheel tags it accepts and the Python version it runs."""

    tags: frozenset[str]
    version: str


def interpreter(python: str) -> Interpreter:
    """The wheel tags pip accepts for ``python`` (pip's own list) and its version, asked of that interpreter."""
    import subprocess

    code = (
        "import platform\n"
        "from pip._internal.utils.compatibility_tags import get_supported\n"
        "print(platform.python_version())\n"
        "print('\\n'.join(str(t) for t in get_supported()))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return Interpreter(frozenset(out[1:]), out[0])


def wheel_tags(filename: str) -> set[str]:
    """``name-ver(-build)?-py-abi-plat.whl``: every tag its compressed tag sets expand to."""
    py, abi, plat = filename[: -len(".whl")].split("-")[-3:]
    return {f"{i}-{a}-{p}" for i in py.split(".") for a in abi.split(".") for p in plat.split(".")}


def _runs_here(file: dict[str, Any], python: str) -> bool:
    """Whether ``file``'s Requires-Python admits ``python``; an unparsable one is kept, as pip keeps it."""
    requires = file.get("requires-python")
    if not requires:
        return True
    try:
        return SpecifierSet(requires).contains(python)
    except InvalidSpecifier:
        return True


def _release(filename: str) -> Version | None:
    """The release a wheel or source archive belongs to, from its name; None where the name does not say."""
    try:
        if filename.endswith(".whl"):
            return parse_wheel_filename(filename)[1]
        archive = next(ext for ext in SOURCE_ARCHIVES if filename.endswith(ext))
        return Version(filename[: -len(archive)].rpartition("-")[2])
    except (InvalidWheelFilename, InvalidVersion, StopIteration):
        return None


def _installable(filename: str, tags: frozenset[str]) -> bool:
    """A wheel built for one of ``tags``, or a source archive."""
    return bool(wheel_tags(filename) & tags) if filename.endswith(".whl") else filename.endswith(SOURCE_ARCHIVES)


def compatible(page: dict[str, Any], here: Interpreter) -> dict[str, Any]:
    """``page`` less the files pip would pass over on ``here`` (the module's docstring says which)."""
    files = page.get("files") or []
    files = [f for f in files if _runs_here(f, here.version) and _installable(f["filename"], here.tags)]
    wheels: dict[Version, bool] = {}  # release -> whether one of its wheels here is not yanked
    for f in files:
        if f["filename"].endswith(".whl") and (release := _release(f["filename"])) is not None:
            wheels[release] = wheels.get(release, False) or not f.get("yanked")
    kept = [
        f
        for f in files
        if f["filename"].endswith(".whl")
        or (release := _release(f["filename"])) not in wheels
        or not (wheels[release] or f.get("yanked"))
    ]
    return {**page, "files": kept}


class _Pages:
    def __init__(self, here: Interpreter) -> None:
        self.here = here
        self.cache: dict[str, tuple[int, bytes]] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.guard = threading.Lock()

    def get(self, project: str) -> tuple[int, bytes]:
        with self.guard:
            lock = self.locks.setdefault(project, threading.Lock())
        with lock:  # one fetch per project, whichever resolution asks first
            if project not in self.cache:
                self.cache[project] = self._fetch(project)
            return self.cache[project]

    def _fetch(self, project: str) -> tuple[int, bytes]:
        request = urllib.request.Request(f"{PYPI}/{project}/", headers={"Accept": JSON_PAGE})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                page = json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, b""
        return 200, json.dumps(compatible(page, self.here)).encode()


@contextmanager
def compatible_index(python: str) -> Iterator[str]:
    """Serve the filtered index for ``python`` on loopback; yields the ``--index-url``."""
    pages = _Pages(interpreter(python))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server calls it by this name
            parts = [p for p in self.path.split("?")[0].split("/") if p]
            status, body = pages.get(parts[1]) if len(parts) == 2 and parts[0] == "simple" else (404, b"")
            self.send_response(status)
            self.send_header("Content-Type", JSON_PAGE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()
