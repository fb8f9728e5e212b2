"""A live progress bar for local runs: step, loss, val loss, tokens/s and ETA under the log lines.

Only on a terminal (``LLMCTL_PROGRESS=0`` turns it off): pipes, CI logs and ``output.log`` get the
workload's plain lines unchanged. The bar is fed from those same lines (``step 5/160 | loss ... |
12,345 tok/s | ...``), so it shows exactly what the workload reported, from any number of ranks.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional, TextIO

STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+) \| loss ([0-9.]+|nan|inf).*?\| ([0-9,]+) tok/s")
VAL_LINE = re.compile(r"^val step (\d+) \| val/loss ([0-9.]+|nan|inf)")


def wanted(out: TextIO) -> bool:
    """A bar only for a person watching a terminal."""
    if os.environ.get("LLMCTL_PROGRESS", "").lower() in ("0", "false", "no", "off"):
        return False
    isatty = getattr(out, "isatty", None)
    return bool(isatty and isatty())


class StepProgress:
    """Prints each line above a one-line bar that tracks the newest step report."""

    def __init__(self, out: TextIO, *, force_terminal: Optional[bool] = None, width: Optional[int] = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = Console(file=out, force_terminal=force_terminal, width=width, highlight=False)
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self.task: Optional[Any] = None
        self.loss = self.val = self.tok_s = ""

    def __enter__(self) -> "StepProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def feed(self, line: str) -> None:
        """Show the line, then update the bar from it if it is a step or val report."""
        self.console.out(line.rstrip("\n"), highlight=False)
        text = line.strip()
        step = STEP_LINE.match(text)
        if step:
            done, total = int(step.group(1)), int(step.group(2))
            self.loss, self.tok_s = step.group(3), step.group(4)
            if self.task is None:
                self.task = self.progress.add_task("train", total=total, completed=0, stats="")
            self.progress.update(self.task, total=total, completed=done, stats=self.stats())
            return
        val = VAL_LINE.match(text)
        if val and self.task is not None:
            self.val = val.group(2)
            self.progress.update(self.task, stats=self.stats())

    def stats(self) -> str:
        parts = [f"loss {self.loss}"]
        if self.val:
            parts.append(f"val {self.val}")
        parts.append(f"{self.tok_s} tok/s")
        return " | ".join(parts)
