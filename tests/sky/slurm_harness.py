"""A real Slurm cluster on localhost for SkyPilot: munge, slurmctld, slurmd and a login sshd.

Everything lives in one temp dir; a dedicated Unix user owns the cluster side; daemons are stopped
by pid. The offline bootstrap help SkyPilot's node runtime needs is given here, and only here:
``uv`` from its PyPI wheel (a ``curl`` shim answers SkyPilot's ``curl .../uv/install.sh | sh``),
pyenv's Python 3.10 as ``python3.10`` on the login PATH, and uv trusting the system CA store.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

USER = "llmctlslurm"
CLUSTER = "localslurm"
PARTITION = "debug"
# a second partition over the same node: a second "provider" for infra.candidates (tests/sky/test_slurm_launch.py)
FIRST_CHOICE = "first"
PY310 = Path("/root/.pyenv/versions/3.10.13/bin/python3.10")
NEEDED = ("slurmctld", "slurmd", "munged", "sshd", "rsync", "ssh-keygen", "useradd")


def missing_prerequisites() -> list[str]:
    """What keeps the harness from running here (empty when it can run)."""
    missing = [] if os.geteuid() == 0 else ["root"]
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing += [t for t in NEEDED if not shutil.which(t, path=path)]
    if not PY310.exists():
        missing.append(str(PY310))
    return missing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, ok: "callable[[], bool]", timeout: float) -> None:  # type: ignore[valid-type]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.3)
    raise RuntimeError(f"slurm harness: {what} not ready after {timeout:.0f} s")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Cluster:
    root: Path
    home: Path  # the cluster user's home
    ssh_port: int
    slurm_conf: Path
    env: dict[str, str]  # SLURM_CONF etc. for Slurm commands run by the harness
    pidfiles: list[Path] = field(default_factory=list)

    def write_client_config(self, controller_home: Path, key: Path) -> None:
        """``~/.slurm/config`` for SkyPilot on the controller side: how to reach the login node."""
        (controller_home / ".slurm").mkdir(parents=True, exist_ok=True)
        (controller_home / ".slurm" / "config").write_text(
            f"Host {CLUSTER}\n  HostName 127.0.0.1\n  Port {self.ssh_port}\n  User {USER}\n"
            f"  IdentityFile {key}\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
        )

    def squeue(self) -> str:
        return subprocess.run(
            ["squeue", "-h", "-o", "%i %j %T"], env=self.env, capture_output=True, text=True, timeout=30
        ).stdout


def _uv_binary(cache: Path) -> Path:
    """The uv executable from its PyPI wheel (pip download: the only registry access)."""
    target = cache / "uv"
    if target.exists():
        return target
    wheels = cache / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels), "uv"],
        check=True,
        timeout=300,
    )
    wheel = next(wheels.glob("uv-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith("/scripts/uv"))
        target.write_bytes(zf.read(member))
    target.chmod(0o755)
    return target


def _ensure_user(home: Path) -> None:
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "-M", "-d", str(home), "-s", "/bin/bash", USER], check=True)
    subprocess.run(["usermod", "-d", str(home), "-p", "*", USER], check=True)  # unlocked, no password
    home.mkdir(parents=True, exist_ok=True)
    shutil.chown(home, USER, USER)


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@contextmanager
def slurm_cluster(cache: Path) -> Iterator[Cluster]:
    """Bring the cluster up; always stop every daemon it started and remove the temp dir."""
    root = Path(tempfile.mkdtemp(prefix="llmctl-slurm-"))
    root.chmod(0o755)
    procs: list[subprocess.Popen[bytes]] = []
    host = socket.gethostname().split(".")[0]
    # the cluster user runs the checkout's venv python and pyenv's interpreters: it must be able to
    # pass through their directories, even when the clone sits in a private (0700) directory
    opened = _grant_search(
        [
            Path(sys.executable).parent,
            Path(sys.executable).resolve().parent,
            Path(__file__).resolve().parents[2],
            PY310.parent,
        ]
    )
    try:
        home = root / "home"
        _ensure_user(home)
        for d in ("munge", "state", "spool", "log", "run", "bin", "ssh"):
            (root / d).mkdir()
        uv = _uv_binary(cache)
        shutil.copy(uv, root / "bin" / "uv")
        (root / "bin" / "python3.10").symlink_to(PY310)
        # the cluster's python3 is this suite's interpreter, as a login node's is the one its users run:
        # nodes that make their own venv from it (no infra.node_python) then run the Python the
        # controller runs (the builtin pydoc corpus, and so its tokenizer, differs between Python releases)
        (root / "bin" / "python3").symlink_to(Path(sys._base_executable).resolve())  # type: ignore[attr-defined]
        # SkyPilot runs `curl -LsSf https://astral.sh/uv/install.sh | UV_INSTALL_DIR=... sh` when uv is absent
        (root / "bin" / "curl").write_text(
            "#!/bin/sh\n# test shim: answers the uv installer request offline\n"
            f'echo \'mkdir -p "$UV_INSTALL_DIR" && cp {root}/bin/uv "$UV_INSTALL_DIR/uv"\'\n'
        )
        (root / "bin" / "curl").chmod(0o755)
        os.chmod(root / "bin", 0o755)

        # munge
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = root / "munge" / "munge.socket"
        subprocess.run(
            [
                "munged",
                "--force",
                f"--key-file={key}",
                f"--socket={socket_path}",
                f"--pid-file={root / 'run' / 'munged.pid'}",
                f"--log-file={root / 'log' / 'munged.log'}",
                f"--seed-file={root / 'munge' / 'seed'}",
            ],
            check=True,
            timeout=30,
        )
        procs_pidfiles = [root / "run" / "munged.pid"]
        os.chmod(root / "munge", 0o755)

        # slurm
        conf = root / "slurm.conf"
        conf.write_text(f"""ClusterName=llmctltest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "run" / "slurmctld.pid"}
