# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The UCX data plane (ucxx): tagged messages straight between the two daemons' pool pages.

ucxx's Python API has tag send/receive but no RMA, so the fetcher pulls by tag: it posts one
receive per piece of its slot (tag = transfer id << 16 | piece), then asks the server (control
plane) to send; the server sends each piece from its own pages (a piece straddling two of its
page runs goes through a copy, counted as bounced_bytes), hashes them once UCX has read them
(they are in the cache then) and returns a Receipt (length, xxh3-64) for the control plane's
answer, which the fetcher checks the pieces against before reporting RECEIVED. A miss sends
empty pieces, so no receive is left posted, and a receipt that says so.

Connections: the server listens on a TCP port (lifeline.py); a fetcher connects there, the two
swap UCX worker addresses and each makes its endpoint from the other's. That socket stays open
beside the endpoint, so a peer process that dies is noticed at once on both sides.

One endpoint per peer carries every transfer to it. UCX cannot cancel one receive once data
flows into it, so a transfer that fails or runs out of time aborts the endpoint: UCX then cancels
every request on it, and the receive returns once they have all completed (the views are free
again), or after settle_timeout_s with a Quarantine. The next transfer connects anew.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvstored.chunks.chunkfile import checksum as payload_checksum
from kvstored.chunks.views import trim
from kvstored.errors import ListenError
from kvstored.peer import flow, ucx_runtime, wire
from kvstored.peer.errors import PeerError, PeerUnreachable
from kvstored.peer.lifeline import Lifeline
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

ABORT_WAIT_NS = 1_000_000_000  # how long closing an endpoint may block for ucxx's progress thread


def _abort(ep: Any) -> None:
    try:
        ep.abort(period=ABORT_WAIT_NS, max_attempts=1)
    except Exception as exc:  # already closed or failed: nothing left to stop
        log.debug("aborting a UCX endpoint: %s", exc)


def _alive(ep: Any) -> bool:
    try:
        return not ep.closed
    except Exception:
        return False


# -- fetching side ---------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Endpoint:
    ep: Any  # ucxx Endpoint
    link_id: int
    lifeline: Lifeline

    def alive(self) -> bool:
        return not self.lifeline.lost and _alive(self.ep)


