# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The session broker: maps sessions, their handles and their regions onto the tier chain.

The chain grants RAM entries (reservations, leases) and copies between a region and the pool;
this is where those grants get the ids a client names them by, and where they are given back
when the session ends. Two rules the chain cannot know about are kept here:
- a session that closes while one of its requests waits (for room, a promotion, a copy slot) is
  granted nothing: every chain call gets `session.check_open` as its `proceed` check, so what
  the chain took for it is given back, and the caller gets UnknownSession;
- a batch of handles is taken all or nothing (Session.take_all).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvstored.chain.chain import Proceed, StoreOutcomes, TierChain
from kvstored.chunks.ids import TierKind
from kvstored.errors import InvalidRequest, TransferNotStarted
from kvstored.namespaces import Namespace
from kvstored.observability.snapshot import SessionCounts
from kvstored.server.held_writes import HeldWrites
from kvstored.server.sessions import Handle, HandleKind, Session, SessionRegistry
from kvstored.server.tenants import Tenancy
from kvstored.shm.mapping import Region
from kvstored.tiers.ram import Extent, RamEntry, ReserveOutcome
from kvstored_client.kinds import DropReason

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Slot:
    """A Reserve outcome; RESERVED slots carry the handle to Commit or Release."""

    outcome: ReserveOutcome
    handle: int = 0
    extents: tuple[Extent, ...] = ()
    present_in: TierKind = TierKind.NONE  # ALREADY_PRESENT: the tier holding it
    drop: DropReason = DropReason.NONE  # IN_PROGRESS, NO_SPACE: why it is not stored


@dataclass(frozen=True, slots=True)
class Lease:
    handle: int
    extents: tuple[Extent, ...]


