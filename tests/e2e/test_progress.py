"""The live progress bar of local runs: drawn on a terminal (a real pty), never in pipes or logs."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

from llmctl.controller.progress import StepProgress, wanted

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STEP = "step  20/40 | loss 6.9214 | lr 2.93e-03 | gnorm 0.71 | 17,265 tok/s | 0.04 TFLOP/s | MFU n/a (cpu)\n"


def test_bar_tracks_step_and_val_reports() -> None:
    buf = io.StringIO()
    with StepProgress(buf, force_terminal=True, width=160) as bar:
        bar.feed("pretrain | model tiny\n")
        assert bar.task is None, "no bar before the first step report"
        bar.feed(STEP)
        bar.feed("val step 20 | val/loss 7.0036\n")
        task = bar.progress.tasks[0]
        assert (task.completed, task.total) == (20, 40)
        assert task.fields["stats"] == "loss 6.9214 | val 7.0036 | 17,265 tok/s"
        bar.progress.refresh()
    text = ANSI.sub("", buf.getvalue())
    assert "pretrain | model tiny" in text and "val step 20" in text, "every line is still printed"
    assert "20/40" in text and "loss 6.9214 | val 7.0036 | 17,265 tok/s" in text


def test_only_on_a_terminal(monkeypatch) -> None:
    assert not wanted(io.StringIO())
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert wanted(tty)
            monkeypatch.setenv("LLMCTL_PROGRESS", "0")
            assert not wanted(tty)
    finally:
        os.close(master)
        os.close(slave)


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the pty
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def test_launch_on_a_tty_draws_the_bar_and_keeps_the_log_plain(tmp_path: Path, cli_env: dict[str, str]) -> None:
    master, slave = pty.openpty()
    env = {**cli_env, "COLUMNS": "160", "TERM": "xterm"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmctl", "launch", "experiment=smoke", "train.steps=20", "checkpoint.every=0"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    try:
        screen = _read_all(master)
        assert proc.wait(timeout=300) == 0, screen[-3000:]
    finally:
        os.close(master)
    plain = ANSI.sub("", screen)
    assert re.search(r"train .*20/20 .*loss [0-9.]+ .*tok/s", plain), plain[-3000:]
    (log,) = tmp_path.glob("llmctl-runs/*/output.log")
    text = log.read_text()
    assert re.search(r"^step +20/20 \| loss", text, re.M) and "\x1b[" not in text, "output.log stays plain"