class UcxLink(PeerLink):
    kind = TransportKind.UCX

    def __init__(self, address: PeerAddress, config: TransportConfig) -> None:
        super().__init__(address, config)
        self._ucxx: ModuleType | None = None
        self._conn: _Endpoint | None = None
        self._connecting = asyncio.Lock()
        self._closed = False

    @property
    def connections(self) -> int:
        return int(self._conn is not None and self._conn.alive())

    async def start(self) -> None:
        """Start UCX now (importing ucxx blocks the loop for ~0.5 s: better at start than in a
        transfer). Raises TransportUnavailable."""
        self._runtime()

    async def _receive(self, slots: Sequence[Slot], ask: Ask, timeout_s: float) -> list[ReceiveResult]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pieces = [trim(slot.views, slot.size) for slot in slots]
        for p in pieces:
            if len(p) > wire.MAX_PIECES:
                raise ValueError(f"a slot of {len(p)} pieces, at most {wire.MAX_PIECES}")
        try:
            conn = await self._endpoint(deadline)
        except TimeoutError:
            return failed_all(slots, ReceiveOutcome.TIMED_OUT, f"no UCX endpoint to {self.address} in time")
        except PeerError as exc:
            return failed_all(slots, ReceiveOutcome.FAILED, str(exc))
        transfers = tuple(
            Transfer(next_transfer_id(), slot.size, wire.segments_of(p)) for slot, p in zip(slots, pieces)
        )
        # Receives first (the tasks run in creation order), then the order that makes the server send.
        ops = [
            loop.create_task(conn.ep.recv(buf, tag=wire.piece_tag(t.transfer_id, i), force_tag=True))
            for t, slot_pieces in zip(transfers, pieces)
            for i, buf in enumerate(slot_pieces)
        ]
        asking = loop.create_task(flow.call(ask, SendOrder(TransportKind.UCX, conn.link_id, transfers)))
        quarantine = None
        try:
            results = await self._await(conn, ops, asking, transfers, pieces, deadline)
        finally:
            asking.cancel()
            if not all(op.done() for op in ops):
                self._drop(conn)  # UCX cancels every request on the endpoint
            try:
                await flow.wait_quietly([*ops, asking], self.config.settle_timeout_s)
            finally:
                if not all(op.done() for op in ops):
                    quarantine = self.quarantines.add([v for p in pieces for v in p], ops)
                    log.error(
                        "UCX receives from %s did not stop within %.1f s: %d bytes quarantined",
                        self.address,
                        self.config.settle_timeout_s,
                        quarantine.nbytes,
                    )
        if quarantine is not None:
            results = [r if r.ok else dataclasses.replace(r, quarantine=quarantine) for r in results]
        return results

    async def _await(
        self,
        conn: _Endpoint,
        ops: list[asyncio.Task],
        asking: asyncio.Task,
        transfers: tuple[Transfer, ...],
        pieces: list[list[memoryview]],
        deadline: float,
    ) -> list[ReceiveResult]:
        verdict = await flow.wait_transfer(ops, asking, deadline)
        if verdict.stop is flow.Stop.OPS_DONE:
            # every piece is in: the receipts (the control plane's answer) say what they must be
            verdict = await flow.wait_transfer([asking], None, deadline)
            if verdict.stop is flow.Stop.OPS_DONE:
                return _judge(asking.result(), transfers, pieces)
            if verdict.stop is flow.Stop.OP_FAILED:
                verdict = flow.Verdict(flow.Stop.ASK_FAILED, verdict.error)
        if verdict.stop is flow.Stop.OP_FAILED:
            self._drop(conn)  # (receives still posted drop it in any case, see _receive)
        if verdict.stop is flow.Stop.TIMED_OUT:
            return failed_all(transfers, ReceiveOutcome.TIMED_OUT, f"no answer from {self.address} in time")
        if self._ucxx is not None and isinstance(verdict.error, self._ucxx.exceptions.UCXMessageTruncatedError):
            return failed_all(transfers, ReceiveOutcome.CORRUPT, "the peer sent a piece larger than asked for")
        where = "control" if verdict.stop is flow.Stop.ASK_FAILED else "data"
        return failed_all(transfers, ReceiveOutcome.FAILED, f"{where} path to {self.address}: {verdict.describe()}")

    async def _endpoint(self, deadline: float) -> _Endpoint:
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TimeoutError
        async with asyncio.timeout(remaining):
            async with self._connecting:
                if self._closed:
                    raise PeerUnreachable("link closed")
                conn = self._conn
                if conn is not None and conn.alive():
                    return conn
                if conn is not None:
                    self._drop(conn)
                self._conn = await self._connect(loop, deadline)
                return self._conn

    def _runtime(self) -> ModuleType:
        if self._ucxx is None:
            self._ucxx = ucx_runtime.acquire(self.config.ucx.options(), self.config.connect_timeout_s)
        return self._ucxx

    async def _connect(self, loop: asyncio.AbstractEventLoop, deadline: float) -> _Endpoint:
        lifeline = Lifeline()
        ok = False
        try:
            ucxx = self._runtime()
            async with asyncio.timeout(self.config.connect_timeout_s):
                await loop.create_connection(lambda: lifeline, self.address.host, self.address.port)
                lifeline.write(wire.encode_ucx_hello(bytes(ucxx.get_worker_address())))
                link_id = wire.decode_hello(await lifeline.read_exactly(wire.HELLO_BYTES))
                length = wire.decode_address_len(await lifeline.read_exactly(wire.ADDRESS_LEN_BYTES))
                address = ucxx.get_ucx_address_from_buffer(await lifeline.read_exactly(length))
                ep = await ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=True)
            ok = True
        except TimeoutError:
            if loop.time() >= deadline:
                raise
            raise PeerUnreachable(f"connecting to {self.address} over UCX timed out") from None
        except Exception as exc:  # OSError, UCXError, PeerError, TransportUnavailable
            raise PeerUnreachable(f"cannot connect to {self.address} over UCX: {exc}") from None
        finally:
            if not ok:  # (also when the caller's deadline cancelled us)
                self.counters.connect_failures += 1
                lifeline.close()
        conn = _Endpoint(ep, link_id, lifeline)
        lifeline.on_lost = lambda: self._drop(conn)  # the server's process is gone: fail its transfers now
        self.counters.connects += 1
        return conn

    def _drop(self, conn: _Endpoint) -> None:
        if self._conn is conn:
            self._conn = None
        conn.lifeline.close()
        _abort(conn.ep)

    async def close(self) -> None:
        self._closed = True
        if self._conn is not None:
            self._drop(self._conn)
        await self.quarantines.wait(self.config.settle_timeout_s)
        if self._ucxx is not None:
            self._ucxx = None
            ucx_runtime.release()


