# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Client sessions and the handles (leases, reservations) and regions they hold: bookkeeping only.

A session lives exactly as long as its connection to the session socket; the session broker
(broker.py) gives back everything it held when it closes, so a killed client never leaks leases.
"""

from __future__ import annotations

import enum
import itertools
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvstored.errors import HandleNotHeld, InvalidRequest, UnknownRegion, UnknownSession, shown
from kvstored.server.credentials import ClientCredentials
from kvstored.shm.mapping import Region
from kvstored.tiers.ram import RamEntry


class HandleKind(enum.Enum):
    LEASE = "lease"
    RESERVATION = "reservation"
    AHEAD = "ahead"  # a reservation whose key its Commit names (a slot reserved ahead)


# What a held handle of each kind is, and how it is given back, for a request that named it wrongly.
_HANDLE_USE = {
    HandleKind.LEASE: "a lease: give it back with Release",
    HandleKind.RESERVATION: "a reservation of a named key: Commit it without keys (or Release it)",
    HandleKind.AHEAD: "a slot reserved ahead: Commit it with its key and namespace_id (or Release it)",
}


@dataclass(slots=True)
class Handle:
    kind: HandleKind
    entry: RamEntry


@dataclass
class Session:
    session_id: str
    client_name: str
    handles: dict[int, Handle] = field(default_factory=dict)
    regions: dict[int, Region] = field(default_factory=dict)
    namespaces: set[str] = field(default_factory=set)  # tenant namespaces this session registered
    tenants: set[str] = field(default_factory=set)  # keys of the tenants whose arenas it may map
    arenas: bool = False  # its client maps tenant arenas (Hello.arenas)
    pins_pool: bool = False  # its client pins the public pool for DMA (Hello.pins_pool)
    closed: bool = False  # its connection ended: a request still in flight must not grant it anything
    ahead: dict[str, int] = field(default_factory=dict)  # namespace id -> slots reserved ahead it holds
    client: ClientCredentials | None = None  # who connected (None: not known, e.g. a unit test's session)

    def check_open(self) -> None:
        if self.closed:
            raise UnknownSession(f"session {self.session_id} closed while the request was in flight")

    def take_all(self, handle_ids: Sequence[int], kinds: tuple[HandleKind, ...]) -> list[Handle]:
        """Remove and return the handles of a batch, all or nothing: one bad handle (unknown,
        of another kind, named twice) leaves every handle of the batch held."""
        if len(set(handle_ids)) != len(handle_ids):
            raise InvalidRequest("the same handle appears twice in one request")
        for handle_id in handle_ids:
            handle = self.handles.get(handle_id)
            if handle is not None and handle.kind not in kinds:
                raise HandleNotHeld(f"handle {handle_id} is {_HANDLE_USE[handle.kind]}; it is still held")
            if handle is None:
                raise HandleNotHeld(
                    f"handle {handle_id} is not held by session {self.session_id} "
                    f"(already released or committed, or never granted)"
                )
        return [self.handles.pop(handle_id) for handle_id in handle_ids]

    def region(self, region_id: int) -> Region:
        try:
            return self.regions[region_id]
        except KeyError:
            raise UnknownRegion(f"region {region_id} is not registered in session {self.session_id}") from None


class SessionRegistry:
    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        # Handle and region ids, unique daemon-wide, and (from a random start) across daemon runs:
        # a client that has not noticed a restart yet must not name one of the new run's handles.
        self._ids = itertools.count(1 + secrets.randbits(62))

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def open(self, client_name: str, arenas: bool = False, pins_pool: bool = False) -> Session:
        session = Session(secrets.token_hex(16), client_name, arenas=arenas, pins_pool=pins_pool)
        self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise UnknownSession(
                f"unknown session {shown(session_id)}: sessions live as long as their connection to the session socket"
            ) from None

    def remove(self, session: Session) -> None:
        self._sessions.pop(session.session_id, None)

    def new_id(self) -> int:
        return next(self._ids)

    def count(self, kind: HandleKind) -> int:
        return sum(1 for s in self._sessions.values() for h in s.handles.values() if h.kind is kind)
