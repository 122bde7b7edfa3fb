"""Simulated hosts for the multi-host tier: network namespaces on this machine, joined by veth.

Each host is a network namespace with its own address (10.77.0.<n>/24) on an ``eth0``, its own
loopback, and its own hostname (``xlhost<n>``) that every host's hosts file resolves; a bridge in
a namespace of its own joins them, so a host can be cut off (its link set down) while the others
stay connected. Nothing is addressed outside the namespaces. Making them needs root and iproute2
(as CI runs); where they cannot be made, every test here is skipped with the reason, which
scripts/test.sh prints as the tier's own line (conftest.py's ``hosts``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.77.0"
NETNS_ETC = Path("/etc/netns")  # iproute2's per-namespace /etc files


def ip(*arguments: str) -> None:
    subprocess.run(["ip", *arguments], check=True, capture_output=True, text=True)


def why_no_hosts() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's ip command is missing"
    probe = f"xlprobe{uuid.uuid4().hex[:6]}"
    try:
        ip("netns", "add", probe)
    except subprocess.CalledProcessError as error:
        return f"ip netns add failed: {error.stderr.strip()}"
    ip("netns", "del", probe)
    return None


@dataclass
class Host:
    namespace: str
    address: str
    hostname: str
    processes: list[subprocess.Popen[str]] = field(default_factory=list)

    def start(self, *command: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """Run a command in this host: its own network, this machine's files."""
        # Its own hostname too (a UTS namespace), which its hosts file resolves to its address
        # (`ip netns exec` puts /etc/netns/<name>/hosts in place of /etc/hosts).
        named = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname]
        process = subprocess.Popen(["ip", "netns", "exec", self.namespace, *named, *command],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
        self.processes.append(process)
        return process

    def running(self) -> list[int]:
        """The pids of every process still in this host's network namespace."""
        found = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True,
                               text=True)
        return [int(pid) for pid in found.stdout.split()]

    def cut_off(self) -> None:
        """The host's link goes down: nothing reaches it, nothing it sends arrives (no reset)."""
        ip("-n", self.namespace, "link", "set", "eth0", "down")

    def reconnect(self) -> None:
        ip("-n", self.namespace, "link", "set", "eth0", "up")


def make_hosts(count: int, tag: str) -> list[Host]:
    bridge = f"xl{tag}br"
    ip("netns", "add", bridge)
    ip("-n", bridge, "link", "add", "br0", "type", "bridge")
    ip("-n", bridge, "link", "set", "br0", "up")
    hosts = []
    for number in range(1, count + 1):
        namespace = f"xl{tag}h{number}"
        ip("netns", "add", namespace)
        ip("-n", namespace, "link", "set", "lo", "up")
        ip("link", "add", f"xl{tag}v{number}", "netns", namespace, "type", "veth",
           "peer", "name", f"p{number}", "netns", bridge)
        ip("-n", namespace, "link", "set", f"xl{tag}v{number}", "name", "eth0")
        ip("-n", namespace, "addr", "add", f"{SUBNET}.{number}/24", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        ip("-n", bridge, "link", "set", f"p{number}", "master", "br0")
        ip("-n", bridge, "link", "set", f"p{number}", "up")
        hosts.append(Host(namespace, f"{SUBNET}.{number}", f"xlhost{number}"))
    table = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.hostname}\n" for h in hosts)
    for host in hosts:
        etc = NETNS_ETC / host.namespace
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(table)
    return hosts


def remove_hosts(hosts: list[Host], tag: str) -> list[str]:
    """Kill what each host still runs (its whole session), then the namespaces; what was left."""
    left = []
    for host in hosts:
        for process in host.processes:
            if process.poll() is None:
                left.append(" ".join(map(str, process.args)))
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    for namespace in [host.namespace for host in hosts] + [f"xl{tag}br"]:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
    return left


def node_env() -> dict[str, str]:
    """A node's environment: the CPU path; gloo on the host's own link (its hostname resolves
    to no address inside the namespace)."""
    return {"XLAUNCH_ACCELERATOR": "cpu", "GLOO_SOCKET_IFNAME": "eth0",
            "PYTHONUNBUFFERED": "1"}


def wait_for(paths: list[Path], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(path.exists() for path in paths):
            return True
        time.sleep(0.1)
    return False


PYTHON = sys.executable
