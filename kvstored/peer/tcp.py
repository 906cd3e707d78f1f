# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The TCP fallback of the peer data plane: plain sockets, no copies in user space. The bytes move
on the event loop, or, with data threads (TransportConfig.threads), in threads.

Fetching side (`TcpLink`): a pool of connections per peer; a batch holds one connection for
itself, so its frames never interleave with another's. The connection is made and greeted on the
event loop. Its frames are read straight into the slot's views, each payload hashed as it lands
(from the CPU cache), the reader woken once a good part of a frame is there (SO_RCVLOWAT):
- on the event loop (measured here: loop.sock_recv_into, a BufferedProtocol and a blocking
  recv_into in a thread all reach the raw socket's rate within the noise; asyncio streams would
  add a copy); every batch to every peer shares the loop's one CPU;
- with data threads, in a thread of the link's pool (one per connection in use), in reads of up
  to 512 KiB polled on a non-blocking socket, a whole frame per C call that holds no GIL
  (_rxframe.c; in Python where it is not built), the batch's result handed to the loop with one
  call_soon_threadsafe: several batches (the fetcher's streams) copy on several CPUs, at the
  price of the hand-offs (measured in docs/cluster.md).
A connection goes back to the pool only after every frame of the batch was read; a transfer that
failed, timed out or was cancelled shuts the connection down (a task is cancelled; a thread's read
ends at once), which is also how a transfer is cancelled on the wire (a thread that has not ended
within settle_timeout_s leaves its views quarantined).

Serving side (`TcpServer`): accepts connections on the loop, greets each with a HELLO naming its
link id, and writes each order's frames: HEAD + payload (gathered, straight from the pool's views)
+ SUM, each SUM going out with the next HEAD; on the loop, or with data threads one blocking
gathered sendmsg per chunk in a thread of the server's pool. A connection the fetcher closed is
noticed by a reader callback and dropped; a threaded send past its deadline is stopped by shutting
its connection down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstored.chunks.chunkfile import checksum as payload_checksum
from kvstored.chunks.views import trim
from kvstored.errors import ListenError
from kvstored.io.threads import PriorityThreadPool
from kvstored.peer import flow, sockio, wire
from kvstored.peer.digest import StreamDigest
from kvstored.peer.errors import PeerError, PeerUnreachable, ProtocolError
from kvstored.peer.quarantine import Quarantine
from kvstored.peer.transport import (
    Ask,
    PeerAddress,
    PeerLink,
    PeerServer,
    Receipt,
    ReceiveOutcome,
    ReceiveResult,
    SendOrder,
    SendOutcome,
    SendResult,
    Slot,
    Source,
    Transfer,
    TransportConfig,
    TransportKind,
    failed_all,
    next_transfer_id,
)

log = logging.getLogger(__name__)

_RECEIVED = ReceiveResult(ReceiveOutcome.RECEIVED)  # (one object for every chunk received)
_MISSING = ReceiveResult(ReceiveOutcome.MISSING, "the peer does not hold the chunk")
_MISMATCH = ReceiveResult(ReceiveOutcome.CORRUPT, "payload checksum mismatch")


# -- fetching side ---------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Conn:
    sock: socket.socket
    link_id: int


