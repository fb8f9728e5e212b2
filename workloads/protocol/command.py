"""A command workload as llmctl and the node-side guard both read it (stdlib only).

``workload.run`` is the program and its fixed arguments, split as a shell splits words (no shell
runs it); ``workload.args.<name>=<value>`` are appended as ``--<name> <value>``, so sweeps and
searches vary a user's own flags. A leading ``python``/``python3`` means the Python llmctl runs in
(``sys.executable``): the program sees llmctl's environment, whatever ``PATH`` holds.

The environment a program gets, beside its own ``workload.env``:

    MLFLOW_TRACKING_URI, MLFLOW_RUN_ID   llmctl's run: log into it (one run per job)
    LLMCTL_CHECKPOINT_DIR   where to save and find state (``checkpoint.dir``; any fsspec URL)
    LLMCTL_ATTEMPT          1, 2, ...: llmctl's attempt number (a resume is a new attempt)
    LLMCTL_RESUME           "1" when this start continues the run (attempt > 1), else "0"
    LLMCTL_STOP_GRACE_S     seconds a stop (SIGTERM) leaves to save before the hard kill
    LLMCTL_RUN_DIR          the run's local folder (output.log, the resolved config.yaml)

Exit codes it answers with: 0 done, 75 stopped with state saved (after SIGTERM: a preemption,
``llmctl down``, the budget guard), anything else a failure.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional

ENV_CHECKPOINT_DIR = "LLMCTL_CHECKPOINT_DIR"
ENV_RESUME = "LLMCTL_RESUME"
ENV_STOP_GRACE = "LLMCTL_STOP_GRACE_S"
ENV_EXIT_DIR = "LLMCTL_EXIT_DIR"  # where each torchrun rank records its exit code (``rank``)
PYTHONS = ("python", "python3")
KIND_COMMAND = "command"
KIND_PRETRAIN = "pretrain"


class BadWorkload(ValueError):
    """A command workload that cannot run: ``key`` names the config key, ``message`` says why and the fix."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def is_command(cfg: Mapping[str, Any]) -> bool:
    """Whether a resolved config runs a user's program (``workload=command``)."""
    return (cfg.get("workload") or {}).get("kind", KIND_PRETRAIN) == KIND_COMMAND


def flag_value(value: Any) -> str:
    """``workload.args`` values as a command line writes them: booleans lower-case, lists comma-joined."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(flag_value(v) for v in value)
    return str(value)


def program(workload: Mapping[str, Any]) -> list[str]:
    """``workload.run`` split into words, then ``--name value`` per ``workload.args`` (in key order)."""
    words = shlex.split(str(workload.get("run") or ""))
    for name, value in sorted((workload.get("args") or {}).items()):
        if value is None:
            continue
        words += [f"--{name}", flag_value(value)]
    return words


def python_target(words: list[str]) -> Optional[list[str]]:
    """The part torchrun takes (``train.py ...`` or ``-m pkg.mod ...``) when ``words`` run Python
    (``python train.py``, ``python -m pkg``, or a ``.py`` file itself); None otherwise."""
    if not words:
        return None
    if words[0] in PYTHONS or os.path.basename(words[0]).startswith("python"):
        rest = words[1:]
        if rest and (rest[0] == "-m" and len(rest) > 1 or rest[0].endswith(".py")):
            return rest
        return None
    return words if words[0].endswith(".py") else None


def check(workload: Mapping[str, Any], cwd: Path) -> None:
    """Refuse (``BadWorkload``) a command workload that cannot start: no program, a program that is
    not there, an argument given twice, torchrun for something that is not Python."""
    run = str(workload.get("run") or "").strip()
    if not run:
        raise BadWorkload(
            "workload.run", "workload=command needs the program to run. Fix: workload.run='python train.py'"
        )
    try:
        words = shlex.split(run)
    except ValueError as exc:
        raise BadWorkload("workload.run", f"cannot split {run!r} into words ({exc}). Fix: balance its quotes") from None
    own = {w[2:].split("=", 1)[0] for w in words[1:] if w.startswith("--")}
    for name in sorted(workload.get("args") or {}):
        if name in own:
            raise BadWorkload(
                f"workload.args.{name}",
                f"--{name} is already in workload.run ({run!r}), and would be passed twice."
                f" Fix: remove it from workload.run, or drop workload.args.{name}",
            )
    target = python_target(words)
    if workload.get("torchrun") and target is None:
        raise BadWorkload(
            "workload.torchrun",
            f"torchrun starts Python programs, but workload.run={run!r} is not one (python script.py,"
            " python -m module, or a .py file). Fix: workload.torchrun=false, or run a Python script",
        )
    script = None
    if target is not None and target[0] != "-m":
        script = target[0]
    if script is not None:
        if not (cwd / script).is_file():
            raise BadWorkload(
                "workload.run",
                f"{script} does not exist in {cwd} (programs run from the launch directory)."
                " Fix: launch from the directory that holds it, or give its path",
            )
    elif target is None and words[0] not in PYTHONS and not _found(words[0], cwd):
        raise BadWorkload(
            "workload.run", f"no program {words[0]!r} on PATH or in {cwd}. Fix: install it, or give its path"
        )


def _found(program_name: str, cwd: Path) -> bool:
    """Whether ``program_name`` is a file in ``cwd`` (or a path) or a command on ``PATH``."""
    return (cwd / program_name).is_file() or shutil.which(program_name) is not None