def _judge(
    receipts: Sequence[Receipt] | None, transfers: Sequence[Transfer], pieces: Sequence[list[memoryview]]
) -> list[ReceiveResult]:
    """Every piece arrived: check each chunk against the server's receipt for it."""
    if receipts is None:
        return failed_all(transfers, ReceiveOutcome.FAILED, "the control plane returned no receipts (UCX needs them)")
    by_id = {r.transfer_id: r for r in receipts if isinstance(r, Receipt)}
    results = []
    for transfer, slot_pieces in zip(transfers, pieces):
        receipt = by_id.get(transfer.transfer_id)
        if receipt is None:
            results.append(ReceiveResult(ReceiveOutcome.CORRUPT, f"no receipt for transfer {transfer.transfer_id:#x}"))
        elif not receipt.found:
            results.append(ReceiveResult(ReceiveOutcome.MISSING, "the peer does not hold the chunk"))
        elif receipt.length != transfer.size:
            results.append(
                ReceiveResult(ReceiveOutcome.CORRUPT, f"receipt for {receipt.length} bytes, expected {transfer.size}")
            )
        elif payload_checksum(slot_pieces, transfer.size) != receipt.checksum:
            results.append(ReceiveResult(ReceiveOutcome.CORRUPT, "payload checksum mismatch"))
        else:
            results.append(ReceiveResult(ReceiveOutcome.RECEIVED))
    return results


# -- serving side ----------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Link:
    link_id: int
    lifeline: Lifeline
    ep: Any = None  # ucxx Endpoint, once the handshake made it


