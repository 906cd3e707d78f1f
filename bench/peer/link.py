# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The peer tier across a real link (`--netns`): two network namespaces joined by one veth pair of
a given MTU (tests/support/netns.py), node A in one, a node B per transport in the other (the
tests' cluster: TLS on the control plane, tests/support/cluster.py); the raw transports between
the same two namespaces (bench/lib/raw_net.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import numpy as np

from bench.lib.raw_net import Place, measure_raw
from bench.peer.loads import FETCH_TIMEOUT_S, WAIT_S, Chunks, Measured, fetch_from_a, ram_chunks, ram_for, store
from tests.support.cluster import Cluster
from tests.support.netns import Topology

MODEL = "bench/peer-link"
RAW = {  # arm -> (raw_net transport, TCP connections)
    "raw TCP, 1 connection": ("tcp", 1),
    "raw TCP, 2 connections": ("tcp", 2),
    "raw ucxx": ("ucx", 1),
}


class Link:
    """Node A (`transport = "auto"`: serves TCP and UCX) in namespace 0; one node B per transport
    in namespace 1, each listing only A as its peer; A holds the chunks in its RAM."""

    def __init__(self, transports: Sequence[str], chunks: Chunks, mtu: int, peer_options: dict[str, str]) -> None:
        self.transports = list(transports)
        self.chunks = chunks
        self.net = Topology(2, mtu=mtu, bridge=False)
        self.peer_options = {"fetch_timeout_s": str(FETCH_TIMEOUT_S), **peer_options}
        self.cluster: Cluster | None = None

    def start(self) -> None:
        self.net.create()
        n = 1 + len(self.transports)
        self.cluster = Cluster(
            n,
            ["auto", *self.transports],
            net=self.net,
            peer_options=self.peer_options,
            cpu_bytes=ram_for(self.chunks),
            peer_lists=[list(range(n)), *([0, k] for k in range(1, n))],
            placement=[0] + [1] * len(self.transports),
        )
        self.cluster.start()
        store(self.cluster[0], self.chunks, MODEL)
        for k in range(1, len(self.cluster.daemons)):
            self.cluster.wait_indexed(k, 0, self.chunks.n)

    def b(self, transport: str):
        assert self.cluster is not None
        return self.cluster[1 + self.transports.index(transport)]

    def measure(self, transport: str, out: np.ndarray, batch: int, clients: int) -> Measured:
        """B over `transport` loads every chunk (leases, as vLLM's direct mode), then forgets them."""
        assert self.cluster is not None
        a, b = self.cluster[0], self.b(transport)
        seen = b.peer(a)
        if seen.transport != transport:
            raise RuntimeError(f"B reaches A over {seen.transport}, not {transport}")
        m = fetch_from_a(
            b, a.pid, lambda: b.peer(a), transport, self.chunks, MODEL, out, batch=batch, clients=clients, copy=False
        )
        deadline = time.monotonic() + WAIT_S
        while ram_chunks(b):
            if time.monotonic() > deadline:
                raise RuntimeError(f"B ({transport}) still holds chunks after deleting them")
            time.sleep(0.05)
        return m

    def raw(self, arm: str, slots: int) -> Measured:
        """The same bytes from A's namespace to B's over a raw socket / raw ucxx (no daemon)."""
        transport, conns = RAW[arm]
        place = Place("veth", self.net.nodes[0], self.net.nodes[1])
        s = measure_raw(transport, place, self.chunks.nbytes, self.chunks.size, slots, conns=conns)
        return Measured(s.gib_s, s.cpu_s_per_gib)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            if self.cluster is not None:
                self.cluster.close()
        self.net.close()