class TcpLink(PeerLink):
    kind = TransportKind.TCP

    def __init__(self, address: PeerAddress, config: TransportConfig) -> None:
        super().__init__(address, config)
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()
        self._open = 0  # connections made and not closed (idle or in use)
        self._waiters: list[asyncio.Future] = []
        self._closed = False
        # data threads: one per connection in use, each batch's bytes move in its own thread
        self._threads = (
            PriorityThreadPool(config.tcp_connections, f"kvstored-peer-rx-{address.port}") if config.threads else None
        )

    @property
    def connections(self) -> int:
        return self._open

    async def _receive(self, slots: Sequence[Slot], ask: Ask, timeout_s: float) -> list[ReceiveResult]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pieces = [trim(slot.views, slot.size) for slot in slots]
        try:
            conn = await self._checkout(deadline)
        except TimeoutError:
            return failed_all(slots, ReceiveOutcome.TIMED_OUT, f"no connection to {self.address} in time")
        except PeerError as exc:
            return failed_all(slots, ReceiveOutcome.FAILED, str(exc))
        transfers = tuple(
            Transfer(next_transfer_id(), slot.size, wire.segments_of(p)) for slot, p in zip(slots, pieces)
        )
        order = SendOrder(TransportKind.TCP, conn.link_id, transfers)
        results: list[ReceiveResult | None] = [None] * len(slots)
        reading: asyncio.Future
        if self._threads is not None:
            # the backstop: the thread ends by itself soon after the deadline if nothing stops it
            end = time.monotonic() + timeout_s + self.config.settle_timeout_s
            sockio.prepare(conn.sock, end, blocking=False)
            reading = self._threads.submit_async(loop, 0, _read_frames, conn.sock, end, transfers, pieces, results)
        else:
            reading = loop.create_task(_read_frames_on_loop(loop, conn.sock, transfers, pieces, results))
        asking = loop.create_task(flow.call(ask, order))
        failure: ReceiveResult | None = None
        quarantine: Quarantine | None = None
        reusable = False
        try:
            verdict = await flow.wait_transfer([reading], asking, deadline)
            if verdict.stop is flow.Stop.OPS_DONE:
                reusable = reading.result()  # the stream is in step: every frame was read whole
                await flow.finish_ask(asking, deadline, self.config.settle_timeout_s)
            else:
                failure = _failure(verdict, self.address)
        finally:
            if not reading.done():  # a failure, a timeout or a cancellation: stop the reads
                reading.cancel()  # (on the loop: no byte is read into the views after this)
                sockio.stop(conn.sock)  # (in a thread: its read ends at once)
            asking.cancel()
            try:
                await flow.wait_quietly([reading, asking], self.config.settle_timeout_s)
            finally:
                if reading.done():
                    self._checkin(conn, reusable)
                else:  # (it never should) the views stay the thread's until it ends, and so does the socket
                    views = [v for p in pieces for v in p]
                    quarantine = self.quarantines.add(views, [reading])
                    log.warning(
                        "reads from %s did not stop within %.1f s: %d bytes quarantined",
                        self.address,
                        self.config.settle_timeout_s,
                        quarantine.nbytes,
                    )
                    reading.add_done_callback(lambda _: self._checkin(conn, False))
        failure = failure or ReceiveResult(ReceiveOutcome.FAILED, "no frame")
        if quarantine is not None:
            failure = dataclasses.replace(failure, quarantine=quarantine)
        return [r if r is not None else failure for r in list(results)]

    # -- the connection pool

    async def _checkout(self, deadline: float) -> _Conn:
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise PeerUnreachable("link closed")
            while self._idle:
                conn = self._idle.pop()
                if not sockio.peer_gone(conn.sock):
                    self._busy.add(conn)
                    return conn
                self._discard(conn)
            if self._open < self.config.tcp_connections:
                self._open += 1
                try:
                    conn = await self._connect(loop, deadline)
                    self._busy.add(conn)
                    return conn
                except BaseException:
                    self._open -= 1
                    self._wake_one()
                    raise
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError
                await asyncio.wait([waiter], timeout=remaining)
                if not waiter.done():
                    raise TimeoutError
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # we were woken but leave: pass the turn on
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    async def _connect(self, loop: asyncio.AbstractEventLoop, deadline: float) -> _Conn:
        timeout = min(self.config.connect_timeout_s, deadline - loop.time())
        if timeout <= 0:
            raise TimeoutError
        try:
            async with asyncio.timeout(timeout):
                infos = await loop.getaddrinfo(self.address.host, self.address.port, type=socket.SOCK_STREAM)
                family, type_, proto, _, addr = infos[0]
                sock = socket.socket(family, type_, proto)
                try:
                    sock.setblocking(False)
                    await loop.sock_connect(sock, addr)
                    sockio.tune(sock)
                    hello = bytearray(wire.HELLO_BYTES)
                    await sockio.recv_into_all(loop, sock, [memoryview(hello)])
                    link_id = wire.decode_hello(hello)
                except BaseException:
                    sock.close()
                    raise
        except TimeoutError:
            self.counters.connect_failures += 1
            if loop.time() >= deadline:
                raise
            raise PeerUnreachable(f"connecting to {self.address} timed out") from None
        except (OSError, PeerError) as exc:
            self.counters.connect_failures += 1
            raise PeerUnreachable(f"cannot connect to {self.address}: {exc}") from None
        self.counters.connects += 1
        return _Conn(sock, link_id)

    def _checkin(self, conn: _Conn, reusable: bool) -> None:
        self._busy.discard(conn)
        if reusable and not self._closed and _quiet(conn.sock):
            self._idle.append(conn)
            self._wake_one()
        else:
            self._discard(conn)

    def _discard(self, conn: _Conn) -> None:
        conn.sock.close()
        self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        self._closed = True
        while self._idle:
            self._discard(self._idle.pop())
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        for conn in self._busy:  # transfers in flight fail at once (their reads see the end)
            sockio.stop(conn.sock)
        if self._threads is not None:
            self._threads.shutdown(wait=False)  # (each ends with its batch, stopped just now)


