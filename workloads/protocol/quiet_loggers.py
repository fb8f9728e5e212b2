"""Libraries' start-up noise held below a level while they load: every process of a run (the controller
and each rank) would otherwise print it, and a user reads it as a fault. Stdlib only."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterable, Iterator


@contextmanager
def quiet_loggers(names: Iterable[str], level: int = logging.WARNING) -> Iterator[None]:
    """The loggers ``names`` say only ``level`` and above inside the block, then what they said before
    (a real error from the same library still shows)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, before in zip(loggers, levels):
            lg.setLevel(before)
