# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Several streams per peer (kvstored/peer/fetcher.py over kvstored/peer/tcp.py with data threads,
in-process on loopback): a bulk batch of reads goes to the peer as one order per stream, each on a TCP
connection (and a thread on both sides) of its own. One stream cut mid-fetch costs misses for the
chunks that had not arrived on it, never wrong bytes; the other streams' chunks arrive; every slot
is handed back; the next fetch of the missed chunks (a retry) gets them."""

from __future__ import annotations

import asyncio
import mmap

import numpy as np
import pytest_asyncio

from kvstored.io.breaker import CircuitBreaker
from kvstored.namespaces import Namespace
from kvstored.peer import fetcher as fetcher_module
from kvstored.peer import make_link, make_server
from kvstored.peer.fetcher import PeerFetcher, split
from kvstored.peer.transport import (
    ReceiveOutcome,
    SendOrder,
    Slot,
    Source,
    TransportConfig,
    TransportKind,
)

CHUNK = 1 << 20
CHUNKS = 8
STREAMS = 4
CONFIG = TransportConfig(connect_timeout_s=5.0, settle_timeout_s=5.0, tcp_connections=STREAMS, threads=True)
NS = Namespace("ns-streams", "streams", "u8", CHUNK, "", 16)


def test_split_keeps_small_batches_whole_and_spreads_bulk_ones():
    items = list(range(16))
    assert split(items, 4, 16 * (2 << 20)) == [items[0:4], items[4:8], items[8:12], items[12:16]]
    assert split(items, 4, 16 * (64 << 10)) == [items]  # 1 MiB: one stream, one Fetch call
    assert split(items[:3], 4, 3 * (8 << 20)) == [[0], [1], [2]]  # never more streams than chunks
    assert split(items[:5], 2, 5 * (8 << 20)) == [[0, 1, 2], [3, 4]]
    assert split(items, 1, 1 << 30) == [items]


class Peer:
    """A TCP server holding CHUNKS chunks of random bytes, a link to it, and a pool of slots."""

    def __init__(self) -> None:
        self.map = mmap.mmap(-1, 2 * CHUNKS * CHUNK)
        self.mv = memoryview(self.map)
        arr = np.frombuffer(self.map, dtype=np.uint8)
        arr[: CHUNKS * CHUNK] = np.random.default_rng(11).integers(0, 256, CHUNKS * CHUNK, dtype=np.uint8)
        self.server = make_server(TransportKind.TCP, "127.0.0.1", 0, CONFIG)
        self.cut: set[int] = set()  # chunks whose stream the server cuts after its first chunk
        self.orders: list[list[int]] = []

    def chunk(self, i: int) -> memoryview:
        return self.mv[i * CHUNK : (i + 1) * CHUNK]

    def slot(self, i: int) -> Slot:
        base = (CHUNKS + i) * CHUNK
        return Slot([self.mv[base : base + CHUNK]], CHUNK)

    def received(self, i: int) -> bytes:
        return bytes(self.slot(i).views[0])

    def ask_for(self, ns: Namespace, keys: list[bytes]):
        indices = [int(key) for key in keys]
        self.orders.append(indices)

        async def ask(order: SendOrder) -> None:
            sources = [Source([self.chunk(i)], CHUNK) for i in indices]
            if not self.cut & set(indices):
                result = await self.server.send(order, sources, 5.0)
                assert result.ok, result
                return
            # this stream: its first chunk whole, then it is cut (its control call fails; the
            # server sends nothing more on its connection)
            first = SendOrder(order.transport, order.link_id, order.transfers[:1])
            assert (await self.server.send(first, sources[:1], 5.0)).ok
            raise ConnectionResetError("the stream was cut")

        return ask


@pytest_asyncio.fixture
async def peer():
    p = Peer()
    address = await p.server.start()
    link = make_link(TransportKind.TCP, address, CONFIG)
    yield p, link
    await link.close()
    await p.server.close()


async def test_one_stream_cut_mid_fetch_costs_misses_never_wrong_bytes(peer, monkeypatch):
    monkeypatch.setattr(fetcher_module, "STREAM_BYTES", CHUNK)  # 1 MiB chunks count as bulk here
    p, link = peer
    breaker = CircuitBreaker(failures=100, reset_s=1.0)
    verdicts: list[list[ReceiveOutcome]] = []
    busy: dict = {}
    fetcher = PeerFetcher(
        link,
        p.ask_for,
        max_batch=CHUNKS,
        streams=STREAMS,
        timeout_s=5.0,
        gate=breaker.allow,
        on_batch=lambda permit, results: verdicts.append([r.outcome for r in results]),
        busy=busy,
    )
    p.cut = {2}  # the stream of chunks 2 and 3

    async def fetch(indices: list[int]) -> list:
        return await asyncio.gather(*(fetcher.read(NS, str(i).encode(), p.slot(i)) for i in indices))

    results = await fetch(list(range(CHUNKS)))
    assert p.orders == [[0, 1], [2, 3], [4, 5], [6, 7]]  # one batch, one order per stream
    assert link.counters.connects == STREAMS
    outcomes = [r.outcome for r in results]
    assert outcomes[3] is ReceiveOutcome.FAILED  # never sent: a miss
    assert outcomes[2] in (ReceiveOutcome.RECEIVED, ReceiveOutcome.FAILED)  # sent whole, then the cut
    assert all(outcomes[i] is ReceiveOutcome.RECEIVED for i in (0, 1, 4, 5, 6, 7))  # the other streams
    for i, r in enumerate(results):
        assert r.quarantine is None
        if r.ok:
            assert p.received(i) == bytes(p.chunk(i)), f"chunk {i} reported received with other bytes"
    assert len(verdicts) == 1 and len(verdicts[0]) == CHUNKS  # one verdict for the peer's breaker
    await asyncio.sleep(0)
    assert busy == {}, "a slot stayed reserved after its batch"
    assert link.connections == STREAMS - 1  # the cut connection is gone, the others are pooled

    p.cut = set()  # the retry: the missed chunks come through (on pooled or new connections)
    missed = [i for i, r in enumerate(results) if not r.ok]
    retry = await fetch(missed)
    assert all(r.ok for r in retry)
    assert all(p.received(i) == bytes(p.chunk(i)) for i in missed)
    await fetcher.close()