async def _write_frames_on_loop(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    order: SendOrder,
    sources: Sequence[Source | None],
    receipts: list[Receipt],
) -> None:
    """(Without data threads.) As _write_frames: each frame's SUM goes out with the next frame's
    HEAD (and the HEADs of any MISSING frames between), hashed as the kernel copies each piece out
    (it is in the cache then) unless its checksum is given."""
    prefix = b""
    for transfer, source in zip(order.transfers, sources):
        if source is None:
            prefix += wire.encode_head(wire.Frame(wire.FrameStatus.MISSING, transfer.transfer_id, 0))
            receipts.append(Receipt(transfer.transfer_id, False, 0, 0))
            continue
        pieces = trim(source.views, source.size)
        prefix += wire.encode_head(wire.Frame(wire.FrameStatus.OK, transfer.transfer_id, source.size))
        digest = None if source.checksum is not None else StreamDigest(pieces, skip=len(prefix))
        await sockio.send_all(loop, sock, [memoryview(prefix), *pieces], digest.moved if digest else None)
        checksum = digest.intdigest() if digest is not None else source.checksum or 0
        prefix = wire.encode_sum(checksum)
        receipts.append(Receipt(transfer.transfer_id, True, source.size, checksum))
    if prefix:
        await sockio.send_all(loop, sock, [memoryview(prefix)])


def _write_frames(
    sock: socket.socket, end: float, order: SendOrder, sources: Sequence[Source | None], receipts: list[Receipt]
) -> None:
    """(In a data-plane thread.) One blocking gathered write per chunk: the previous frame's SUM
    and this frame's HEAD (with the HEADs of any MISSING frames between), then the payload
    straight from the pool's pages. A payload whose checksum is not known yet is hashed right
    after the kernel copied it (it is in the CPU cache then)."""
    prefix = b""
    for transfer, source in zip(order.transfers, sources):
        if source is None:
            prefix += wire.encode_head(wire.Frame(wire.FrameStatus.MISSING, transfer.transfer_id, 0))
            receipts.append(Receipt(transfer.transfer_id, False, 0, 0))
            continue
        pieces = trim(source.views, source.size)
        prefix += wire.encode_head(wire.Frame(wire.FrameStatus.OK, transfer.transfer_id, source.size))
        sockio.send_exactly(sock, [memoryview(prefix), *pieces], end)
        checksum = source.checksum if source.checksum is not None else payload_checksum(pieces, source.size)
        prefix = wire.encode_sum(checksum)
        receipts.append(Receipt(transfer.transfer_id, True, source.size, checksum))
    if prefix:
        sockio.send_exactly(sock, [memoryview(prefix)], end)


def _failure(verdict: flow.Verdict, address: PeerAddress) -> ReceiveResult:
    if verdict.stop is flow.Stop.TIMED_OUT:
        return ReceiveResult(ReceiveOutcome.TIMED_OUT, f"no answer from {address} in time")
    where = "control" if verdict.stop is flow.Stop.ASK_FAILED else "data"
    return ReceiveResult(ReceiveOutcome.FAILED, f"{where} path to {address}: {verdict.describe()}")


async def _read_frames_on_loop(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    transfers: Sequence[Transfer],
    pieces: Sequence[list[memoryview]],
    results: list[ReceiveResult | None],
) -> bool:
    """(Without data threads.) Read the order's frames on the event loop, each straight into its
    slot, woken once a whole frame is there (SO_RCVLOWAT up to 4 MiB); fill in `results` as they
    come. True if the stream is in step afterwards."""
    head = bytearray(wire.HEAD_BYTES)
    trailer = memoryview(bytearray(wire.SUM_BYTES))
    for i, (transfer, slot_pieces) in enumerate(zip(transfers, pieces)):
        await sockio.recv_into_all(loop, sock, [memoryview(head)])
        frame = _checked_head(head, transfer, results, i)
        if frame is None:
            return False
        if frame.status is wire.FrameStatus.MISSING:
            results[i] = _MISSING
            continue
        digest = StreamDigest(slot_pieces)  # each read is hashed while it is still in the cache
        await sockio.recv_into_all(loop, sock, [*slot_pieces, trailer], digest.moved)
        results[i] = _judge(digest, trailer)
    return True


