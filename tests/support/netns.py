# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Several "nodes" on one machine: network namespaces joined by veth pairs to a bridge (or two
joined by one veth pair, nothing between them).

    with Topology(nodes=2) as net:        # needs root and iproute2 (CI runs as root)
        net.nodes[0].ip                   # "10.213.7.1"
        subprocess.Popen(net.nodes[0].exec(["python", "-m", ...]))
        net.cut(net.nodes[0]); net.restore(net.nodes[0])   # its link down / up

Layout: one namespace holds the bridge (the "switch"), each node namespace one end of a veth
pair ("eth0", on a private /24) whose other end is a bridge port in the switch namespace. No
interface or address appears in the host's own namespace, so the subnet cannot clash with the
host's networks or with another run's topology. `Topology(2, bridge=False)`: the two nodes' eth0
are the two ends of one veth pair (a link with nothing on it but the two stacks: what a benchmark
of the data plane wants). `mtu=`: every link's MTU. `tc netem` is not available on these kernels;
cutting a node off is `ip link set eth0 down` inside it.

Cleanup: every namespace is named <prefix><owner pid>-<role>; closing the topology kills the
processes left inside and deletes the namespaces (their veths go with them). A run that crashed
leaves its namespaces behind: the next Topology removes those whose owner process is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

from tests.support.needs import Needs, require

PREFIX = "kvpn"
SUBNET = "10.213.7"  # a /24 inside the switch namespace only
IFACE = "eth0"
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\w+)$")


def unavailable() -> str | None:
    """Why namespaces can't be used here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    return None


@contextlib.contextmanager
def topology_or_fail(nodes: int) -> Iterator[Topology]:
    """A topology of `nodes` namespaces for a test module; where namespaces can't be made the
    test fails with the reason (never skipped: `make test` runs as root, as CI does)."""
    require(Needs.NETNS, Needs.ROOT)
    reason = unavailable()
    if reason:
        pytest.fail(f"{reason} (the cluster tests need it; CI runs as root)", pytrace=False)
    with Topology(nodes=nodes) as topology:
        yield topology


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def list_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _delete(ns: str) -> None:
    _kill_inside(ns)
    _ip("netns", "delete", ns, check=False)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)  # (Topology.hosts)


def cleanup_stale() -> list[str]:
    """Delete namespaces of earlier runs whose owner process is gone; returns their names."""
    removed = []
    for ns in list_namespaces():
        m = _NAME.match(ns)
        if m is None:
            continue
        owner = int(m.group(1))
        try:
            os.kill(owner, 0)
            continue  # a live run (perhaps another worktree's): leave it alone
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _delete(ns)
        removed.append(ns)
    return removed


@dataclass(frozen=True)
class Node:
    ns: str
    ip: str
    index: int

    def exec(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this node's namespace (environment inherited)."""
        return ["ip", "netns", "exec", self.ns, *argv]


class Topology:
    def __init__(self, nodes: int = 2, subnet: str = SUBNET, mtu: int | None = None, bridge: bool = True) -> None:
        """`mtu`: of every link (the nodes' eth0, the bridge and its ports); None: the kernel's 1500.
        `bridge` False: two nodes joined by one veth pair."""
        if not 1 <= nodes <= 250:
            raise ValueError("1 to 250 nodes")
        if not bridge and nodes != 2:
            raise ValueError("without a bridge, two nodes (the ends of one veth pair)")
        if mtu is not None and not 68 <= mtu <= 65535:
            raise ValueError(f"an MTU of {mtu}: 68 to 65535")
        self._count = nodes
        self._subnet = subnet
        self.mtu = mtu
        self.bridge = bridge
        owner = os.getpid()
        self.switch = f"{PREFIX}{owner}-sw"
        self.nodes = [Node(f"{PREFIX}{owner}-n{i}", f"{subnet}.{i + 1}", i) for i in range(nodes)]
        self._made: list[str] = []

    def __enter__(self) -> Topology:
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def create(self) -> None:
        require(Needs.NETNS, Needs.ROOT)
        cleanup_stale()
        try:
            if not self.bridge:
                self._pair()
                return
            self._add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            mtu = ["mtu", str(self.mtu)] if self.mtu is not None else []
            if mtu:
                _ip("-n", self.switch, "link", "set", "br0", *mtu)
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for node in self.nodes:
                self._add(node.ns)
                port = f"p{node.index}"
                _ip("-n", node.ns, "link", "add", IFACE, "type", "veth", "peer", "name", port, "netns", self.switch)
                if mtu:  # (both ends; a bridge takes the smallest MTU of its ports)
                    _ip("-n", node.ns, "link", "set", IFACE, *mtu)
                    _ip("-n", self.switch, "link", "set", port, *mtu)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", node.ns, "addr", "add", f"{node.ip}/24", "dev", IFACE)
                _ip("-n", node.ns, "link", "set", IFACE, "up")
                _ip("-n", node.ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def _pair(self) -> None:
        a, b = self.nodes
        self._add(a.ns)
        self._add(b.ns)
        _ip("-n", a.ns, "link", "add", IFACE, "type", "veth", "peer", "name", IFACE, "netns", b.ns)
        for node in self.nodes:
            if self.mtu is not None:
                _ip("-n", node.ns, "link", "set", IFACE, "mtu", str(self.mtu))
            _ip("-n", node.ns, "addr", "add", f"{node.ip}/24", "dev", IFACE)
            _ip("-n", node.ns, "link", "set", IFACE, "up")
            _ip("-n", node.ns, "link", "set", "lo", "up")

    def _add(self, ns: str) -> None:
        if ns in list_namespaces():  # left by this very pid (a crashed fixture in this run)
            _delete(ns)
        _ip("netns", "add", ns)
        self._made.append(ns)

    def hosts(self, name: str, nodes: Sequence[Node]) -> None:
        """Make `name` resolve to these nodes' addresses inside every node namespace (`ip netns
        exec` mounts /etc/netns/<ns>/hosts over /etc/hosts): a stand-in for a headless Service.
        Rewritten in place, so processes already running see the change."""
        text = "127.0.0.1 localhost\n" + "".join(f"{n.ip} {name}\n" for n in nodes)
        for node in self.nodes:
            path = f"/etc/netns/{node.ns}/hosts"
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as fh:
                fh.write(text)

    def cut(self, node: Node) -> None:
        """Take the node's link down: its packets go nowhere, no connection is reset."""
        _ip("-n", node.ns, "link", "set", IFACE, "down")

    def restore(self, node: Node) -> None:
        _ip("-n", node.ns, "link", "set", IFACE, "up")

    def close(self) -> None:
        for ns in reversed(self._made):
            _delete(ns)
        self._made.clear()
