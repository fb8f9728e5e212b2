"""The cache lock under slow, stalled and racing builders, in real processes (``cache.build_once``),
and one download per node of a remote ``model.init_from``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A builder process: ``build_once(final, build, stall_s)`` whose build writes who built it into the
# entry, calls progress() every 0.1 s while ``<final>.<who>-busy`` exists (a slow build that
# advances), then waits without progress until ``<final>.<who>-go`` exists (a hung build). It
# touches ``-ready`` before asking for the lock and ``-started`` once it builds.
BUILDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from workloads.pretrain.data.cache import build_once

    final, who, stall_s = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    busy, go = Path(f"{final}.{who}-busy"), Path(f"{final}.{who}-go")

    def build(tmp, progress):
        (tmp / "who").write_text(who)
        Path(f"{final}.{who}-started").touch()
        while busy.exists():
            progress()
            time.sleep(0.1)
        while not go.exists():
            time.sleep(0.1)

    Path(f"{final}.{who}-ready").touch()
    print(build_once(final, build, stall_s=stall_s), flush=True)
""")


def _builder(final: Path, who: str, stall_s: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", BUILDER, str(final), who, str(stall_s)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out.strip()


def test_a_waiter_waits_as_long_as_the_build_advances(tmp_path: Path) -> None:
    """The builder runs for far longer than the waiter's stall limit (3 s) but reports progress
    all along: the waiter neither gives up nor builds, and loads the builder's entry. (The limit is
    ten heartbeats: a loaded CI machine that delays one builder wake-up must not read as a stall.)"""
    final = tmp_path / "entry"
    busy = Path(f"{final}.a-busy")
    busy.touch()
    Path(f"{final}.a-go").touch()
    a = _builder(final, "a", stall_s=3.0)
    _wait_for(Path(f"{final}.a-started"), a)
    w = _builder(final, "w", stall_s=3.0)
    _wait_for(Path(f"{final}.w-ready"), w)
    deadline = time.monotonic() + 9.0  # three stall limits of progress
    while time.monotonic() < deadline:
        assert w.poll() is None, w.communicate()  # still waiting
        time.sleep(0.2)
    assert not Path(f"{final}.w-started").exists()
    busy.unlink()
    assert _finish(a) == "True" and _finish(w) == "False"
    assert (final / "who").read_text() == "a"
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".lock" in p.name]


def test_a_stalled_builder_is_taken_over_and_the_late_rename_is_safe(tmp_path: Path) -> None:
    """A builder stops progressing (alive, as on another host or a hung mount); after the stall
    limit a waiter breaks its lock and builds. The stalled one then wakes up and finishes first:
    it must leave the new holder's lock alone, and the second builder, whose rename now finds the
    entry in place, must load that entry and succeed rather than fail."""
    final = tmp_path / "entry"
    a = _builder(final, "a", stall_s=1.0)  # no a-busy: it hangs without progress at once
    _wait_for(Path(f"{final}.a-started"), a)
    holder_a = Path(f"{final}.lock").read_text()
    Path(f"{final}.w-busy").touch()
    w = _builder(final, "w", stall_s=1.0)
    _wait_for(Path(f"{final}.w-started"), w)  # w broke a's lock and is building
    holder_w = Path(f"{final}.lock").read_text()
    assert holder_w != holder_a and holder_w.split()[1] == str(w.pid)

    Path(f"{final}.a-go").touch()  # the stalled builder wakes up and renames first
    assert _finish(a) == "True"
    assert Path(f"{final}.lock").read_text() == holder_w  # a released only its own lock
    Path(f"{final}.w-busy").unlink()
    Path(f"{final}.w-go").touch()
    assert _finish(w) == "False"  # its copy discarded, a's entry loaded: no failure on rename
    assert (final / "who").read_text() == "a"
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".lock" in p.name]


def test_a_dead_builder_on_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    """A builder killed mid-build leaves its lock; a waiter with a stall limit of an hour sees its
    pid gone and builds."""
    final = tmp_path / "entry"
    a = _builder(final, "a", stall_s=3600.0)
    _wait_for(Path(f"{final}.a-started"), a)
    a.kill()
    a.communicate()
    Path(f"{final}.w-go").touch()
    w = _builder(final, "w", stall_s=3600.0)
    assert _finish(w) == "True"
    assert (final / "who").read_text() == "w"


def test_a_remote_init_from_is_downloaded_once_per_node(s3_bucket, tmp_path: Path) -> None:
    """Four processes of a node ask for the same s3:// checkpoint at once: the S3 endpoint serves
    each file once, and every process gets the same complete local copy."""
    import s3fs
    from moto.moto_api import recorder

    url, env = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    files = {"config.json": b'{"hidden_size": 8}', "model.safetensors": bytes(range(256)) * 4096}
    for name, data in files.items():
        fs.pipe(f"{url}/ckpt/{name}", data)
    script = textwrap.dedent(f"""
        from pathlib import Path
        from workloads.pretrain.checkpoint.hf_load import local_dir
        print(local_dir({url + "/ckpt"!r}, Path({str(tmp_path / "cache")!r})))
    """)
    record = tmp_path / "requests.jsonl"
    record.touch()
    old = recorder._location
    recorder._location = str(record)
    recorder.start_recording()
    try:
        procs = [
            subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env_with(env), stdout=subprocess.PIPE)
            for _ in range(4)
        ]
        outs = [p.communicate(timeout=300)[0].decode().strip() for p in procs]
    finally:
        recorder.stop_recording()
        recorder._location = old
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1
    local = Path(outs[0])
    for name, data in files.items():
        assert (local / name).read_bytes() == data
    gets = [r["url"] for r in map(json.loads, record.read_text().splitlines()) if r["method"] == "GET"]
    for name in files:
        assert sum(u.split("?")[0].endswith(f"/ckpt/{name}") for u in gets) == 1, gets
    assert sorted(p.name for p in local.parent.iterdir()) == [local.name]  # no temp dir or lock left


def env_with(extra: dict) -> dict:
    import os

    return {**os.environ, **extra}
