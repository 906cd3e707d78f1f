# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The TCP fallback of the peer data plane: plain sockets on the event loop, no copies in user space.

Fetching side (`TcpLink`): a pool of connections per peer; a batch holds one connection for
itself, so its frames never interleave with another's. The bytes are read with recvmsg_into straight
into the slot's views, on the event loop (measured here: loop.sock_recv_into, a BufferedProtocol
and a blocking recv_into in a thread all reach the raw socket's rate within the noise; asyncio
streams would add a copy). A connection goes back to the pool
only after every frame of the batch was read; a transfer that failed, timed out or was cancelled
closes it (the stream may be mid-frame), which is also how a transfer is cancelled on the wire.

Serving side (`TcpServer`): accepts connections, greets each with a HELLO naming its link id, and
writes each chunk's frame: HEAD + payload (gathered sendmsg, straight from the pool's views) +
SUM, frames back to back; both sides hash each piece as it moves (kvstored.peer.digest).
A connection the fetcher closed is noticed by a reader callback and dropped.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstored.chunks.views import trim
from kvstored.errors import ListenError
from kvstored.peer import flow, sockio, wire
from kvstored.peer.digest import StreamDigest
from kvstored.peer.errors import PeerError, PeerUnreachable, ProtocolError
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
        reading = loop.create_task(self._read_frames(loop, conn, transfers, pieces, results))
        asking = loop.create_task(flow.call(ask, order))
        reusable = False
        try:
            verdict = await flow.wait_transfer([reading], asking, deadline)
            if verdict.stop is flow.Stop.OPS_DONE:
                reusable = reading.result()  # the stream is in step: every frame was read whole
                await flow.finish_ask(asking, deadline, self.config.settle_timeout_s)
            else:
                failure = _failure(verdict, self.address)
                results = [r if r is not None else failure for r in results]
        finally:
            reading.cancel()  # a no-op once done; otherwise no byte is read into the views after this
            asking.cancel()
            try:
                await flow.wait_quietly([reading, asking], self.config.settle_timeout_s)
            finally:
                self._checkin(conn, reusable)
        return [r if r is not None else ReceiveResult(ReceiveOutcome.FAILED, "no frame") for r in results]

    @staticmethod
    async def _read_frames(
        loop: asyncio.AbstractEventLoop,
        conn: _Conn,
        transfers: Sequence[Transfer],
        pieces: Sequence[list[memoryview]],
        results: list[ReceiveResult | None],
    ) -> bool:
        """Read the order's frames, in order, each straight into its slot; fill in `results` as
        they come (a connection lost on the 5th leaves the first 4 received). True if the stream
        is in step afterwards (the connection can serve another order)."""
        head = bytearray(wire.HEAD_BYTES)
        trailer = bytearray(wire.SUM_BYTES)
        for i, (transfer, slot_pieces) in enumerate(zip(transfers, pieces)):
            await sockio.recv_into_all(loop, conn.sock, [memoryview(head)])
            try:
                frame = wire.decode_head(head)
                wire.check_frame(frame, transfer.transfer_id, transfer.size)
            except ProtocolError as exc:
                for j in range(i, len(results)):
                    results[j] = ReceiveResult(ReceiveOutcome.CORRUPT, str(exc))
                return False
            if frame.status is wire.FrameStatus.MISSING:
                results[i] = ReceiveResult(ReceiveOutcome.MISSING, "the peer does not hold the chunk")
                continue
            digest = StreamDigest(slot_pieces)  # each read is hashed while it is still in the cache
            await sockio.recv_into_all(loop, conn.sock, [*slot_pieces, memoryview(trailer)], digest.moved)
            if digest.intdigest() != wire.decode_sum(trailer):
                results[i] = ReceiveResult(ReceiveOutcome.CORRUPT, "payload checksum mismatch")
            else:
                results[i] = ReceiveResult(ReceiveOutcome.RECEIVED)
        return True

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
        if reusable and not self._closed:
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
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _failure(verdict: flow.Verdict, address: PeerAddress) -> ReceiveResult:
    if verdict.stop is flow.Stop.TIMED_OUT:
        return ReceiveResult(ReceiveOutcome.TIMED_OUT, f"no answer from {address} in time")
    where = "control" if verdict.stop is flow.Stop.ASK_FAILED else "data"
    return ReceiveResult(ReceiveOutcome.FAILED, f"{where} path to {address}: {verdict.describe()}")


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
        loop = asyncio.get_running_loop()
        receipts: list[Receipt] = []
        try:
            async with asyncio.timeout(timeout_s):
                async with link.busy:  # one order's frames at a time per connection
                    if link.closed:
                        return SendResult(SendOutcome.NO_LINK, "the fetcher closed the link")
                    try:
                        await self._write_frames(loop, link, order, sources, receipts)
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

    @staticmethod
    async def _write_frames(
        loop: asyncio.AbstractEventLoop,
        link: _Link,
        order: SendOrder,
        sources: Sequence[Source | None],
        receipts: list[Receipt],
    ) -> None:
        """Each frame's SUM goes out with the next frame's HEAD (one write fewer per chunk)."""
        pending_sum = b""
        for transfer, source in zip(order.transfers, sources):
            if source is None:
                head = wire.encode_head(wire.Frame(wire.FrameStatus.MISSING, transfer.transfer_id, 0))
                await sockio.send_all(loop, link.sock, [memoryview(pending_sum + head)])
                pending_sum = b""
                receipts.append(Receipt(transfer.transfer_id, False, 0, 0))
                continue
            pieces = trim(source.views, source.size)
            prefix = pending_sum + wire.encode_head(wire.Frame(wire.FrameStatus.OK, transfer.transfer_id, source.size))
            # hashed as the kernel copies each piece out (it is in the cache then), unless given
            digest = None if source.checksum is not None else StreamDigest(pieces, skip=len(prefix))
            await sockio.send_all(loop, link.sock, [memoryview(prefix), *pieces], digest.moved if digest else None)
            checksum = digest.intdigest() if digest is not None else source.checksum or 0
            pending_sum = wire.encode_sum(checksum)
            receipts.append(Receipt(transfer.transfer_id, True, source.size, checksum))
        if pending_sum:
            await sockio.send_all(loop, link.sock, [memoryview(pending_sum)])

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.wait([self._accepting])
            self._accepting = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for link in list(self._links.values()):
            self._drop(link)
