"""PyPI's simple index as pip on this interpreter can use it: the same pages, less the wheels whose
tags this interpreter does not support, served on loopback for ``pip --index-url``.

Why: resolving one install line of llmctl-train's size makes pip evaluate every file of every release
of ~220 projects, and most of its CPU goes to checking the tags of wheels it then rejects (numpy,
grpcio, pydantic-core: dozens of platform wheels per release). Those are exactly the files this page
leaves out, so pip's candidates, its choices and its report are the ones it makes against PyPI itself;
each page is fetched and filtered once for all the resolutions of a test. Files keep their absolute
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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PYPI = "https://pypi.org/simple"
JSON_PAGE = "application/vnd.pypi.simple.v1+json"


def supported_tags(python: str) -> frozenset[str]:
    """The wheel tags pip accepts for ``python`` (pip's own list, asked of that interpreter)."""
    import subprocess

    code = (
        "from pip._internal.utils.compatibility_tags import get_supported\n"
        "print('\\n'.join(str(t) for t in get_supported()))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    return frozenset(out.split())


def wheel_tags(filename: str) -> set[str]:
    """``name-ver(-build)?-py-abi-plat.whl``: every tag its compressed tag sets expand to."""
    py, abi, plat = filename[: -len(".whl")].split("-")[-3:]
    return {f"{i}-{a}-{p}" for i in py.split(".") for a in abi.split(".") for p in plat.split(".")}


def compatible(page: dict[str, object], tags: frozenset[str]) -> dict[str, object]:
    files = page.get("files") or []
    assert isinstance(files, list)
    kept = [f for f in files if not f["filename"].endswith(".whl") or wheel_tags(f["filename"]) & tags]
    return {**page, "files": kept}


class _Pages:
    def __init__(self, tags: frozenset[str]) -> None:
        self.tags = tags
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
        return 200, json.dumps(compatible(page, self.tags)).encode()


@contextmanager
def compatible_index(python: str) -> Iterator[str]:
    """Serve the filtered index for ``python`` on loopback; yields the ``--index-url``."""
    pages = _Pages(supported_tags(python))

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
