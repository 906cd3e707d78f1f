# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Chunks, storing them, and the clients that load them (leasing or copying out)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from bench.lib.daemons import Daemon as BenchDaemon
from bench.lib.daemons import cpu_of, process_cpu_seconds
from bench.lib.report import GIB, MIB
from kvstored_client import Client
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.session import PoolSession
from tests.support.daemon import Daemon as TestDaemon

TARGET = 0.8
WAIT_S = 120.0  # bound on waiting for the cluster's state (never a measurement)
FS_THREADS = 8  # the fs tier's io_threads (the daemon's default): raw O_DIRECT at that depth
S3_INFLIGHT = 16  # the S3 tier's requests in flight (the daemon's default)
STORE_BATCH = 64
# Not the default 1 s: a stall of this shared machine must not turn into misses (they end the run).
FETCH_TIMEOUT_S = 5.0
COPIED = "client load + copy out"
Daemon = BenchDaemon | TestDaemon  # bench.lib.daemons', or the tests' cluster's (the --netns link)
# B's counters for A (kvstored.v1.Peer/Status) that a failed load is reported with
PEER_COUNTERS = "missing_chunks corrupt_chunks failed_chunks timed_out_chunks refused_by_breaker".split()


@dataclass(frozen=True)
class Chunks:
    """`n` chunks of `size` bytes, each of its own content (generated, not kept), their keys and namespace."""

    n: int
    size: int
    model: str = "bench/peer"

    @property
    def nbytes(self) -> int:
        return self.n * self.size

    @property
    def keys(self) -> list[bytes]:
        return [f"bench-peer:{i}".encode().ljust(32, b".") for i in range(self.n)]

    def content(self, first: int, count: int) -> np.ndarray:
        """Chunks first..first+count-1: a counter with each chunk's index in the high bits."""
        words = np.arange(self.size // 8, dtype=np.uint64)
        out = np.empty((count, self.size // 8), np.uint64)
        for k in range(count):
            np.bitwise_xor(words, np.uint64((first + k + 1) << 40), out=out[k])
        return out.view(np.uint8)

    def namespace(self, client):
        return client.register_namespace(model=self.model, dtype="u8", chunk_bytes=self.size)

    def wrong(self, out: np.ndarray) -> int:
        """How many chunks of `out` are not their own bytes."""
        return sum(not np.array_equal(out[i], self.content(i, 1)[0]) for i in range(self.n))


@dataclass
class Measured:
    """One arm's round: GiB/s and CPU s/GiB (fetching side, serving side)."""

    gib_s: float
    cpu_s_per_gib: tuple[float, float]
    client_cpu_s_per_gib: float = float("nan")  # of the fetching side's: the clients' (calls, copies out)


def store(daemon: Daemon, chunks: Chunks) -> None:
    keys = chunks.keys
    with Client(str(daemon.socket), deadline_s=120.0) as kv:
        ns = chunks.namespace(kv)
        for i in range(0, chunks.n, STORE_BATCH):
            batch = keys[i : i + STORE_BATCH]
            r = kv.store(ns, batch, chunks.content(i, len(batch)))
            if r.stored + r.already_present != len(batch):
                raise RuntimeError(f"storing on {daemon.socket}: {r}")


def ram_chunks(daemon: Daemon) -> int:
    """Chunks in the daemon's RAM (Stats: a Lookup would start promoting them)."""
    with Client(str(daemon.socket), deadline_s=60.0) as kv:
        return next(t.chunks for t in kv.stats().tiers if t.name == "ram")


class Leaser:
    """A client loading as vLLM's direct mode does (KvstoredOffloadingSpec): Acquire gives leases
    on the chunks in the daemon's RAM, promoted from below first (the GPU would then read the
    pool), then Release. No copy: what it waits for is the tier's work alone."""

    def __init__(self, daemon: Daemon, namespace_id: str, name: str) -> None:
        self._session = PoolSession.open(daemon.socket, name, timeout=10.0, populate=False)
        self._channel = grpc.insecure_channel(f"unix:{daemon.socket}")
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._namespace_id = namespace_id

    def load(self, keys: list[bytes], _out: np.ndarray) -> int:
        sid = self._session.session_id
        leases = self._stub.Acquire(
            pb.AcquireRequest(session_id=sid, namespace_id=self._namespace_id, keys=keys), timeout=120.0
        ).leases
        self._stub.Release(pb.ReleaseRequest(session_id=sid, handles=[lease.handle for lease in leases]), timeout=120.0)
        return len(leases)

    def close(self) -> None:
        self._channel.close()
        self._session.close()


class Copier:
    """A client loading with kvstored_client's `load`: Acquire, copy into the caller's buffer, Release."""

    def __init__(self, daemon: Daemon, chunks: Chunks, name: str) -> None:
        self._kv = Client(str(daemon.socket), deadline_s=120.0, client_name=name)
        self._ns = chunks.namespace(self._kv)
        self._kv.load(self._ns, [], np.empty((0, chunks.size), np.uint8))  # the session (and its pool mapping) now

    def load(self, keys: list[bytes], out: np.ndarray) -> int:
        return self._kv.load(self._ns, keys, out)

    def close(self) -> None:
        self._kv.close()


def load_all(
    daemon: Daemon, chunks: Chunks, out: np.ndarray, batch: int, clients: int, copy: bool, serving: Sequence[int] = ()
) -> Measured:
    """Load every chunk through `clients` clients of `daemon` (`batch` chunks per call, the calls
    dealt out in turn): leases (`copy` False) or copies into `out`. Timed from the first call to
    the last answer, with the CPU the daemon, the clients (this process) and `serving` used
    meanwhile. Then (untimed) every chunk is compared, copied out of the daemon's RAM: a
    RuntimeError if one was not loaded or came back with other bytes."""
    out[:] = 0
    keys = chunks.keys
    with Client(str(daemon.socket), deadline_s=120.0) as kv:
        namespace_id = chunks.namespace(kv).namespace_id
    loaders: list[Leaser | Copier] = []
    try:
        for k in range(clients):
            name = f"bench-peer-{k}"
            loaders.append(Copier(daemon, chunks, name) if copy else Leaser(daemon, namespace_id, name))
        starts = list(range(0, chunks.n, batch))
        loaded = [0] * len(starts)
        go = threading.Barrier(clients + 1)

        def run(k: int) -> None:
            go.wait()
            for j in range(k, len(starts), clients):
                s = starts[j]
                loaded[j] = loaders[k].load(keys[s : s + batch], out[s : s + batch])

        threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        fetching0, serving0, me0 = process_cpu_seconds(daemon.pid), cpu_of(serving), time.process_time()
        go.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        me = time.process_time() - me0
        fetching, served = process_cpu_seconds(daemon.pid) - fetching0, cpu_of(serving) - serving0
    finally:
        for loader in loaders:
            loader.close()
    if sum(loaded) != chunks.n:
        raise RuntimeError(f"{daemon.socket}: loaded {sum(loaded)} of {chunks.n} chunks")
    if not copy:
        with Client(str(daemon.socket), deadline_s=120.0) as kv:  # from the daemon's RAM now
            if kv.load(chunks.namespace(kv), keys, out) != chunks.n:
                raise RuntimeError(f"{daemon.socket}: the leased chunks did not stay in RAM")
    if wrong := chunks.wrong(out):
        raise RuntimeError(f"{daemon.socket}: {wrong} chunks came back with other bytes")
    gib = chunks.nbytes / GIB
    return Measured(gib / wall, ((fetching + me) / gib, served / gib if serving else float("nan")), me / gib)


def fetch_from_a(
    b: Daemon, a_pid: int, a_seen: Callable[[], Any], via: str, chunks: Chunks, out: np.ndarray, **load: Any
) -> Measured:
    """B (over `via`) loads every chunk that only A holds (`load`: load_all's batch, clients, copy), then forgets
    its copies (A keeps its own); a failure is reported with B's counters for A (`a_seen()`)."""
    if ram_chunks(b):
        raise RuntimeError(f"before the load, B ({via}) holds chunks in its RAM")
    try:
        m = load_all(b, chunks, out, **load, serving=[a_pid])
    except RuntimeError as exc:
        seen = a_seen()
        detail = ", ".join(f"{k} {getattr(seen, k, '?')}" for k in PEER_COUNTERS)
        raise RuntimeError(f"{exc}; B's counters for A: {detail}") from None
    with Client(str(b.socket), deadline_s=60.0) as kv:
        kv.delete(chunks.namespace(kv), chunks.keys)
    return m


def ram_for(chunks: Chunks) -> str:
    return str(int(chunks.nbytes * 1.25) + 64 * MIB)  # the chunks, the write-back headroom, slack
