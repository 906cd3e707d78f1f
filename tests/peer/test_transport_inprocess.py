# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A PeerLink and a PeerServer in one process and one event loop, over loopback: the contract's
edge cases (misses, control failures, timeouts, corruption, cancellation, pool limits) with
nothing but the transports themselves. tests/peer/test_transport_procs.py covers two processes
and real faults."""

from __future__ import annotations

import asyncio
import mmap
import socket
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import xxhash

from kvstored.errors import ListenError
from kvstored.peer import (
    PeerAddress,
    Receipt,
    ReceiveOutcome,
    SendOrder,
    SendOutcome,
    Slot,
    Source,
    TransportConfig,
    TransportKind,
    UcxConfig,
    make_link,
    make_server,
    sockio,
    ucx_runtime,
    wire,
)
from kvstored.peer.ucx_runtime import ucx_installed
from tests.peer.conftest import TRANSPORTS

SIZE = 1 << 20
PAGE = 64 << 10
CONFIG = TransportConfig(
    connect_timeout_s=5.0, settle_timeout_s=5.0, tcp_connections=2, ucx=UcxConfig(net_devices="lo")
)


class Pool:
    """Two regions of pages: chunks at the server, slots at the fetcher (both split into runs)."""

    def __init__(self, chunks: int = 4) -> None:
        self.map = mmap.mmap(-1, 2 * chunks * SIZE)  # chunks, then as many slots
        self.mv = memoryview(self.map)
        arr = np.frombuffer(self.map, dtype=np.uint8)
        arr[: chunks * SIZE] = np.random.default_rng(7).integers(0, 256, chunks * SIZE, dtype=np.uint8)
        self.chunks = chunks

    def chunk(self, i: int) -> list[memoryview]:
        base = i * SIZE
        cut = PAGE * (1 + i)
        return [self.mv[base + cut : base + SIZE], self.mv[base : base + cut]]  # tail first

    def payload(self, i: int) -> bytes:
        return b"".join(bytes(v) for v in self.chunk(i))

    def slot(self, s: int) -> list[memoryview]:
        base = (self.chunks + s) * SIZE
        return [self.mv[base + 3 * PAGE : base + SIZE], self.mv[base : base + 3 * PAGE]]

    def received(self, s: int) -> bytes:
        return b"".join(bytes(v) for v in self.slot(s))


# One event loop for the module: UCX's context is bound to a loop and shutting it down waits up to
# a second for ucxx's notifier thread, so the module keeps one context for all its tests.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ucx_context():
    if not ucx_installed():
        yield
        return
    ucx_runtime.acquire(CONFIG.ucx.options(), CONFIG.connect_timeout_s)
    yield
    ucx_runtime.release()


@pytest_asyncio.fixture(params=[*TRANSPORTS, "tcp-threads", "tcp-threads-python"], loop_scope="module")
async def pair(request, ucx_context, monkeypatch):
    """A server and a link to it: over UCX, over TCP on the event loop, over TCP in data threads
    (frames read in C where it is built, and in Python)."""
    kind = TransportKind(request.param.split("-")[0])
    config = replace(CONFIG, threads="-threads" in request.param)
    if request.param.endswith("-python"):
        monkeypatch.setattr(sockio, "_rxframe", None)
    server = make_server(kind, "127.0.0.1", 0, config)
    address = await server.start()
    link = make_link(kind, address, config)
    await link.start()
    yield server, link
    await link.close()
    await server.close()


def sender(server, pool: Pool, *chunks: int | None, receipts: bool = True, checksum: int | None = None):
    """The control plane's part, in-process: have the server send these chunks (None: one it does
    not hold), answer its receipts."""

    async def ask(order: SendOrder) -> list[Receipt] | None:
        sources = [None if i is None else Source(pool.chunk(i), SIZE, checksum) for i in chunks]
        result = await server.send(order, sources, 5.0)
        if not result.ok:
            raise RuntimeError(f"{result.outcome.value}: {result.detail}")
        return list(result.receipts) if receipts else None

    return ask


async def test_chunks_land_byte_exact_in_fragmented_slots(pair):
    server, link = pair
    pool = Pool()
    for i in range(pool.chunks):
        result = await link.receive(pool.slot(i % 2), SIZE, sender(server, pool, i), 5.0)
        assert result.ok, result
        assert pool.received(i % 2) == pool.payload(i)
    assert link.counters.received == pool.chunks and link.counters.received_bytes == pool.chunks * SIZE
    assert link.counters.connects == 1
    assert server.counters.sent == pool.chunks and server.links == 1


async def test_a_miss_is_answered_in_band_and_keeps_the_connection(pair):
    server, link = pair
    pool = Pool()

    async def refuse(order: SendOrder) -> list[Receipt]:
        result = await server.refuse(order, 5.0)
        assert result.outcome is SendOutcome.SENT and not result.receipts[0].found
        return list(result.receipts)

    assert (await link.receive(pool.slot(0), SIZE, refuse, 5.0)).outcome is ReceiveOutcome.MISSING
    assert (await link.receive(pool.slot(0), SIZE, sender(server, pool, 1), 5.0)).ok
    assert link.counters.connects == 1 and link.counters.missing == 1
    assert server.counters.refused == 1


async def test_a_batch_of_hits_and_misses_in_one_order(pair):
    server, link = pair
    pool = Pool()
    orders: list[SendOrder] = []
    ask = sender(server, pool, 0, None, 2, None)

    async def counting(order: SendOrder) -> list[Receipt] | None:
        orders.append(order)
        return await ask(order)

    slots = [Slot(pool.slot(s), SIZE) for s in range(2)] + [Slot(pool.slot(s), SIZE) for s in range(2, 4)]
    results = await link.receive_batch(slots, counting, 5.0)
    assert [r.outcome for r in results] == [
        ReceiveOutcome.RECEIVED,
        ReceiveOutcome.MISSING,
        ReceiveOutcome.RECEIVED,
        ReceiveOutcome.MISSING,
    ]
    assert pool.received(0) == pool.payload(0) and pool.received(2) == pool.payload(2)
    assert len(orders) == 1 and len(orders[0].transfers) == 4  # one control round trip for the batch
    assert link.counters.connects == 1 and link.counters.received == 2 and link.counters.missing == 2
    assert server.counters.sent == 2 and server.counters.refused == 2
    assert (await link.receive(pool.slot(0), SIZE, sender(server, pool, 3), 5.0)).ok  # still in step


async def test_a_wrong_checksum_is_corrupt_never_received(pair):
    server, link = pair
    pool = Pool()
    result = await link.receive(pool.slot(0), SIZE, sender(server, pool, 0, checksum=12345), 5.0)
    assert result.outcome is ReceiveOutcome.CORRUPT and "checksum" in result.detail
    assert (await link.receive(pool.slot(0), SIZE, sender(server, pool, 0), 5.0)).ok


async def test_the_receipt_is_what_ucx_checks_the_bytes_against(pair):
    server, link = pair
    pool = Pool()
    result = await link.receive(pool.slot(0), SIZE, sender(server, pool, 0, receipts=False), 5.0)
    if link.kind is TransportKind.UCX:  # the bytes came, but nothing says they are the right ones
        assert result.outcome is ReceiveOutcome.FAILED and "receipt" in result.detail
    else:  # TCP carries it in-band
        assert result.ok and pool.received(0) == pool.payload(0)

    async def other_transfer(order: SendOrder) -> list[Receipt]:
        receipts = await sender(server, pool, 1)(order)
        return [replace(r, transfer_id=r.transfer_id + 1) for r in receipts]

    result = await link.receive(pool.slot(0), SIZE, other_transfer, 5.0)
    assert result.ok if link.kind is TransportKind.TCP else result.outcome is ReceiveOutcome.CORRUPT


async def test_a_failed_control_call_fails_the_transfer(pair):
    server, link = pair
    pool = Pool()

    async def broken(order: SendOrder) -> None:
        raise ConnectionResetError("control plane down")

    result = await link.receive(pool.slot(0), SIZE, broken, 5.0)
    assert result.outcome is ReceiveOutcome.FAILED and "control plane down" in result.detail
    assert result.quarantine is None
    assert (await link.receive(pool.slot(0), SIZE, sender(server, pool, 2), 5.0)).ok
    assert pool.received(0) == pool.payload(2)


async def test_no_answer_times_out_and_the_link_recovers(pair):
    server, link = pair
    pool = Pool()
    never = asyncio.Event()
    ask_cancelled = asyncio.Event()

    async def silent(order: SendOrder) -> None:
        try:
            await never.wait()
        except asyncio.CancelledError:
            ask_cancelled.set()
            raise

    result = await link.receive(pool.slot(0), SIZE, silent, 0.2)
    assert result.outcome is ReceiveOutcome.TIMED_OUT and result.quarantine is None
    assert ask_cancelled.is_set(), "the control call outlived its transfer"
    assert link.connections == 0  # the connection that may be mid-frame is gone
    assert (await link.receive(pool.slot(0), SIZE, sender(server, pool, 3), 5.0)).ok
    assert pool.received(0) == pool.payload(3)


async def test_a_cancelled_receive_leaves_nothing_behind(pair):
    server, link = pair
    pool = Pool()
    asked = asyncio.Event()

    async def hang(order: SendOrder) -> None:
        asked.set()
        await asyncio.Event().wait()

    task = asyncio.get_running_loop().create_task(link.receive(pool.slot(0), SIZE, hang, 30.0))
    await asked.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert link.quarantines.covers(pool.slot(0)) is None  # the slot is free to reuse
    assert link.connections == 0
    assert (await link.receive(pool.slot(0), SIZE, sender(server, pool, 1), 5.0)).ok


async def test_closing_the_link_fails_transfers_in_flight(pair):
    server, link = pair
    pool = Pool()
    asked = asyncio.Event()

    async def hang(order: SendOrder) -> None:
        asked.set()
        await asyncio.Event().wait()

    task = asyncio.get_running_loop().create_task(link.receive(pool.slot(0), SIZE, hang, 30.0))
    await asked.wait()
    await link.close()
    result = await asyncio.wait_for(task, 10.0)  # a bound, not a measurement: 30 s is the transfer's own
    assert result.outcome is ReceiveOutcome.FAILED and result.quarantine is None
    assert link.connections == 0
    result = await link.receive(pool.slot(0), SIZE, sender(server, pool, 0), 5.0)
    assert result.outcome is ReceiveOutcome.FAILED and "closed" in result.detail


async def test_orders_the_server_cannot_serve(pair):
    server, link = pair
    pool = Pool()
    orders: list[SendOrder] = []

    async def capture(order: SendOrder) -> list[Receipt]:
        orders.append(order)
        return list((await server.send(order, [Source(pool.chunk(0), SIZE)], 5.0)).receipts)

    assert (await link.receive(pool.slot(0), SIZE, capture, 5.0)).ok
    order = orders[0]
    chunk = [Source(pool.chunk(0), SIZE)]
    result = await server.send(replace(order, link_id=order.link_id ^ 1), chunk, 1.0)
    assert result.outcome is SendOutcome.NO_LINK
    half = replace(order.transfers[0], size=SIZE // 2)
    assert (await server.send(replace(order, transfers=(half,)), chunk, 1.0)).outcome is SendOutcome.INVALID
    assert (await server.send(order, chunk * 2, 1.0)).outcome is SendOutcome.INVALID
    other = TransportKind.UCX if server.kind is TransportKind.TCP else TransportKind.TCP
    assert (await server.send(replace(order, transport=other), chunk, 1.0)).outcome is SendOutcome.INVALID
    assert server.counters.no_link == 1 and server.counters.invalid == 3


async def test_a_closed_server_fails_transfers_cleanly(pair):
    server, link = pair
    pool = Pool()
    assert (await link.receive(pool.slot(0), SIZE, sender(server, pool, 0), 5.0)).ok
    await server.close()
    result = await link.receive(pool.slot(0), SIZE, sender(server, pool, 0), 2.0)
    assert result.outcome in (ReceiveOutcome.FAILED, ReceiveOutcome.TIMED_OUT)
    assert result.quarantine is None


async def test_a_busy_port_is_a_listen_error(pair):
    server, _ = pair
    kind = server.kind
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        other = make_server(kind, "127.0.0.1", taken.getsockname()[1], CONFIG)
        with pytest.raises(ListenError, match="cannot listen"):
            await other.start()
    finally:
        taken.close()


# -- TCP only: a fake server writes what a broken or hostile peer would ----------------------


class FakeServer:
    """Greets like a TcpServer, then lets the test write raw bytes to the fetcher."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.setblocking(False)
        self.conn: socket.socket | None = None

    @property
    def address(self) -> PeerAddress:
        return PeerAddress("127.0.0.1", self.sock.getsockname()[1])

    async def accept(self) -> None:
        self.conn, _ = await asyncio.get_running_loop().sock_accept(self.sock)
        self.conn.setblocking(False)
        self.conn.send(wire.encode_hello(77))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.sock.close()