class UcxServer(PeerServer):
    kind = TransportKind.UCX

    def __init__(self, host: str, port: int, config: TransportConfig) -> None:
        super().__init__(host, port, config)
        self._ucxx: ModuleType | None = None
        self._server: asyncio.Server | None = None
        self._links: dict[int, _Link] = {}
        self._handshakes: set[asyncio.Task] = set()

    @property
    def links(self) -> int:
        return sum(1 for link in self._links.values() if link.ep is not None)

    async def start(self) -> PeerAddress:
        loop = asyncio.get_running_loop()
        self._ucxx = ucx_runtime.acquire(self.config.ucx.options(), self.config.connect_timeout_s)
        try:
            self._server = await loop.create_server(self._lifeline, self.host, self.port, reuse_address=True)
        except OSError as exc:
            self._ucxx = None
            ucx_runtime.release()
            raise ListenError(
                f"cannot listen for UCX peers on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from None
        return PeerAddress(self.host, self._server.sockets[0].getsockname()[1])

    def _lifeline(self) -> Lifeline:
        """A fetcher connected: greet it in a task of ours (closing the server cancels them)."""
        link = _Link(self._new_link_id(), Lifeline())
        link.lifeline.on_lost = lambda: self._drop(link.link_id)
        self._links[link.link_id] = link
        task = asyncio.get_running_loop().create_task(self._handshake(link))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)
        return link.lifeline

    async def _handshake(self, link: _Link) -> None:
        assert self._ucxx is not None
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                length = wire.decode_ucx_hello(await link.lifeline.read_exactly(wire.UCX_HELLO_BYTES))
                address = self._ucxx.get_ucx_address_from_buffer(await link.lifeline.read_exactly(length))
                ep = await self._ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=True)
            if self._links.get(link.link_id) is not link:  # the fetcher left meanwhile
                _abort(ep)
                return
            link.ep = ep
            link.lifeline.write(wire.encode_ucx_welcome(link.link_id, bytes(self._ucxx.get_worker_address())))
        except Exception as exc:  # TimeoutError, PeerError, UCXError
            log.debug("UCX peer server: handshake with a fetcher failed: %s", exc)
            self._drop(link.link_id)
            return
        self.counters.links_accepted += 1

    def _new_link_id(self) -> int:
        while True:  # random: an order meant for a previous incarnation's link finds no link here
            link_id = secrets.randbits(63)
            if link_id and link_id not in self._links:
                return link_id

    def _drop(self, link_id: int) -> None:
        link = self._links.pop(link_id, None)
        if link is None:
            return
        link.lifeline.close()
        if link.ep is not None:
            _abort(link.ep)

    async def _send(self, order: SendOrder, sources: Sequence[Source | None], timeout_s: float) -> SendResult:
        bufs: list[list[memoryview]] = []
        pinned: list[memoryview] = []
        for transfer, source in zip(order.transfers, sources):
            if len(transfer.segments) > wire.MAX_PIECES:
                return SendResult(SendOutcome.INVALID, f"{len(transfer.segments)} segments, at most {wire.MAX_PIECES}")
            if source is None:  # empty messages complete the fetcher's posted receives
                bufs.append([memoryview(bytearray(0)) for _ in transfer.segments])
                continue
            pieces = trim(source.views, source.size)
            plan = wire.plan_pieces(pieces, transfer.segments)
            self.counters.bounced_bytes += plan.bounced_bytes
            bufs.append(plan.buffers)
            pinned.extend(pieces)
        deadline = asyncio.get_running_loop().time() + timeout_s
        failed = await self._post(order, bufs, pinned, deadline)
        if failed:
            return failed
        receipts = []
        for transfer, source in zip(order.transfers, sources):
            if source is None:
                receipts.append(Receipt(transfer.transfer_id, False, 0, 0))
                continue
            checksum = source.checksum  # else hashed now: UCX just read these pages, they are cached
            if checksum is None:
                checksum = payload_checksum(trim(source.views, source.size), source.size)
            receipts.append(Receipt(transfer.transfer_id, True, source.size, checksum))
        return SendResult(SendOutcome.SENT, receipts=tuple(receipts))

    async def _post(
        self, order: SendOrder, bufs: list[list[memoryview]], views: list[memoryview], deadline: float
    ) -> SendResult | None:
        """Send one message per segment of each transfer with its tags; None once all are sent,
        else the failure (the link is dropped: UCX cancels everything on it)."""
        link = self._links.get(order.link_id)
        if link is None or link.ep is None or link.lifeline.lost or not _alive(link.ep):
            if link is not None and link.ep is not None:
                self._drop(order.link_id)
            return SendResult(SendOutcome.NO_LINK, f"no link {order.link_id:#x} (closed, or another incarnation's)")
        ep = link.ep
        loop = asyncio.get_running_loop()
        ops = [
            loop.create_task(ep.send(buf, tag=wire.piece_tag(transfer.transfer_id, i), force_tag=True))
            for transfer, transfer_bufs in zip(order.transfers, bufs)
            for i, buf in enumerate(transfer_bufs)
        ]
        quarantine = None
        try:
            verdict = await flow.wait_transfer(ops, None, deadline)
        finally:
            if not all(op.done() for op in ops):
                self._drop(order.link_id)  # UCX cancels every request on the endpoint
            try:
                await flow.wait_quietly(ops, self.config.settle_timeout_s)
            finally:
                if not all(op.done() for op in ops):
                    quarantine = self.quarantines.add(views, ops)
                    log.error(
                        "UCX sends did not stop within %.1f s: %d bytes quarantined",
                        self.config.settle_timeout_s,
                        quarantine.nbytes,
                    )
        if verdict.stop is flow.Stop.OPS_DONE:
            return None
        self._drop(order.link_id)
        if verdict.stop is flow.Stop.TIMED_OUT:
            return SendResult(
                SendOutcome.TIMED_OUT, "the fetcher did not take the bytes in time", quarantine=quarantine
            )
        return SendResult(
            SendOutcome.FAILED, f"sending to the fetcher failed: {verdict.describe()}", quarantine=quarantine
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._handshakes):
            task.cancel()
        if self._handshakes:
            await asyncio.wait(list(self._handshakes))
        for link_id in list(self._links):
            self._drop(link_id)
        await self.quarantines.wait(self.config.settle_timeout_s)
        if self._ucxx is not None:
            self._ucxx = None
            ucx_runtime.release()
