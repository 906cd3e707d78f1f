# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Several real kvstored daemons with peer tiers: on loopback (each its own port), or each in a
network namespace of a tests.support.netns Topology (10.213.7.x, port 7070, TLS with one shared
node certificate, mutual). Every daemon lists every node as a peer (its own address is skipped).

    with Cluster(3, "tcp") as c:          # or Cluster(3, "ucx", net=topology)
        c.start()
        c[0].client() ... c.status(1).peers ...
        c.kill(0); c.restart(0)

The daemons' unix sockets are in /tmp, reachable from the test process whatever the namespace.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping, Sequence

import grpc

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from tests.support.daemon import Daemon, DaemonError, short_tmpdir, stop_all
from tests.support.netns import Node, Topology
from tests.support.ports import free_port
from tests.support.tls import make_certs

WAIT_S = 60.0  # a bound for every wait on the cluster's state, never a measurement
PEER_PORT = 7070

# Short enough for tests to see every fault's handling, long enough for a loaded 2-core machine.
TEST_PEER_OPTIONS = {
    "fetch_timeout_s": "1.0",
    "connect_timeout_s": "1.0",
    "reconnect_s": "0.5",
    "breaker_failures": "3",
    "breaker_reset_s": "3",
}


class PeerDaemon(Daemon):
    def __init__(self, index: int, address: str, node: Node | None, **kwargs) -> None:
        super().__init__(wrap=node.exec if node is not None else None, **kwargs)
        self.index = index
        self.address = address  # its tcp_listen
        self.node = node
        self.args: list[str] = []

    def status(self) -> pb.PeerStatusResponse:
        with self.channel() as channel:
            return pb_grpc.PeerStub(channel).Status(pb.PeerStatusRequest(), timeout=10)

    def peer(self, other: PeerDaemon) -> pb.PeerInfo:
        """This daemon's view of `other`."""
        for info in self.status().peers:
            if info.address == other.address:
                return info
        raise AssertionError(f"{other.address} is not among the peers of {self.address}")


