"""The notifier on its own: an endpoint that never answers costs two tries once and is reported once;
one that answers 500 is retried, then reported; what llmctl records of a written-out URL is its host."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest

from llmctl.config.notify import masked, masked_overrides
from llmctl.controller.notify import Notifier


@pytest.fixture()
def silent_endpoint() -> Iterator[str]:
    """A socket that listens and never accepts: the connection is made, no answer ever comes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}/hook"


@pytest.fixture()
def failing_endpoint() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Answers every POST with HTTP 500, keeping what it was sent."""
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", bodies
    server.shutdown()


def _notifier(url: str, said: list[str], timeout_s: float = 0.2) -> Notifier:
    return Notifier(
        endpoints=[(url, "the team's hook")],
        on=frozenset({"finished", "failed"}),
        timeout_s=timeout_s,
        say=lambda text, err=False: said.append(text),
    )


def test_an_endpoint_that_never_answers_is_given_up_once(silent_endpoint: str) -> None:
    said: list[str] = []
    notifier = _notifier(silent_endpoint, said)
    notifier.send("finished", "llmctl: run r FINISHED", run_id="r")
    notifier.send("failed", "llmctl: run s FAILED", run_id="s")  # not tried again
    assert said == [
        "llmctl: notification to the team's hook failed (no answer within 0.2 s, twice); no more notifications"
        " to it from this controller (the run goes on)"
    ]


def test_an_endpoint_that_answers_500_gets_two_tries_then_is_reported(
    failing_endpoint: tuple[str, list[dict[str, Any]]],
) -> None:
    url, bodies = failing_endpoint
    said: list[str] = []
    notifier = _notifier(url, said)
    notifier.send("started", "not asked for", run_id="r")  # not in ``on``: nothing sent
    notifier.send("failed", "llmctl: run r FAILED", run_id="r")
    assert [b["llmctl"] for b in bodies] == [{"event": "failed", "run_id": "r"}] * 2
    assert bodies[0]["text"] == "llmctl: run r FAILED"
    assert len(said) == 1 and "(HTTP 500)" in said[0]


def test_what_is_recorded_of_a_written_out_url_is_its_host() -> None:
    cfg = {"notify": {"url": ["https://hooks.slack.com/services/T0/B0/sekret", "TEAM_HOOK"], "on": ["failed"]}}
    assert masked(cfg)["notify"]["url"] == ["https://hooks.slack.com/…", "TEAM_HOOK"]
    assert masked({"notify": {"url": "http://10.0.0.1:8080/x?token=y"}})["notify"]["url"] == ["http://10.0.0.1:8080/…"]
    assert masked_overrides(["train.lr=0.1", "notify.url=[https://h.example/a/b,https://g.example/c]"]) == [
        "train.lr=0.1",
        "notify.url=[https://h.example/…,https://g.example/…]",
    ]
