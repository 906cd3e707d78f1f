# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""One connection to one Redis node: pipelined frames out, replies back in order (I/O).

An asyncio Protocol, no task of its own: send() writes a request's frames at once and returns a
future for its replies, which data_received() fills from hiredis' Reader in the order the
requests were sent. Bounded: at most MAX_BUFFERED bytes waiting to leave and MAX_WAITING
requests waiting for replies, past which a request fails at once (a node that stopped reading,
e.g. frozen). A lost connection fails every request waiting on it; abort() (by a caller whose
deadline passed with replies outstanding) drops it at once, buffers and all.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

import hiredis

from kvstored.directory.resp import encode
from kvstored.directory.slots import Address

MAX_BUFFERED = 64 << 20  # bytes written but not yet sent
MAX_WAITING = 100_000  # requests sent, their replies not yet in


class RedisError(Exception):
    """The directory's cluster failed a call (unreachable, an error reply, a protocol error)."""


class ConnectionLost(RedisError, ConnectionError):
    pass


class AuthFailed(RedisError):
    pass


@dataclass(slots=True)
class _Request:
    future: asyncio.Future[list[Any]]
    count: int
    replies: list[Any]


class Connection(asyncio.Protocol):
    def __init__(self, address: Address) -> None:
        self.address = address
        self._reader = hiredis.Reader()
        self._waiting: deque[_Request] = deque()
        self._transport: asyncio.Transport | None = None
        self._lost: BaseException | None = None

    # -- the protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (uvloop's is no asyncio.Transport subclass)

    def data_received(self, data: bytes) -> None:
        reader, waiting = self._reader, self._waiting
        reader.feed(data)
        try:
            while waiting:
                request = waiting[0]
                replies = request.replies
                for _ in range(request.count - len(replies)):
                    reply = reader.gets()
                    if reply is False:
                        return
                    replies.append(reply)
                waiting.popleft()
                if not request.future.done():
                    request.future.set_result(replies)
            if reader.gets() is not False:
                raise RedisError("a reply nobody asked for")
        except (hiredis.ProtocolError, RedisError) as exc:
            self._fail(ConnectionLost(f"{self.name}: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionLost(f"{self.name}: connection lost" + (f" ({exc})" if exc else "")))

    def eof_received(self) -> bool:
        return False  # (close: a node that hung up answers nothing more)

    # -- requests -------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    @property
    def usable(self) -> bool:
        return self._lost is None and self._transport is not None and not self._transport.is_closing()

    def send(self, payload: bytes, count: int) -> asyncio.Future[list[Any]]:
        """Write a request's frames (count replies expected) and return the future of its replies."""
        transport = self._transport
        if self._lost is not None or transport is None or transport.is_closing():
            raise ConnectionLost(f"{self.name}: not connected")
        if len(self._waiting) >= MAX_WAITING or transport.get_write_buffer_size() + len(payload) > MAX_BUFFERED:
            self.abort()
            raise ConnectionLost(f"{self.name}: not reading its requests (backlog full)")
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        try:
            transport.write(payload)
        except RuntimeError as exc:  # (uvloop: a transport closed under us)
            self._fail(ConnectionLost(f"{self.name}: {exc}"))
            raise self._lost or ConnectionLost(self.name) from exc
        self._waiting.append(_Request(future, count, []))
        return future

    def abort(self) -> None:
        self._fail(ConnectionLost(f"{self.name}: dropped"))

    def _fail(self, exc: ConnectionLost) -> None:
        if self._lost is None:
            self._lost = exc
        while self._waiting:
            future = self._waiting.popleft().future
            if not future.done():
                future.set_exception(self._lost)
                future.exception()  # (retrieved: a caller gone by now must not leave a warning)
        if self._transport is not None:
            self._transport.abort()


async def connect(
    address: Address,
    username: str | None,
    password: str | None,
    tls: ssl.SSLContext | None,
) -> Connection:
    """A connection, authenticated (AUTH [user] password) when a password is set. The caller
    bounds the time (asyncio.timeout)."""
    loop = asyncio.get_running_loop()
    host, port = address
    _, conn = await loop.create_connection(
        lambda: Connection(address), host, port, ssl=tls, server_hostname=host if tls is not None else None
    )
    try:
        if password is not None:
            args = (b"AUTH", username, password) if username else (b"AUTH", password)
            (reply,) = await conn.send(encode(*args), 1)
            if isinstance(reply, hiredis.ReplyError):
                # (the reply says WRONGPASS or NOPERM; it never holds the password)
                raise AuthFailed(f"{conn.name}: AUTH refused: {reply}")
    except BaseException:
        conn.abort()
        raise
    return conn


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """Server certificates checked against ca_file (else the system's CAs), host names too."""
    return ssl.create_default_context(cafile=ca_file)
