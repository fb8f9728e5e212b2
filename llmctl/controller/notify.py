"""Telling people what happened to a run: one JSON POST per event to each ``notify.url``.

The controller sends them (the process that started the attempt, or a sweep's supervisor), never the
workload. A message never fails or holds a run: each endpoint gets two tries of ``timeout_s`` each,
and one that failed both is reported once, on stderr, and not tried again by this controller: a dead
endpoint costs a run one ``2 x timeout_s`` at most. The payload is Slack's incoming-webhook shape
(``text``; Mattermost, Rocket.Chat and most chat webhooks read the same) plus an ``llmctl`` object for
programs: the event, the run's id and page, the spend so far. It carries no config value.

Stdlib only (``urllib``): the CLI's start-up stays light, and there is nothing to install.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

Say = Callable[..., None]
RETRY_PAUSE_S = 0.5


@dataclass
class Notifier:
    """The endpoints (``(url, name)``: the name is what messages about it show) and the events to
    send; ``dead`` holds the names of endpoints that failed, not tried again."""

    endpoints: list[tuple[str, str]]
    on: frozenset[str]
    say: Say  # where a dead endpoint is reported: the controller's own output
    timeout_s: float = 3.0
    dead: set[str] = field(default_factory=set)

    def wants(self, event: str) -> bool:
        return bool(self.endpoints) and event in self.on

    def send(self, event: str, text: str, **facts: Any) -> None:
        """``text`` (the lines a person reads) and ``facts`` (run_id, url, spend_usd, ...) to every
        live endpoint, if ``event`` is one to send."""
        if not self.wants(event):
            return
        body = json.dumps({"text": text, "llmctl": {"event": event, **facts}}, default=str).encode()
        for url, name in self.endpoints:
            if name in self.dead:
                continue
            error = _post(url, body, self.timeout_s)
            if error is not None:
                self.dead.add(name)
                self.say(
                    f"llmctl: notification to {name} failed ({error}); no more notifications to it from this"
                    " controller (the run goes on)",
                    err=True,
                )


def from_config(cfg: dict[str, Any], say: Say) -> Notifier:
    """The notifier ``cfg``'s ``notify`` section asks for (no endpoints: one that sends nothing). A URL
    that was written out is stored as its host only, so a resumed run cannot send to it: said once."""
    from llmctl.config import notify as settings

    section = cfg.get("notify") or {}
    unstored = [u for u in settings.urls(cfg) if settings.is_masked(u)]
    if unstored:
        say(
            f"llmctl: not notifying {', '.join(unstored)}: a URL written out is stored as its host only."
            " Fix: pass notify.url again, or the name of a variable that holds it",
            err=True,
        )
    return Notifier(
        endpoints=settings.endpoints(cfg),
        on=frozenset(str(e) for e in section.get("on") or []),
        timeout_s=float(section.get("timeout_s", 3.0)),
        say=say,
    )


def _post(url: str, body: bytes, timeout_s: float) -> Optional[str]:
    """POST ``body`` twice at most; None when the endpoint answered 2xx, else what went wrong."""
    error = ""
    for attempt in range(2):
        if attempt:
            time.sleep(RETRY_PAUSE_S)
        request = urllib.request.Request(
            url, data=body, method="POST", headers={"Content-Type": "application/json", "User-Agent": "llmctl"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                if 200 <= response.status < 300:
                    return None
                error = f"HTTP {response.status}"
        except Exception as exc:  # refused, timed out, HTTP 4xx/5xx (HTTPError), bad TLS: all the same here
            error = _describe(exc, timeout_s)
    return error


def _describe(exc: BaseException, timeout_s: float) -> str:
    reason = getattr(exc, "reason", None)
    if isinstance(exc, TimeoutError) or isinstance(reason, TimeoutError):
        return f"no answer within {timeout_s:g} s, twice"
    code = getattr(exc, "code", None)
    if code is not None:
        return f"HTTP {code}"
    return f"{type(reason or exc).__name__}: {reason or exc}"
