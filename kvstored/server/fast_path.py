# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fast path: the data path's hot calls (Lookup, Reserve, Commit, Acquire, Release, Delete,
and the region copies StoreFromRegion and LoadToRegion) carried over the session socket, one
packet each way, instead of a gRPC call each.

A gRPC unary call over the unix socket costs ~0.4 ms of machinery on both sides, more than the
handler itself and as much as copying a 2 MiB chunk. Here the request is answered by the very
handler gRPC would call (service.KVStoreService) and its errors are mapped by the one error map
(errors.failure_for), so both transports give the same answer, status and message. The request's
session_id is the connection's: the connection *is* the session, so a client can name no other.
A region copy's deadline travels in its request (start_within_ms), as over gRPC; it may wait
long (room, a promotion), so it is answered by a task of its own (session_socket.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf.message import Message

from kvstored.errors import KvstoredError
from kvstored.server.broker import SessionBroker
from kvstored.server.errors import failure_for
from kvstored.server.service import KVStoreService
from kvstored.server.sessions import Session
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.protocol import FAST_METHODS, REPLY_TOO_LARGE

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
KINDS = frozenset(FAST_METHODS.values())  # the SessionRequest fields served here
# Answered at once, in order, before the connection's next packet is read: no task of their own
# needed, and clients may post them without waiting (kvstored_client.fast.FastLink.post).
NEVER_WAIT = frozenset({"commit", "release", "touch"})
# (Every other kind, the region copies included, runs in a task of its own, so a copy waiting
# on a lower tier never holds up the session's other calls.)


Observe = Callable[[str, str, str, float], None]  # (service, method, status code name, seconds)


def _unobserved(service: str, method: str, code: str, seconds: float) -> None:
    pass


class FastPath:
    """Answers one fast-path request of a session: the SessionReply's bytes, never raises.
    `observe` records each call (the daemon's metrics, under the gRPC method's name)."""

    def __init__(self, service: KVStoreService, broker: SessionBroker, observe: Observe = _unobserved) -> None:
        self._broker = broker
        self._observe = observe
        self._handlers: dict[str, tuple[str, Callable[[Any, Any], Awaitable[Message]]]] = {
            kind: (method, getattr(service, method)) for method, kind in FAST_METHODS.items()
        }

    async def answer(self, session: Session, request: pb.SessionRequest, kind: str, limit: int) -> bytes:
        """`limit`: the largest packet the connection can send; a larger answer is given back
        (its handles released) and the client told to ask over gRPC."""
        method, handler = self._handlers[kind]
        started = time.perf_counter()
        code = "OK"
        call_id = request.call_id
        try:
            message = getattr(request, kind)
            message.session_id = session.session_id
            try:
                response = await handler(message, None)  # (the handlers use no gRPC context)
            except asyncio.CancelledError:  # the connection closed, or the daemon stops
                code = "CANCELLED"
                raise
            except Exception as exc:
                failure = failure_for(exc, f"/{SERVICE}/{method}")
                code = failure.code.name
                return _error(code, failure.message, failure.kind, call_id)
            reply = pb.SessionReply(**{kind: response}, call_id=call_id).SerializeToString()
            if len(reply) <= limit:
                return reply
            self._give_back(session, response)
            code = "RESOURCE_EXHAUSTED"
            return _error(
                code,
                f"the {method} answer ({len(reply)} bytes) does not fit one session socket packet ({limit}); "
                f"it was given back: ask over gRPC",
                REPLY_TOO_LARGE,
                call_id,
            )
        finally:
            self._observe(SERVICE, method, code, time.perf_counter() - started)

    def _give_back(self, session: Session, response: Message) -> None:
        """Release what an answer that cannot be sent granted (Reserve's slots, Acquire's leases)."""
        if isinstance(response, pb.ReserveResponse):
            handles = [slot.handle for slot in response.slots if slot.state == pb.SLOT_STATE_RESERVED]
            handles += [slot.handle for slot in response.ahead]
        elif isinstance(response, pb.CommitResponse):
            handles = [slot.handle for slot in response.ahead]
        elif isinstance(response, pb.AcquireResponse):
            handles = [lease.handle for lease in response.leases]
        else:
            return
        try:
            self._broker.release(session, handles)
        except KvstoredError as exc:  # the session closed meanwhile: it gave them back itself
            log.debug("fast path: giving back an unsendable answer: %s", exc)


def _error(code: str, message: str, kind: str, call_id: int) -> bytes:
    error = pb.SessionError(code=code, message=message, kind=kind)
    return pb.SessionReply(error=error, call_id=call_id).SerializeToString()
