# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fast path, blocking side: Lookup, Reserve, Commit, Acquire, Release, StoreFromRegion and
LoadToRegion as one packet each way over the session socket instead of a gRPC call each
(gRPC's machinery costs ~0.4 ms a call here; a packet exchange a fraction of it). The daemon
answers with the handler and the status gRPC would give, so callers see the same results and
the same errors.

One request is awaited at a time (the client's lock). A call that fails without its answer
(a timeout, an interrupt, a broken connection) leaves the link `broken`: an answer may still
come, so the session must not be used again (the client drops it, which also frees whatever
the daemon granted it). `sent` then says whether the request had left (a region copy that was
sent and not answered may have copied part of its batch).

Commit and Release can also be *posted* (post()): sent with a call id, their answers read
with the next call's (or by settle()), which saves a store or a load one round trip. That is
safe because the daemon answers them at once, in order, before it reads the next packet: the
session's next call finds them done, and a connection that closes (the client died) still has
them read first, before the session ends. A Commit is posted only after its bytes are copied,
so a lost one leaves a reservation, which the session's end aborts: never unwritten bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf.message import DecodeError, Message

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.errors import DeadlineExceeded, Unavailable, UnknownSession, from_code
from kvstored_client.protocol import FAST_METHODS, FAST_REPLY_MAX, MAX_PACKET, REPLY_TOO_LARGE

log = logging.getLogger(__name__)

ENV = "KVSTORED_FAST_PATH"
POSTABLE = frozenset({"Commit", "Release", "Touch"})  # answered at once and in order by the daemon
_ON = frozenset({"", "1", "true", "on", "yes"})
_OFF = frozenset({"0", "false", "off", "no"})


def fast_path_default() -> bool:
    """Whether clients take the fast path unless told otherwise: KVSTORED_FAST_PATH (default on)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{ENV}={value!r}: expected one of 1/0, true/false, on/off, yes/no")


def _field_tag(kind: str) -> bytes:
    """The wire tag of SessionRequest's field `kind` (a length-delimited message field)."""
    number = pb.SessionRequest.DESCRIPTOR.fields_by_name[kind].number
    return _varint(number << 3 | 2)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# The request is wrapped by hand (tag, length, the request's bytes): the same bytes as
# SessionRequest(kind=request), without copying the request into a new message first.
_TAGS = {method: _field_tag(kind) for method, kind in FAST_METHODS.items()}


_CALL_ID_TAG = _varint(pb.SessionRequest.DESCRIPTOR.fields_by_name["call_id"].number << 3)  # a varint field


def _packet(method: str, request: Message, call_id: int = 0) -> bytes | None:
    """The packet carrying `request` (and `call_id`, echoed in the answer, when not 0); None when
    it does not fit one."""
    body = request.SerializeToString()
    parts = [_TAGS[method], _varint(len(body)), body]
    if call_id:
        parts += [_CALL_ID_TAG, _varint(call_id)]
    data = b"".join(parts)
    return data if len(data) <= MAX_PACKET else None


packet = _packet


def response_of(method: str, reply: pb.SessionReply) -> Any | None:
    """The response a fast-path answer carries; None: ask over gRPC (it did not fit a packet).
    Raises the daemon's error mapped as gRPC's would be, Unavailable for an answer of another kind."""
    kind = reply.WhichOneof("kind")
    if kind == FAST_METHODS[method]:
        return getattr(reply, kind)
    if kind == "error":
        if reply.error.kind == REPLY_TOO_LARGE:
            return None
        raise from_code(reply.error.code, reply.error.message, reply.error.kind)
    raise Unavailable(f"{method}: unexpected answer {kind!r} on the session socket")


class FastLink:
    """One session's fast path over its (blocking) session socket."""

    def __init__(self, sock: socket.socket, serves: Callable[[str], bool] = FAST_METHODS.__contains__) -> None:
        """serves: which methods the daemon answers here (protocol.Welcome.serves_fast)."""
        self._sock = sock
        self.serves = serves
        self._buffer = bytearray(FAST_REPLY_MAX + 1)  # one byte more: a longer packet shows as cut
        self._aio: socket.socket | None = None  # the same connection for an event loop (timeout 0)
        self.broken = False
        self.sent = False  # the last call's request was sent
        self._ids = itertools.count(1)
        # call id -> (method, what its answer is handed to) of each posted request not yet answered
        self._owed: dict[int, tuple[str, Callable[[Any], None] | None]] = {}

    @property
    def owed(self) -> int:
        """Posted requests whose answers have not been read yet."""
        return len(self._owed)

    def close(self) -> None:
        if self._aio is not None:
            self._aio.close()
            self._aio = None

    async def call_async(self, method: str, request: Message, timeout: float) -> Any | None:
        """call() for asyncio: the same answers and errors, awaited on the running loop. A
        cancelled call leaves the link broken (its answer may still come)."""
        data = _packet(method, request)
        if data is None:
            return None
        aio = self._nonblocking()
        loop = asyncio.get_running_loop()
        with self._exchange(method, timeout):
            async with asyncio.timeout(timeout):
                self.sent = False
                await loop.sock_sendall(aio, data)
                self.sent = True
                while True:
                    size = await loop.sock_recv_into(aio, self._buffer)
                    reply = self._reply(method, size)
                    if not self._settled(reply):
                        break
        return self._answer(method, reply)

    def call(self, method: str, request: Message, timeout: float, to_the_end: bool = False) -> Any | None:
        """`method`'s answer to `request`, within `timeout` seconds; None when this call must go
        over gRPC instead (its request or its answer is too large for one packet). Raises what
        the gRPC call would (the daemon's errors mapped the same way); DeadlineExceeded on a
        timeout; UnknownSession when the daemon closed the session (it restarted or stopped).
        to_the_end (region copies): once sent, an interrupt (Ctrl-C) waits for the answer, within
        `timeout`, before it is raised: the daemon may be copying into the caller's region."""
        data = _packet(method, request)
        if data is None:
            return None
        interrupted: BaseException | None = None
        with self._exchange(method, timeout):
            self.sent = False
            self._sock.settimeout(timeout)
            self._sock.send(data)
            self.sent = True
            end = time.monotonic() + timeout
            while True:
                try:
                    size = self._sock.recv_into(self._buffer, len(self._buffer), socket.MSG_TRUNC)
                    reply = self._reply(method, size)
                    if not self._settled(reply):
                        break
                except Exception:
                    if interrupted is not None:
                        raise interrupted from None
                    raise
                except BaseException as exc:  # KeyboardInterrupt
                    if not to_the_end:
                        raise
                    interrupted = exc
                    self._sock.settimeout(max(end - time.monotonic(), 1e-6))
        answer = self._answer(method, reply)
        if interrupted is not None:
            raise interrupted
        return answer

    def post(
        self, method: str, request: Message, timeout: float, on_answer: Callable[[Any], None] | None = None
    ) -> bool:
        """Send a Commit or Release without waiting for its answer (read with the next call's,
        or by settle() or drain(), and handed to `on_answer`: the response, or None for an
        error). False: it does not fit a packet; call() it (over gRPC) instead."""
        if method not in POSTABLE:
            raise ValueError(f"{method} cannot be posted: only {sorted(POSTABLE)} are answered at once")
        call_id = next(self._ids)
        data = _packet(method, request, call_id)
        if data is None:
            return False
        with self._exchange(method, timeout):
            self.sent = False
            self._sock.settimeout(timeout)
            self._sock.send(data)
            self.sent = True
        self._owed[call_id] = (method, on_answer)
        return True

    def settle(self, timeout: float) -> None:
        """Read the answers of the posted requests (before anything else is said on the session
        socket, or over gRPC: what follows must find them done)."""
        if not self._owed:
            return
        with self._exchange("a posted call", timeout):
            self._sock.settimeout(timeout)
            while self._owed:
                size = self._sock.recv_into(self._buffer, len(self._buffer), socket.MSG_TRUNC)
                if not self._settled(self._reply("a posted call", size)):
                    self.broken = True
                    raise Unavailable("unexpected answer on the session socket: no call was waiting for it")

    def _nonblocking(self) -> socket.socket:
        """A second socket object on a dup of the fd, non-blocking (a socket with a timeout
        polls for readability before it reads): for an event loop, and to look without waiting."""
        if self._aio is None:
            self._aio = socket.socket(fileno=os.dup(self._sock.fileno()))
            self._aio.setblocking(False)
        return self._aio

    def closed(self) -> bool:
        """Without blocking: whether the daemon has closed the session (stopped, restarted)."""
        try:
            return not self._nonblocking().recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            return True

    def drain(self) -> None:
        """Without blocking: read the posted requests' answers that have come already (a store
        finds the slots its last Commit reserved ahead)."""
        if not self._owed:
            return
        sock = self._nonblocking()
        with self._exchange("a posted call", 0.0):
            while self._owed:
                try:
                    size = sock.recv_into(self._buffer, len(self._buffer), socket.MSG_TRUNC)
                except BlockingIOError:
                    return
                if not self._settled(self._reply("a posted call", size)):
                    self.broken = True
                    raise Unavailable("unexpected answer on the session socket: no call was waiting for it")

    @contextlib.contextmanager
    def _exchange(self, method: str, timeout: float) -> Iterator[None]:
        """One request and its answer: a failure breaks the link (the stream is out of step, or an
        answer may still come) and is raised as the gRPC call's would be."""
        try:
            yield
        except TimeoutError:
            self.broken = True
            raise DeadlineExceeded(f"{method}: no answer on the session socket within {timeout:.3f} s") from None
        except (BrokenPipeError, ConnectionResetError):
            self.broken = True
            raise UnknownSession(f"{method}: kvstored closed the session (restarted or stopped)") from None
        except OSError as exc:
            self.broken = True
            raise Unavailable(f"{method}: the session socket failed: {exc}") from None
        except BaseException:  # interrupted or cancelled: the answer may still come
            self.broken = True
            raise

    def _settled(self, reply: pb.SessionReply) -> bool:
        """Whether `reply` answers a posted request (read and done with here). A posted call's
        error is only logged: its caller has moved on. (A Commit fails only for handles the
        session does not hold; whatever it does hold is given back when it ends.)"""
        owed = self._owed.pop(reply.call_id, None) if reply.call_id else None
        if owed is None:
            return False
        method, on_answer = owed
        kind = reply.WhichOneof("kind")
        if kind == "error":
            log.warning("posted %s failed: %s: %s", method, reply.error.code, reply.error.message)
        if on_answer is not None:
            on_answer(getattr(reply, kind) if kind == FAST_METHODS[method] else None)
        return True

    def _reply(self, method: str, size: int) -> pb.SessionReply:
        if size == 0:
            self.broken = True
            raise UnknownSession(f"{method}: kvstored closed the session (restarted or stopped)")
        if size > FAST_REPLY_MAX:
            self.broken = True  # (the stream is in step, but the daemon broke its own limit)
            raise Unavailable(f"{method}: the answer ({size} bytes) exceeds {FAST_REPLY_MAX} bytes")
        try:
            return pb.SessionReply.FromString(memoryview(self._buffer)[:size])
        except DecodeError as exc:
            self.broken = True
            raise Unavailable(f"{method}: undecodable answer on the session socket: {exc}") from None

    def _answer(self, method: str, reply: pb.SessionReply) -> Any | None:
        kind = reply.WhichOneof("kind")
        if kind == FAST_METHODS[method]:
            return getattr(reply, kind)
        if kind == "error":
            if reply.error.kind == REPLY_TOO_LARGE:
                return None
            raise from_code(reply.error.code, reply.error.message, reply.error.kind)
        self.broken = True
        raise Unavailable(f"{method}: unexpected answer {kind!r} on the session socket")