class Cluster:
    def __init__(
        self,
        n: int,
        transport: str | Sequence[str],
        net: Topology | None = None,
        peer_options: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        cpu_bytes: str = "64MiB",
        peers_dns: str = "",
        fs_bytes: str = "",
        listen_any: bool = False,
        directory: str = "",
        peer_lists: Sequence[Sequence[int]] | None = None,
        placement: Sequence[int] | None = None,
    ) -> None:
        """transport: every node's, or one per node; fs_bytes: each node also gets an fs tier of
        that size, above its peer tier (RAM -> fs -> peer); listen_any: (namespaces) each listens
        on 0.0.0.0, so only its incarnation tells a node that an address is its own; directory: a
        fleet directory's URL instead of peers (the nodes find each other there); peer_lists: the
        nodes each node lists as peers (default: every node); placement: (namespaces) the
        topology node each daemon runs in (default: daemon i in node i; daemons sharing a node
        listen on ports PEER_PORT, PEER_PORT + 10, ...)."""
        transports = [transport] * n if isinstance(transport, str) else list(transport)
        assert len(transports) == n, f"{len(transports)} transports for {n} nodes"
        self.transport = transports[0]
        self.net = net
        self.workdir = short_tmpdir("kvcl")
        options = {**TEST_PEER_OPTIONS, **(peer_options or {})}
        tls: list[str] = []
        if net is not None:
            where = list(placement) if placement is not None else list(range(n))
            assert len(where) == n and max(where) < len(net.nodes), f"no room for {n} daemons in {len(net.nodes)} nodes"
            nodes = [net.nodes[i] for i in where]
            addresses = [f"{node.ip}:{PEER_PORT + 10 * where[:k].count(where[k])}" for k, node in enumerate(nodes)]
            certs = make_certs(self.workdir, ips=tuple(node.ip for node in net.nodes) + ("127.0.0.1",))
            tls = [
                "--tls-cert-file",
                str(certs.server_cert),
                "--tls-key-file",
                str(certs.server_key),
                "--tls-client-ca-file",
                str(certs.ca),
            ]
            options.setdefault("ucx_net_devices", "eth0")
        else:
            nodes = [None] * n  # type: ignore[list-item]
            addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)]
            options.setdefault("ucx_net_devices", "lo")
            options.setdefault("tcp_port", "0")
            options.setdefault("ucx_port", "0")
        lists = peer_lists if peer_lists is not None else [range(n)] * n
        common = ",".join(f"{k}={v}" for k, v in options.items())
        self.daemons = []
        for i, (node, address) in enumerate(zip(nodes, addresses)):
            if directory:
                found = f"directory={directory}"
            elif peers_dns:
                found = f"peers_dns={peers_dns}"
            else:
                found = f"peers={' '.join(addresses[j] for j in lists[i])}"
            spec = f"kind=peer,transport={transports[i]},{found},{common}"
            d = PeerDaemon(i, address, node, cpu_bytes=cpu_bytes, workdir=self.workdir / f"n{i}")
            d.workdir.mkdir()
            fs = ["--tiers", f"kind=fs,root={d.workdir / 'fs'},bytes={fs_bytes}"] if fs_bytes else []
            listen = f"0.0.0.0:{PEER_PORT}" if listen_any else address
            d.args = ["--tcp-listen", listen, *tls, *fs, "--tiers", spec, *extra_args]
            self.daemons.append(d)

    def __getitem__(self, i: int) -> PeerDaemon:
        return self.daemons[i]

    def __iter__(self):
        return iter(self.daemons)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, which: Sequence[int] | None = None) -> Cluster:
        for i in which if which is not None else range(len(self.daemons)):
            self.daemons[i].start(self.daemons[i].args)
        return self

    def restart(self, i: int) -> PeerDaemon:
        """Start node i again (after a kill or a stop): a new incarnation at the same address."""
        d = self.daemons[i]
        d.start(d.args)
        return d

    def kill(self, i: int) -> None:
        self.daemons[i].kill()

    def freeze(self, i: int) -> None:
        self.daemons[i].proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]

    def thaw(self, i: int) -> None:
        self.daemons[i].proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]

    def close(self) -> None:
        for d in self.daemons:
            if d.running:
                d.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        errors = stop_all(self.daemons)
        import shutil

        shutil.rmtree(self.workdir, ignore_errors=True)
        if errors:
            raise DaemonError("cluster teardown failed:\n" + "\n".join(errors))

    # -- waiting on its state -------------------------------------------------------------------

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = WAIT_S) -> None:
        """Poll `check` (a state, never a time) until it holds, failing loudly after `timeout`."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"never {what} within {timeout:.0f} s\n" + self.describe())
            time.sleep(0.05)

    def wait_up(self, i: int, others: Sequence[int] | None = None) -> None:
        """Until node i sees the others up."""
        others = [j for j in (others if others is not None else range(len(self.daemons))) if j != i]
        addresses = {self.daemons[j].address for j in others}
        self.wait_for(
            f"node {i} sees {sorted(addresses)} up",
            lambda: addresses <= {p.address for p in _status(self.daemons[i]).peers if p.state == pb.PEER_STATE_UP},
        )

    def wait_indexed(self, i: int, j: int, at_least: int) -> None:
        """Until node i's index says node j holds at least `at_least` chunks."""
        self.wait_for(
            f"node {i} indexes {at_least} chunks of node {j}",
            lambda: _indexed(self.daemons[i], self.daemons[j].address) >= at_least,
        )

    def describe(self) -> str:
        parts = []
        for d in self.daemons:
            try:
                status = str(d.status()) if d.running else "(not running)"
            except grpc.RpcError as exc:
                status = f"(status failed: {exc.code()})"
            parts.append(f"--- node {d.index} {d.address}: {status}\n{d.log[-4000:]}")
        return "\n".join(parts)


def _status(d: PeerDaemon) -> pb.PeerStatusResponse:
    try:
        return d.status()
    except grpc.RpcError:
        return pb.PeerStatusResponse()


def _indexed(d: PeerDaemon, address: str) -> int:
    for p in _status(d).peers:
        if p.address == address:
            return p.indexed_chunks
    return 0
