"""Several hosts on this machine, for real: each a network namespace with an address of its own
(``eth0``, on one bridge that lives in a namespace of its own), its loopback up; this machine joins
the bridge too, at ``Host.gateway`` (a tracking server listening there serves every host), and with
no other route: nothing reaches the machine's own network. A process started with ``Host.popen``
sees only that host's addresses: two trainers on two hosts rendezvous over the bridge as two
machines would over a LAN, with no shared 127.0.0.1. The file system stays shared (as a cluster's
shared filesystem is).

Needs root and ``ip`` (iproute2). ``hosts`` tears everything down on exit, whatever happened; the
addresses are 10.213.K.1..N, K from this process's pid, so two test processes never collide.

Each host's processes are told their network interface (``GLOO_SOCKET_IFNAME=eth0``): gloo otherwise
binds to the address the machine's hostname resolves to, which no namespace has (a real cluster's
hosts resolve their own names; these share the machine's).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from typing import Any, Iterator

_names = itertools.count()


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    gateway: str  # this machine's own address on the hosts' bridge: a server there serves every host

    def popen(self, cmd: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen[str]:
        """``cmd`` on this host (inside its network namespace), with its interface named for gloo."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.namespace, *cmd],
            env={**env, "GLOO_SOCKET_IFNAME": "eth0"},
            text=True,
            **kwargs,
        )

    def lose(self) -> None:
        """This host goes away as a lost node does: its link first, then every process on it, so no
        peer ever sees a connection reset (it just stops hearing from it)."""
        _ip("-n", self.namespace, "link", "set", "eth0", "down")
        pids = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True, timeout=30)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def missing() -> str:
    """Why hosts cannot be made here ('' when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip"):
        return "ip (iproute2) is not installed"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    """``count`` hosts on one bridge: 10.213.K.1, 10.213.K.2, ..."""
    tag = f"{os.getpid() % 10000:04d}{next(_names) % 100:02d}"
    subnet = f"10.213.{os.getpid() % 250}"
    switch = f"llmctl-sw{tag}"
    made: list[str] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        # this machine on the bridge too (the end in its namespace goes when the switch's goes)
        _ip("link", "add", f"g{tag}", "type", "veth", "peer", "name", f"q{tag}")
        _ip("link", "set", f"q{tag}", "netns", switch)
        _ip("-n", switch, "link", "set", f"q{tag}", "master", "br0")
        _ip("-n", switch, "link", "set", f"q{tag}", "up")
        _ip("addr", "add", f"{subnet}.254/24", "dev", f"g{tag}")
        _ip("link", "set", f"g{tag}", "up")
        found = []
        for i in range(count):
            name, port, end = f"llmctl-h{i}-{tag}", f"p{i}{tag}", f"e{i}{tag}"
            _ip("netns", "add", name)
            made.append(name)
            _ip("link", "add", port, "type", "veth", "peer", "name", end)
            _ip("link", "set", port, "netns", switch)
            _ip("link", "set", end, "netns", name)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", name, "link", "set", end, "name", "eth0")
            _ip("-n", name, "addr", "add", f"{subnet}.{i + 1}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            found.append(Host(name, f"{subnet}.{i + 1}", f"{subnet}.254"))
        yield found
    finally:
        subprocess.run(["ip", "link", "del", f"g{tag}"], capture_output=True, timeout=30)  # at once, and its peer
        for name in reversed(made):  # a namespace's veth ends go with it
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
