# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The set-ups: node A and the nodes B (peer tier), on loopback or across a veth link (`--netns`), a cold tier
below RAM, and the raw arms beside them (bench/lib/raw_net.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

from bench.lib.daemons import Daemon, free_port
from bench.lib.limits import drop_page_cache, raw_odirect
from bench.lib.raw_net import Place, measure_raw
from bench.lib.s3 import raw_s3_get
from bench.peer import loads
from bench.peer.loads import FETCH_TIMEOUT_S, FS_THREADS, S3_INFLIGHT, WAIT_S, Chunks, Measured, ram_for
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from tests.support.cluster import Cluster as TestCluster
from tests.support.netns import Topology


def bench_daemon(chunks: Chunks, *args: str) -> Daemon:
    """A daemon with room for the chunks and no metrics endpoint, `args` added."""
    return Daemon(ram_for(chunks), extra_args=["--metrics-addr", "off", *args], start_timeout_s=WAIT_S)


class Cluster:
    """Node A (serves both transports) and a node B per transport (fetches from A only)."""

    def __init__(self, transports: Sequence[str], chunks: Chunks) -> None:
        self.chunks = chunks
        self.addresses = {name: f"127.0.0.1:{free_port()}" for name in ["A", *transports]}
        a = self.addresses["A"]

        def node(transport: str, peers: Sequence[str], listen: str) -> Daemon:
            spec = f"kind=peer,transport={transport},peers={' '.join(peers)},tcp_port=0,ucx_port=0,"
            spec += f"ucx_net_devices=lo,fetch_timeout_s={FETCH_TIMEOUT_S}"
            return bench_daemon(chunks, "--tcp-listen", listen, "--tiers", spec)

        self.a = node("auto", list(self.addresses.values()), a)
        self.b = {t: node(t, [a, self.addresses[t]], self.addresses[t]) for t in transports}

    def start(self) -> None:
        self.a.start()
        for b in self.b.values():
            b.start()
        loads.store(self.a, self.chunks)
        for transport in self.b:
            self._wait_indexed(transport)

    def _a_seen_by(self, transport: str):
        """B's view of A (kvstored.v1.Peer/Status): state, transport, index, counters."""
        status = self.b[transport].peer_status()
        return next((p for p in status.peers if p.address == self.addresses["A"]), None)

    def _wait_indexed(self, transport: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while True:
            a = self._a_seen_by(transport)
            if a is not None and a.state == pb.PEER_STATE_UP and a.indexed_chunks >= self.chunks.n:
                if a.transport != transport:
                    raise RuntimeError(f"B reaches A over {a.transport}, not {transport}")
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"B ({transport}) never indexed A's {self.chunks.n} chunks: {a}")
            time.sleep(0.1)

    def measure(self, transport: str, out: np.ndarray, batch: int, clients: int, copy: bool) -> Measured:
        seen = partial(self._a_seen_by, transport)
        return loads.fetch_from_a(
            self.b[transport], self.a.pid, seen, transport, self.chunks, out, batch=batch, clients=clients, copy=copy
        )

    def stop(self) -> None:
        for d in [*self.b.values(), self.a]:
            with contextlib.suppress(Exception):
                d.stop()


LOOPBACK = Place("loopback")
RAW = {  # arm -> (raw_net transport, TCP connections)
    "raw TCP, 1 connection": ("tcp", 1),
    "raw TCP, 2 connections": ("tcp", 2),
    "raw ucxx": ("ucx", 1),
}


class Link:
    """`--netns`: two network namespaces joined by one veth pair of a given MTU (tests/support/netns.py); node A
    (serving TCP and UCX) in namespace 0, one node B per transport in namespace 1, each listing only A as its peer
    (the tests' cluster: TLS on the control plane); A holds the chunks in its RAM."""

    def __init__(self, transports: Sequence[str], chunks: Chunks, mtu: int, peer_options: dict[str, str]) -> None:
        self.transports = list(transports)
        self.chunks = replace(chunks, model="bench/peer-link")
        self.net = Topology(2, mtu=mtu, bridge=False)
        self.peer_options = {"fetch_timeout_s": str(FETCH_TIMEOUT_S), **peer_options}
        self.cluster: TestCluster | None = None

    def start(self) -> None:
        self.net.create()
        n = 1 + len(self.transports)
        self.cluster = TestCluster(
            n,
            ["auto", *self.transports],
            net=self.net,
            peer_options=self.peer_options,
            cpu_bytes=ram_for(self.chunks),
            peer_lists=[list(range(n)), *([0, k] for k in range(1, n))],
            placement=[0] + [1] * len(self.transports),
        )
        self.cluster.start()
        loads.store(self.cluster[0], self.chunks)
        for k in range(1, len(self.cluster.daemons)):
            self.cluster.wait_indexed(k, 0, self.chunks.n)

    def measure(self, transport: str, out: np.ndarray, batch: int, clients: int) -> Measured:
        """B over `transport` loads every chunk (leases, as vLLM's direct mode), then forgets them."""
        assert self.cluster is not None
        a, b = self.cluster[0], self.cluster[1 + self.transports.index(transport)]
        seen_a = partial(b.peer, a)
        if (seen := seen_a()).transport != transport:
            raise RuntimeError(f"B reaches A over {seen.transport}, not {transport}")
        m = loads.fetch_from_a(b, a.pid, seen_a, transport, self.chunks, out, batch=batch, clients=clients, copy=False)
        deadline = time.monotonic() + WAIT_S
        while loads.ram_chunks(b):
            if time.monotonic() > deadline:
                raise RuntimeError(f"B ({transport}) still holds chunks after deleting them")
            time.sleep(0.05)
        return m

    def raw(self, arm: str, slots: int) -> Measured:
        """The same bytes from A's namespace to B's over a raw socket / raw ucxx (no daemon)."""
        transport, conns = RAW[arm]
        return raw(transport, self.chunks, slots, Place("veth", self.net.nodes[0], self.net.nodes[1]), conns)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            if self.cluster is not None:
                self.cluster.close()
        self.net.close()


class ColdTier:
    """A cold tier below RAM: the chunks written down to `spec` once (a daemon stopped with a long flush); each
    round a daemon with the same tier starts afresh, its RAM empty, and its clients load them."""

    def __init__(self, spec: str, chunks: Chunks, model: str) -> None:
        self.spec, self.chunks = spec, replace(chunks, model=model)

    def _daemon(self, flush_s: float) -> Daemon:
        return bench_daemon(self.chunks, "--tiers", self.spec, "--flush-on-stop-seconds", str(flush_s))

    def prepare(self) -> None:
        daemon = self._daemon(600.0)
        daemon.start()
        try:
            loads.store(daemon, self.chunks)
        finally:
            if daemon.stop(timeout_s=660.0) != 0:
                raise RuntimeError(f"the daemon writing down to {self.spec} exited badly: {daemon.log_tail()}")

    def measure(self, out: np.ndarray, batch: int, clients: int, drop: bool) -> Measured:
        """Leases, as the peer tier's row (the bytes in the daemon's RAM)."""
        daemon = self._daemon(0.0)
        if drop:
            drop_page_cache()
        daemon.start()
        try:
            if loads.ram_chunks(daemon):
                raise RuntimeError(f"{self.spec}: the restarted daemon holds chunks in RAM")
            return loads.load_all(daemon, self.chunks, out, batch, clients, copy=False)
        finally:
            daemon.stop()


def raw(transport: str, chunks: Chunks, slots: int, place: Place = LOOPBACK, conns: int = 1) -> Measured:
    """The same bytes over a raw socket / raw ucxx (`conns` TCP connections), landing in `slots` buffers (as
    many as the clients' loads have in flight)."""
    s = measure_raw(transport, place, chunks.nbytes, chunks.size, slots, conns=conns)
    return Measured(s.gib_s, s.cpu_s_per_gib)


def odirect(workdir: Path, chunks: Chunks) -> Measured:
    limit = raw_odirect(workdir, chunks.n, chunks.size, FS_THREADS)
    return Measured(limit.read_gib_s, (float("nan"), float("nan")))


def raw_s3(endpoint, bucket: str) -> Measured:
    gib_s, cpu = raw_s3_get(endpoint, bucket, S3_INFLIGHT)
    return Measured(gib_s, (cpu, float("nan")))
