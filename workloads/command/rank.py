"""One torchrun worker of a command workload: runs the user's script (or ``-m`` module) in this
process, as ``python`` would, and records its exit code where the node's guard reads it.

torchrun reports any failed worker as its own exit 1, which would hide the contract's 75
("stopped with state saved"); the guard reads each rank's own code from ``$LLMCTL_EXIT_DIR``.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from workloads.command.contract import ENV_EXIT_DIR


def _record(code: int) -> None:
    folder = os.environ.get(ENV_EXIT_DIR)
    if folder:
        Path(folder, f"rank-{os.environ.get('RANK', '0')}").write_text(str(code))


def _code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def main(argv: list[str]) -> None:
    code = 1
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _code(exc)
        raise
    finally:
        _record(code)


if __name__ == "__main__":
    main(sys.argv[1:])