@pytest_asyncio.fixture(params=["loop", "threads", "threads-python"], loop_scope="module")
async def fake(request, monkeypatch):
    server = FakeServer()
    if request.param == "threads-python":
        monkeypatch.setattr(sockio, "_rxframe", None)
    link = make_link(TransportKind.TCP, server.address, replace(CONFIG, threads=request.param != "loop"))
    yield server, link
    await link.close()
    server.close()


async def _receive_from_fake(fake, write) -> object:
    server, link = fake
    pool = Pool(chunks=1)
    accepting = asyncio.get_running_loop().create_task(server.accept())

    async def ask(order: SendOrder) -> None:
        await accepting
        assert order.link_id == 77
        await write(server.conn, order)

    return await link.receive(pool.slot(0), SIZE, ask, 2.0)


def _head(order: SendOrder, **changes) -> bytes:
    transfer = order.transfers[0]
    fields: dict[str, Any] = {
        "status": wire.FrameStatus.OK,
        "transfer_id": transfer.transfer_id,
        "length": transfer.size,
    }
    fields.update(changes)
    return wire.encode_head(wire.Frame(**fields))


async def test_tcp_frame_of_another_transfer_is_corrupt(fake):
    async def write(conn, order):
        conn.sendall(_head(order, transfer_id=order.transfers[0].transfer_id + 1))

    result = await _receive_from_fake(fake, write)
    assert result.outcome is ReceiveOutcome.CORRUPT and "transfer" in result.detail
    assert fake[1].connections == 0


