"""Wall time of ``llmctl smoke`` (launch → checkpoint → resume → eval) on this machine, torch import included.

Goal: ≤ 60 s on a 2-core CPU. Runs in a temporary directory with a fresh tracking store; the
tokenizer cache is the user's (as in CI after the first run). Last line: ``smoke_e2e: <s> s``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "llmctl", "smoke"], cwd=tmp, capture_output=True, text=True)
        elapsed = time.monotonic() - started
    print(proc.stdout[-2000:])
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        sys.exit(proc.returncode)
    print(f"smoke_e2e: {elapsed:.1f} s")


if __name__ == "__main__":
    main()
