"""``notify.*``: which endpoints hear about a run, for which events, checked before anything exists.

A webhook URL is a credential (Slack's carries its token in the path), so ``notify.url`` takes the
name of an environment variable holding the URL, read when the controller starts, as
``workload.secrets`` does for a program's keys; a URL written out is accepted too, and everything
llmctl records (params, ``config.yaml``, a sweep's overrides) shows it as its scheme and host only
(``masked``). Sending is the controller's (``llmctl.controller.notify``).
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import urlsplit

from llmctl.errors import ConfigError

# Every event a run or sweep can announce; ``on`` picks among them. A run's events are its attempt's
# start, a managed job's recovery by SkyPilot, and how it ended (``llmctl.run.outcomes.Outcome``'s
# values); a sweep's trials announce nothing
# one by one, the sweep its end.
EVENTS = (
    "started",
    "recovered",
    "finished",
    "failed",
    "budget_stop",
    "preempted",
    "interrupted",
    "killed",
    "sweep_end",
)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MASK = "/…"  # what stands for a written-out URL's path and query in whatever llmctl records
EXAMPLE = "notify.url=[SLACK_WEBHOOK_URL] (a variable holding the URL) or notify.url=[https://host/path]"


def _is_url(value: str) -> bool:
    parts = urlsplit(value)
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def urls(cfg: dict[str, Any]) -> list[str]:
    """``notify.url``'s items. Composition keeps it a list (a bare item is refused with the fix); a
    config dict written by hand may hold one URL bare, read as a list of one."""
    value = (cfg.get("notify") or {}).get("url") or []
    return [str(v) for v in ([value] if isinstance(value, str) else value)]


def validate(cfg: dict[str, Any], environ: Any = os.environ) -> None:
    """``notify.url`` items are http(s) URLs or set variables holding one; ``notify.on`` names known
    events; ``notify.timeout_s`` > 0. A ``ConfigError`` naming the key and the fix otherwise."""
    section = cfg.get("notify") or {}
    for item in urls(cfg):
        if _is_url(item):
            continue
        if not ENV_NAME.match(item):
            raise ConfigError(
                f"Bad value for 'notify.url': {item!r} is neither an http(s) URL nor a variable name. Fix: {EXAMPLE}"
            )
        value = environ.get(item, "")
        if not value:
            raise ConfigError(
                f"Bad value for 'notify.url': {item} is not set in this environment."
                f" Fix: export {item}=https://... in the shell llmctl runs from"
            )
        if not _is_url(value):
            raise ConfigError(
                f"Bad value for 'notify.url': ${item} holds no http(s) URL. Fix: export {item}=https://..."
            )
    unknown = [str(e) for e in section.get("on") or [] if str(e) not in EVENTS]
    if unknown:
        raise ConfigError(f"Bad value for 'notify.on': {', '.join(unknown)}. Fix: choose from {', '.join(EVENTS)}")
    timeout = section.get("timeout_s", 3.0)
    if not float(timeout) > 0:
        raise ConfigError(
            f"Bad value for 'notify.timeout_s': {timeout} (seconds per try, > 0). Fix: notify.timeout_s=3"
        )


def endpoints(cfg: dict[str, Any], environ: Any = os.environ) -> list[tuple[str, str]]:
    """``(URL, how to name it in a message)`` per ``notify.url`` item: a variable is read now and named
    by its name; a URL written out is named by its scheme and host."""
    out = []
    for item in urls(cfg):
        if is_masked(item):  # stored as its host only: nothing to send to (``from_config`` says so)
            continue
        if _is_url(item):
            out.append((item, mask_url(item)))
        elif environ.get(item):
            out.append((environ[item], f"${item}"))
    return out


def is_masked(value: str) -> bool:
    """A URL ``mask_url`` made: what a stored config holds where a URL was written out."""
    return _is_url(value) and value.endswith(MASK)


def mask_url(url: str) -> str:
    """``https://hooks.slack.com/services/T0/B0/secret`` → ``https://hooks.slack.com/…``."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return f"{parts.scheme}://{host}{MASK}"


def masked(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with every URL written out in ``notify.url`` masked: what llmctl records and shows."""
    section = cfg.get("notify")
    if not isinstance(section, dict) or not section.get("url"):
        return cfg
    return {**cfg, "notify": {**section, "url": [mask_url(u) if _is_url(u) else u for u in urls(cfg)]}}


def masked_overrides(overrides: list[str]) -> list[str]:
    """Command-line overrides with the URLs of any ``notify.url=`` masked (a sweep records them)."""
    url = re.compile(r"https?://[^\s,\]'\"]+")
    return [
        url.sub(lambda m: mask_url(m.group(0)), o) if o.lstrip("+~").startswith("notify.") else o for o in overrides
    ]