async def test_tcp_frame_of_another_length_is_corrupt(fake):
    async def write(conn, order):
        conn.sendall(_head(order, length=SIZE + 1))

    result = await _receive_from_fake(fake, write)
    assert result.outcome is ReceiveOutcome.CORRUPT


async def test_tcp_peer_closing_mid_payload_fails(fake):
    async def write(conn, order):
        conn.sendall(_head(order) + b"x" * 1000)
        conn.close()

    result = await _receive_from_fake(fake, write)
    assert result.outcome is ReceiveOutcome.FAILED and "closed" in result.detail


async def test_tcp_connection_lost_mid_batch_keeps_the_chunks_already_in(fake):
    server, link = fake
    pool = Pool(chunks=3)
    accepting = asyncio.get_running_loop().create_task(server.accept())

    async def ask(order: SendOrder) -> None:
        await accepting
        first = order.transfers[0]
        payload = bytes(SIZE)  # the slot's views are pieces of the pool: a zero chunk is as good as any
        server.conn.setblocking(True)
        server.conn.sendall(
            wire.encode_head(wire.Frame(wire.FrameStatus.OK, first.transfer_id, SIZE))
            + payload
            + wire.encode_sum(xxhash.xxh3_64_intdigest(payload))
            + wire.encode_head(wire.Frame(wire.FrameStatus.OK, order.transfers[1].transfer_id, SIZE))
            + payload[:1000]
        )
        server.conn.close()
        server.conn = None

    results = await link.receive_batch([Slot(pool.slot(s), SIZE) for s in range(3)], ask, 2.0)
    assert [r.outcome for r in results] == [ReceiveOutcome.RECEIVED, ReceiveOutcome.FAILED, ReceiveOutcome.FAILED]
    assert pool.received(0) == bytes(SIZE)
    assert link.connections == 0