def _read_frames(
    sock: socket.socket,
    end: float,
    transfers: Sequence[Transfer],
    pieces: Sequence[list[memoryview]],
    results: list[ReceiveResult | None],
) -> bool:
    """(In a data-plane thread.) Read the order's frames, in order, each straight into its slot;
    fill in `results` as they come (a connection lost on the 5th leaves the first 4 received).
    The payload, its SUM and the next frame's HEAD (sent together) are one read of a few steps,
    each hashed as it lands (sockio.recv_hashed). True if the stream is in step afterwards
    (the connection can serve another order)."""
    head = memoryview(bytearray(wire.HEAD_BYTES))
    trailer = memoryview(bytearray(wire.SUM_BYTES))
    sockio.recv_exactly(sock, [head], end)
    last = len(transfers) - 1
    for i, (transfer, slot_pieces) in enumerate(zip(transfers, pieces)):
        frame = _checked_head(head, transfer, results, i)
        if frame is None:
            return False
        next_head = [head] if i < last else []
        if frame.status is wire.FrameStatus.MISSING:
            results[i] = _MISSING
            if next_head:
                sockio.recv_exactly(sock, next_head, end)
            continue
        moved, checksum, error = sockio.recv_hashed(sock, [*slot_pieces, trailer, *next_head], transfer.size, end)
        if moved >= transfer.size + wire.SUM_BYTES:  # (only the next HEAD may be missing)
            results[i] = _RECEIVED if checksum == wire.decode_sum(trailer) else _MISMATCH
        if error is not None:
            raise error
    return True


