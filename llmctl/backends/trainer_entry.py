"""One of the trainer's single-process entry points (``python -m workloads.pretrain.<entry>``) run
on this machine with a resolved config: ``plan --dry-run`` and ``data prepare``. A process of its
own, because llmctl imports only the workloads' stdlib protocol and planner, never the trainer's torch modules."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from typing import Any

from llmctl.config.compose import to_yaml
from llmctl.errors import LaunchError


def run_trainer_entry(entry: str, cfg: dict[str, Any], *args: str, capture: bool = True) -> str:
    """Run ``workloads.pretrain.<entry> --config <cfg as YAML> *args``; its stdout (empty when not
    captured: then it prints straight to the user). A non-zero exit raises ``LaunchError`` carrying
    the entry's last error line and its exit code."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as resolved:
        resolved.write(to_yaml(cfg))
        resolved.flush()
        cmd = [sys.executable, "-m", f"workloads.pretrain.{entry}", "--config", resolved.name, *args]
        proc = subprocess.run(cmd, text=True, capture_output=capture)
    if proc.returncode:
        last = (proc.stderr or "").strip().splitlines()[-1:] if capture else []
        raise LaunchError(
            f"workloads.pretrain.{entry} exited with code {proc.returncode}" + (f": {last[0]}" if last else "")
        )
    return proc.stdout or ""