async def test_tcp_connection_lost_right_after_a_frame_keeps_that_chunk(fake):
    """The fetcher reads a payload, its SUM and the next frame's HEAD in one call: a connection
    lost between the SUM and that HEAD still leaves the chunk received."""
    server, link = fake
    pool = Pool(chunks=2)
    accepting = asyncio.get_running_loop().create_task(server.accept())

    async def ask(order: SendOrder) -> None:
        await accepting
        payload = bytes(SIZE)
        server.conn.setblocking(True)
        server.conn.sendall(
            wire.encode_head(wire.Frame(wire.FrameStatus.OK, order.transfers[0].transfer_id, SIZE))
            + payload
            + wire.encode_sum(xxhash.xxh3_64_intdigest(payload))
        )
        server.conn.close()
        server.conn = None

    results = await link.receive_batch([Slot(pool.slot(s), SIZE) for s in range(2)], ask, 2.0)
    assert [r.outcome for r in results] == [ReceiveOutcome.RECEIVED, ReceiveOutcome.FAILED]
    assert pool.received(0) == bytes(SIZE)
    assert link.connections == 0


async def test_tcp_not_a_peer_port_fails_to_connect():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    link = make_link(TransportKind.TCP, PeerAddress("127.0.0.1", listener.getsockname()[1]), CONFIG)

    async def greet_wrongly() -> None:
        conn, _ = await asyncio.get_running_loop().sock_accept(listener)
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\0\0\0")
        conn.close()

    greeting = asyncio.get_running_loop().create_task(greet_wrongly())
    try:
        result = await link.receive([memoryview(bytearray(SIZE))], SIZE, lambda order: asyncio.sleep(0), 2.0)
        assert result.outcome is ReceiveOutcome.FAILED and "peer protocol" in result.detail
        assert link.counters.connect_failures == 1
    finally:
        await greeting
        await link.close()
        listener.close()


async def test_tcp_pool_bounds_connections_per_peer():
    config = replace(CONFIG, tcp_connections=1)
    server = make_server(TransportKind.TCP, "127.0.0.1", 0, config)
    link = make_link(TransportKind.TCP, await server.start(), config)
    pool = Pool()
    try:
        results = await asyncio.gather(
            *(link.receive(pool.slot(s), SIZE, sender(server, pool, s), 5.0) for s in range(2))
        )
        assert all(r.ok for r in results)
        assert link.counters.connects == 1  # the second waited for the first's connection
        asked = asyncio.Event()

        async def holding(order: SendOrder) -> None:
            asked.set()  # the first transfer holds the only connection from here on
            await asyncio.Event().wait()

        first = asyncio.get_running_loop().create_task(link.receive(pool.slot(0), SIZE, holding, 30.0))
        await asked.wait()
        result = await link.receive(pool.slot(1), SIZE, sender(server, pool, 1), 0.2)
        assert result.outcome is ReceiveOutcome.TIMED_OUT and "no connection" in result.detail
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
    finally:
        await link.close()
        await server.close()