SlurmdPidFile={root / "run" / "slurmd.pid"}
SlurmctldLogFile={root / "log" / "slurmctld.log"}
SlurmdLogFile={root / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=8000
PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=60 DefaultTime=30 State=UP
PartitionName={FIRST_CHOICE} Nodes={host} MaxTime=60 DefaultTime=30 State=UP
""")
        env = {**os.environ, "SLURM_CONF": str(conf)}
        subprocess.run(["slurmctld", "-i"], env=env, check=True, timeout=30)
        subprocess.run(["slurmd"], env=env, check=True, timeout=30)
        procs_pidfiles += [root / "run" / "slurmctld.pid", root / "run" / "slurmd.pid"]

        # login node: sshd for the cluster user, key auth, environment for SkyPilot's bootstrap
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "ssh" / "host_key")], check=True
        )
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "ssh" / "user_key")], check=True
        )
        auth = root / "ssh" / "authorized_keys"
        shutil.copy(root / "ssh" / "user_key.pub", auth)
        auth.chmod(0o644)
        os.chmod(root / "ssh", 0o755)
        port = free_port()
        path = f"{root / 'bin'}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
        (root / "sshd_config").write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {root / "ssh" / "host_key"}
PidFile {root / "run" / "sshd.pid"}
AuthorizedKeysFile {auth}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
AllowUsers {USER}
MaxSessions 50
MaxStartups 50:30:100
SetEnv SLURM_CONF={conf} PATH={path} UV_SYSTEM_CERTS=1 UV_NATIVE_TLS=1 \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt SKYPILOT_DISABLE_USAGE_COLLECTION=1 DO_NOT_TRACK=1
Subsystem sftp /usr/lib/openssh/sftp-server
""")
        # SkyPilot runs `bash --login -c ...` on the login node: /etc/profile resets PATH, then the
        # user's ~/.bash_profile runs; srun hands that environment on to the job steps
        profile = home / ".bash_profile"
        profile.write_text(
            f"export PATH={path}\nexport SLURM_CONF={conf}\nexport UV_SYSTEM_CERTS=1 UV_NATIVE_TLS=1"
            " SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt\n"
            "export SKYPILOT_DISABLE_USAGE_COLLECTION=1 DO_NOT_TRACK=1\n"
        )
        shutil.chown(profile, USER, USER)
        Path("/run/sshd").mkdir(exist_ok=True)
        subprocess.run(
            ["/usr/sbin/sshd", "-f", str(root / "sshd_config"), "-E", str(root / "log" / "sshd.log")],
            check=True,
            timeout=30,
        )
        procs_pidfiles.append(root / "run" / "sshd.pid")
        cluster = Cluster(root=root, home=home, ssh_port=port, slurm_conf=conf, env=env, pidfiles=procs_pidfiles)
        _wait("sshd", lambda: _port_open(port), 20)
        _wait(
            "slurm node idle",
            lambda: (
                "idle" in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout
            ),
            60,
        )
        yield cluster
    finally:
        _teardown(root, locals().get("procs_pidfiles", []), procs)
        for directory, mode in reversed(opened):
            os.chmod(directory, mode)


def _grant_search(paths: list[Path]) -> list[tuple[Path, int]]:
    """Add others' search (x) permission, only, to every ancestor directory of ``paths`` that lacks
    it; returns (directory, old mode) to restore. Nothing becomes listable or readable that was not."""
    opened: list[tuple[Path, int]] = []
    for path in paths:
        for directory in [path, *path.parents]:
            if not directory.is_dir():
                continue
            mode = stat.S_IMODE(directory.stat().st_mode)
            if not mode & stat.S_IXOTH and all(d != directory for d, _ in opened):
                os.chmod(directory, mode | stat.S_IXOTH)
                opened.append((directory, mode))
    return opened


def _kill_pidfile(pidfile: Path) -> None:
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _teardown(root: Path, pidfiles: list[Path], procs: list[subprocess.Popen[bytes]]) -> None:
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    if (root / "slurm.conf").exists():
        subprocess.run(["scancel", "-u", USER], env=env, capture_output=True, timeout=30)
    for pidfile in reversed(pidfiles):
        _kill_pidfile(pidfile)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    # what the cluster user still runs was started through this harness (the user is ours alone): by pid
    pids = subprocess.run(["pgrep", "-u", USER], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["userdel", USER], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)
