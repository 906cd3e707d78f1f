# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A TCP connection beside each UCX endpoint: it carries the handshake (worker addresses, link id)
and then only tells either side at once when the other's process is gone (EOF/RST).

Why not ucxx's own listener/create_endpoint: its handshake (exchange_peer_info) receives into a
local buffer under a timeout, and when that timeout fires while the peer is still answering (a
loaded or resumed peer) the process crashes (segfault, reproduced here with a 20 ms connect
timeout against a live peer). Endpoints made from worker addresses need no UCX handshake, and
this socket is ours to time out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvstored.peer.errors import PeerUnreachable


class Lifeline(asyncio.Protocol):
    def __init__(self, on_lost: Callable[[], None] | None = None) -> None:
        self.on_lost = on_lost  # called once, on the loop, when the connection ends
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._wake()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._wake()
        if self.on_lost is not None:
            callback, self.on_lost = self.on_lost, None
            callback()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read_exactly(self, n: int) -> bytes:
        """The next `n` bytes (bound it with a timeout); PeerUnreachable if the connection ends."""
        while len(self._buffer) < n:
            if self.lost:
                raise PeerUnreachable("the peer closed the connection during the handshake")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    def write(self, data: bytes) -> None:
        if self.transport is None or self.lost:
            raise PeerUnreachable("the connection is closed")
        self.transport.write(data)

    def close(self) -> None:
        self.on_lost = None
        if self.transport is not None:
            self.transport.close()

    def unexpected_data(self) -> bool:
        """Bytes after the handshake: the other side is not speaking this protocol."""
        return bool(self._buffer)