class SessionBroker:
    def __init__(
        self,
        chain: TierChain,
        sessions: SessionRegistry | None = None,
        tenancy: Tenancy | None = None,
        held: HeldWrites | None = None,
    ) -> None:
        self._chain = chain
        self.sessions = sessions or SessionRegistry()
        self._tenancy = tenancy
        self.held = held  # where an ended session's slots go while its client may still write them
        self._holding = False  # hold_writes(): sessions ended from now on keep their slots held
        # Regions are populated in the background, one at a time; close() waits for them.
        self._populator = ThreadPoolExecutor(1, thread_name_prefix="kvstored-populate")
        self._populating: set[asyncio.Future] = set()

    # -- sessions -------------------------------------------------------------------------

    def open(self, client_name: str, arenas: bool = False, pins_pool: bool = False) -> Session:
        session = self.sessions.open(client_name, arenas, pins_pool)
        if self._tenancy is not None:
            self._tenancy.session_opened(session)
        return session

    def get(self, session_id: str) -> Session:
        return self.sessions.get(session_id)

    def optional(self, session_id: str) -> Session | None:
        """The session named, or None when no id is given (calls that work without one)."""
        return self.sessions.get(session_id) if session_id else None

    def close_session(self, session: Session) -> None:
        """End a session: requests still in flight for it get nothing from now on, and everything
        it holds is given back."""
        session.closed = True
        writes, leased = [], []
        for handle in session.handles.values():
            if not self._holding:
                self._drop(handle)
            elif handle.kind is HandleKind.LEASE:
                leased.append(handle.entry)  # (its lease goes on, held)
            else:
                writes.append(handle.entry)
        session.handles.clear()
        if (writes or leased) and self.held is not None:
            self.held.hold(session.session_id, session.client.pid if session.client else 0, writes, leased=leased)
        for region in session.regions.values():
            region.close()
        session.regions.clear()
        self.sessions.remove(session)
        if self._tenancy is not None:  # after its handles: its tenants' arenas may be idle now
            self._tenancy.session_closed(session)

    def hold_writes(self) -> None:
        """A hand-over ends the sessions from now on: their clients may be copying into their
        slots or out of their leased chunks, so those are held (held_writes.py), not freed."""
        self._holding = self.held is not None

    def released(self, session: Session, session_ids: Sequence[str]) -> None:
        """The session's client is done with sessions a hand-over ended (Hello.released_sessions)."""
        if self.held is not None and session_ids:
            self.held.release(session.client.pid if session.client else 0, session_ids)

    def counts(self) -> SessionCounts:
        return SessionCounts(
            sessions=len(self.sessions),
            leases=self.sessions.count(HandleKind.LEASE),
            reservations=self.sessions.count(HandleKind.RESERVATION),
            ahead_slots=self.sessions.count(HandleKind.AHEAD),
            regions=sum(len(s.regions) for s in self.sessions),
        )

    async def close(self) -> None:
        """After the sessions have ended: wait for the populates still running (their regions
        are closed, so each stops within a step), drop the queued ones."""
        self._populator.shutdown(wait=False, cancel_futures=True)
        if self._populating:
            await asyncio.wait(self._populating)

    # -- pool mapping ---------------------------------------------------------------------

    async def reserve(self, session: Session, ns: Namespace, keys: Sequence[bytes]) -> list[Slot]:
        grants = await self._chain.reserve(ns, keys, session.check_open)
        return [
            Slot(g.outcome, self._grant(session, HandleKind.RESERVATION, g.entry), g.extents)
            if g.entry is not None
            else Slot(g.outcome, present_in=g.present_in, drop=g.drop)
            for g in grants
        ]

    def commit(self, session: Session, handles: Sequence[int]) -> int:
        taken = session.take_all(handles, (HandleKind.RESERVATION,))
        return self._chain.commit([h.entry for h in taken])

    def reserve_ahead(self, session: Session, ns: Namespace, count: int) -> list[Slot]:
        """Slots reserved ahead for the session's later stores in `ns`, up to what a session may
        hold (TierChain.ahead_limit) and what all sessions may (TierChain.ahead_room); they count
        against RAM and the namespace's quotas like any reservation and are freed when the
        session ends."""
        session.check_open()
        held = session.ahead.get(ns.namespace_id, 0)
        allowed = min(count, self._chain.ahead_limit(ns) - held, self._chain.ahead_room(ns))
        grants = self._chain.reserve_ahead(ns, max(0, allowed))
        if grants:
            session.ahead[ns.namespace_id] = held + len(grants)
        return [
            Slot(ReserveOutcome.RESERVED, self._grant(session, HandleKind.AHEAD, g.entry), g.extents) for g in grants
        ]

    def commit_ahead(
        self, session: Session, ns: Namespace, handles: Sequence[int], keys: Sequence[bytes]
    ) -> list[ReserveOutcome]:
        """Publish slots reserved ahead in `ns` under `keys` (one per handle, all or nothing)."""
        if len(keys) != len(handles):
            raise InvalidRequest(f"{len(keys)} keys for {len(handles)} handles: name one key per handle")
        for handle_id in handles:
            handle = session.handles.get(handle_id)
            if handle is not None and handle.kind is HandleKind.AHEAD and handle.entry.chunk[0] != ns.namespace_id:
                raise InvalidRequest(f"handle {handle_id} was reserved ahead in another namespace")
        taken = session.take_all(handles, (HandleKind.AHEAD,))
        self._count_ahead(session, ns.namespace_id, -len(taken))
        return self._chain.commit_ahead(ns, [h.entry for h in taken], keys)

    async def acquire(self, session: Session, ns: Namespace, keys: Sequence[bytes]) -> list[Lease]:
        grants = await self._chain.acquire(ns, keys, session.check_open)
        return [Lease(self._grant(session, HandleKind.LEASE, g.entry), g.extents) for g in grants]

    def release(self, session: Session, handles: Sequence[int]) -> int:
        """Give back leases and reservations, those made ahead included (a released reservation
        is never committed)."""
        taken = session.take_all(handles, (HandleKind.LEASE, HandleKind.RESERVATION, HandleKind.AHEAD))
        for handle in taken:
            if handle.kind is HandleKind.AHEAD:
                self._count_ahead(session, handle.entry.chunk[0], -1)
            self._drop(handle)
        return len(taken)

    # -- regions --------------------------------------------------------------------------

    def attach_region(self, session: Session, name: str, fd: int) -> Region:
        """Map a client's region file (the caller keeps `fd`) and populate it in the background."""
        try:
            region = Region.from_fd(self.sessions.new_id(), name, fd)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        session.regions[region.region_id] = region
        future = asyncio.get_running_loop().run_in_executor(self._populator, region.populate)
        self._populating.add(future)
        future.add_done_callback(functools.partial(self._populated, session, region))
        return region

    async def store_from_region(
        self,
        session: Session,
        ns: Namespace,
        region: Region,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        start_by: float | None = None,
    ) -> StoreOutcomes:
        """start_by (loop time): copy nothing after it (and wait for room no longer)."""
        return await self._chain.store_from_region(
            ns, region, keys, offsets, self._proceed(session, start_by), start_by
        )

    async def load_to_region(
        self,
        session: Session,
        ns: Namespace,
        region: Region,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        start_by: float | None = None,
    ) -> int:
        """start_by (loop time): copy nothing after it (and wait for promotions no longer)."""
        return await self._chain.load_to_region(ns, region, keys, offsets, self._proceed(session, start_by), start_by)

    # -- helpers --------------------------------------------------------------------------

    def _grant(self, session: Session, kind: HandleKind, entry: RamEntry) -> int:
        handle_id = self.sessions.new_id()
        session.handles[handle_id] = Handle(kind, entry)
        return handle_id

    @staticmethod
    def _count_ahead(session: Session, namespace_id: str, change: int) -> None:
        left = session.ahead.get(namespace_id, 0) + change
        if left > 0:
            session.ahead[namespace_id] = left
        else:
            session.ahead.pop(namespace_id, None)

    def _drop(self, handle: Handle) -> None:
        if handle.kind is HandleKind.LEASE:
            self._chain.release([handle.entry])
        else:
            self._chain.abort([handle.entry])

    @staticmethod
    def _proceed(session: Session, start_by: float | None) -> Proceed:
        def proceed() -> None:
            session.check_open()  # it may have closed (and its regions with it) while the chain waited
            if start_by is not None and asyncio.get_running_loop().time() > start_by:
                raise TransferNotStarted("the transfer could not start within start_within_ms; nothing was copied")

        return proceed

    def _populated(self, session: Session, region: Region, future: asyncio.Future) -> None:
        self._populating.discard(future)
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            log.debug("region %d (%s): background populate done", region.region_id, region.name)
        elif region.region_id not in session.regions:  # closed under it: the failure is expected
            log.debug("region %d (%s): populate ended by the region's close: %r", region.region_id, region.name, error)
        else:
            log.warning("region %d (%s): background populate failed: %r", region.region_id, region.name, error)
