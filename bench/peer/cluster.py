# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The daemons: node A and the nodes B (peer tier), and a cold tier below RAM; the raw arms."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.lib.daemons import Daemon, free_port
from bench.lib.limits import drop_page_cache, raw_odirect
from bench.lib.raw_net import Place, measure_raw
from bench.lib.s3 import raw_s3_get
from bench.peer.loads import (
    FETCH_TIMEOUT_S,
    FS_THREADS,
    S3_INFLIGHT,
    WAIT_S,
    Chunks,
    Measured,
    fetch_from_a,
    load_all,
    ram_chunks,
    ram_for,
    store,
)


class Cluster:
    """Node A (serves both transports) and a node B per transport (fetches from A only)."""

    MODEL = "bench/peer"

    def __init__(self, transports: Sequence[str], chunks: Chunks) -> None:
        self.chunks = chunks
        names = ["A", *transports]
        self.addresses = {name: f"127.0.0.1:{free_port()}" for name in names}
        a = self.addresses["A"]

        def node(transport: str, peers: Sequence[str], listen: str) -> Daemon:
            spec = f"kind=peer,transport={transport},peers={' '.join(peers)},tcp_port=0,ucx_port=0,"
            spec += f"ucx_net_devices=lo,fetch_timeout_s={FETCH_TIMEOUT_S}"
            return Daemon(
                ram_for(chunks),
                extra_args=["--metrics-addr", "off", "--tcp-listen", listen, "--tiers", spec],
                start_timeout_s=WAIT_S,
            )

        self.a = node("auto", list(self.addresses.values()), a)
        self.b = {t: node(t, [a, self.addresses[t]], self.addresses[t]) for t in transports}

    def start(self) -> None:
        self.a.start()
        for b in self.b.values():
            b.start()
        store(self.a, self.chunks, self.MODEL)
        for transport in self.b:
            self._wait_indexed(transport)

    def _a_seen_by(self, transport: str):
        """B's view of A (kvstored.v1.Peer/Status): state, transport, index, counters."""
        status = self.b[transport].peer_status()
        return next((p for p in status.peers if p.address == self.addresses["A"]), None)

    def _wait_indexed(self, transport: str) -> None:
        from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

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
        return fetch_from_a(
            self.b[transport],
            self.a.pid,
            lambda: self._a_seen_by(transport),
            transport,
            self.chunks,
            self.MODEL,
            out,
            batch=batch,
            clients=clients,
            copy=copy,
        )

    def stop(self) -> None:
        for d in [*self.b.values(), self.a]:
            with contextlib.suppress(Exception):
                d.stop()


# -- cold tiers: a daemon with one tier below RAM, started afresh each round ---------------------


class ColdTier:
    """The chunks written down to `spec` once (a daemon stopped with a long flush); each round a
    daemon with the same tier starts with its RAM empty, and its clients load them."""

    def __init__(self, spec: str, chunks: Chunks, model: str) -> None:
        self.spec, self.chunks, self.model = spec, chunks, model

    def _daemon(self, flush_s: float) -> Daemon:
        return Daemon(
            ram_for(self.chunks),
            extra_args=["--metrics-addr", "off", "--tiers", self.spec, "--flush-on-stop-seconds", str(flush_s)],
            start_timeout_s=WAIT_S,
        )

    def prepare(self) -> None:
        daemon = self._daemon(600.0)
        daemon.start()
        try:
            store(daemon, self.chunks, self.model)
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
            if ram_chunks(daemon):
                raise RuntimeError(f"{self.spec}: the restarted daemon holds chunks in RAM")
            return load_all(daemon, self.chunks, self.model, out, batch, clients, copy=False)
        finally:
            daemon.stop()


def raw(transport: str, chunks: Chunks, slots: int) -> Measured:
    """The same bytes over a raw socket / raw ucxx, landing in `slots` buffers (as many as the
    clients' loads have in flight)."""
    s = measure_raw(transport, Place("loopback"), chunks.nbytes, chunks.size, slots)
    return Measured(s.gib_s, s.cpu_s_per_gib)


def odirect(workdir: Path, chunks: Chunks) -> Measured:
    limit = raw_odirect(workdir, chunks.n, chunks.size, FS_THREADS)
    return Measured(limit.read_gib_s, (float("nan"), float("nan")))


def raw_s3(endpoint, bucket: str) -> Measured:
    gib_s, cpu = raw_s3_get(endpoint, bucket, S3_INFLIGHT)
    return Measured(gib_s, (cpu, float("nan")))