def _quiet(sock: socket.socket) -> bool:
    """Nothing waits to be read: a peer sends frames only for an order, so a byte left after an
    order's last frame (or the connection's end) means the stream is out of step."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # a byte, or b"" at the end: either way out
    except BlockingIOError:
        return True
    except OSError:
        pass
    return False


def _checked_head(
    head: bytes | bytearray | memoryview, transfer: Transfer, results: list[ReceiveResult | None], i: int
) -> wire.Frame | None:
    """Frame i's HEAD, checked against its transfer; None if it is not the one expected (the
    stream is out of step: frame i and every later one are CORRUPT)."""
    try:
        frame = wire.decode_head(head)
        wire.check_frame(frame, transfer.transfer_id, transfer.size)
    except ProtocolError as exc:
        results[i:] = [ReceiveResult(ReceiveOutcome.CORRUPT, str(exc))] * (len(results) - i)
        return None
    return frame


def _judge(digest: StreamDigest, trailer: memoryview) -> ReceiveResult:
    return _RECEIVED if digest.intdigest() == wire.decode_sum(trailer) else _MISMATCH


# -- serving side ----------------------------------------------------------------------------


@dataclass(eq=False)
class _Link:
    link_id: int
    sock: socket.socket
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False


class TcpServer(PeerServer):
    kind = TransportKind.TCP

    def __init__(self, host: str, port: int, config: TransportConfig) -> None:
        super().__init__(host, port, config)
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._links: dict[int, _Link] = {}
        # data threads: sends move their bytes in these (so do the fetchers' reads, on their side):
        # the kernel's copies and the TCP stack's work of several connections run on several CPUs
        self._threads = PriorityThreadPool(config.tcp_connections, "kvstored-peer-tx") if config.threads else None

    @property
    def links(self) -> int:
        return len(self._links)

    async def start(self) -> PeerAddress:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, type_, proto, _, addr = infos[0]
            sock = socket.socket(family, type_, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
                sock.listen(128)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
        except OSError as exc:
            raise ListenError(f"cannot listen for peers on {self.host}:{self.port}: {exc.strerror or exc}") from None
        self._sock = sock
        bound = sock.getsockname()
        self._accepting = loop.create_task(self._accept_loop(loop), name=f"peer-tcp-accept-{bound[1]}")
        return PeerAddress(bound[0], bound[1])

    async def _accept_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE and the like: keep serving the links we have
                log.warning("peer tcp server: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            sockio.tune(conn)
            link_id = self._new_link_id()
            try:
                # the socket's buffer is empty: the greeting never blocks
                if conn.send(wire.encode_hello(link_id)) != wire.HELLO_BYTES:
                    raise OSError("short write of the greeting")
            except OSError as exc:
                log.debug("peer tcp server: greeting a fetcher failed: %s", exc)
                conn.close()
                continue
            link = _Link(link_id, conn)
            self._links[link_id] = link
            loop.add_reader(conn.fileno(), self._on_readable, link)
            self.counters.links_accepted += 1

    def _new_link_id(self) -> int:
        while True:  # random: an order meant for a previous incarnation's link finds no link here
            link_id = secrets.randbits(63)
            if link_id and link_id not in self._links:
                return link_id

    def _on_readable(self, link: _Link) -> None:
        """Fetchers send nothing after connecting: readable means closed (or not a fetcher)."""
        if sockio.peer_gone(link.sock):
            self._drop(link)

    def _drop(self, link: _Link) -> None:
        if link.closed:
            return
        link.closed = True
        self._links.pop(link.link_id, None)
        try:
            asyncio.get_running_loop().remove_reader(link.sock.fileno())
        except (RuntimeError, ValueError):
            pass
        if not link.busy.locked():  # a send in progress closes it when it ends
            link.sock.close()

    async def _send(self, order: SendOrder, sources: Sequence[Source | None], timeout_s: float) -> SendResult:
        link = self._links.get(order.link_id)
        if link is None or link.closed:
            return SendResult(SendOutcome.NO_LINK, f"no link {order.link_id:#x} (closed, or another incarnation's)")
        if self._threads is None:
            return await self._send_on_loop(link, order, sources, timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await link.busy.acquire()  # one order's frames at a time per connection
        except TimeoutError:
            return SendResult(SendOutcome.TIMED_OUT, "the link was busy with another order until the deadline")
        receipts: list[Receipt] = []
        job: asyncio.Future | None = None
        quarantine: Quarantine | None = None
        stopped = False
        try:
            if link.closed:
                return SendResult(SendOutcome.NO_LINK, "the fetcher closed the link")
            end = time.monotonic() + timeout_s + self.config.settle_timeout_s  # (the backstop)
            sockio.prepare(link.sock, end, blocking=True)
            job = self._threads.submit_async(loop, 0, _write_frames, link.sock, end, order, sources, receipts)
            try:
                await asyncio.wait([job], timeout=max(0.0, deadline - loop.time()))
            finally:
                if not job.done():  # the deadline, or our caller gave up: a partial frame, a broken stream
                    stopped = True
                    sockio.stop(link.sock)
                    self._drop(link)
                    try:
                        await flow.wait_quietly([job], self.config.settle_timeout_s)
                    finally:
                        if not job.done():  # (it never should) the pages stay the thread's until it ends
                            views = [v for source in sources if source is not None for v in source.views]
                            quarantine = self.quarantines.add(views, [job])
                            log.warning("sends to a fetcher did not stop within %.1f s", self.config.settle_timeout_s)
            if not stopped and job.exception() is not None:
                self._drop(link)  # a partial frame: the stream is broken
        finally:
            link.busy.release()
            if link.closed:  # (closed by us or by the fetcher meanwhile) the socket goes once nobody uses it
                if job is None or job.done():
                    link.sock.close()
                else:
                    job.add_done_callback(lambda _: link.sock.close())
        if stopped:
            why = "the fetcher did not take the bytes in time"
            return SendResult(SendOutcome.TIMED_OUT, why, quarantine=quarantine)
        error = job.exception()
        if error is not None:
            return SendResult(SendOutcome.FAILED, f"the fetcher's connection failed: {error}")
        return SendResult(SendOutcome.SENT, receipts=tuple(receipts))

    async def _send_on_loop(
        self, link: _Link, order: SendOrder, sources: Sequence[Source | None], timeout_s: float
    ) -> SendResult:
        """(Without data threads.) The order's frames written on the event loop."""
        loop = asyncio.get_running_loop()
        receipts: list[Receipt] = []
        try:
            async with asyncio.timeout(timeout_s):
                async with link.busy:  # one order's frames at a time per connection
                    if link.closed:
                        return SendResult(SendOutcome.NO_LINK, "the fetcher closed the link")
                    try:
                        await _write_frames_on_loop(loop, link.sock, order, sources, receipts)
                    except BaseException:
                        self._drop(link)  # a partial frame: the stream is broken
                        raise
                    finally:
                        if link.closed:
                            link.sock.close()
        except TimeoutError:
            return SendResult(SendOutcome.TIMED_OUT, "the fetcher did not take the bytes in time")
        except OSError as exc:
            return SendResult(SendOutcome.FAILED, f"the fetcher's connection failed: {exc}")
        return SendResult(SendOutcome.SENT, receipts=tuple(receipts))

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.wait([self._accepting])
            self._accepting = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for link in list(self._links.values()):
            if link.busy.locked():
                sockio.stop(link.sock)  # its send fails at once, and closes it
            self._drop(link)
        if self._threads is not None:
            self._threads.shutdown(wait=False)
