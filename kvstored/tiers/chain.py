"""The tier chain: the operations the gRPC service offers, over the RAM tier (the gateway).

Bookkeeping runs on the event loop; byte copies between a client region and the pool run in a
small thread pool (numpy releases the GIL while copying), so a large copy never stalls the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvstored.errors import InvalidRequest, PoolExhausted, RegionFileMissing
from kvstored.namespaces import Namespace
from kvstored.server.sessions import Handle, HandleKind, Session, SessionRegistry
from kvstored.shm.mapping import Region, SharedPool
from kvstored.tiers.base import TierKind
from kvstored.tiers.ram import Extent, RamEntry, RamTier, ReserveOutcome

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SlotGrant:
    outcome: ReserveOutcome
    handle: int = 0
    extents: tuple[Extent, ...] = ()


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    handle: int
    extents: tuple[Extent, ...]


@dataclass(frozen=True, slots=True)
class StoreCounts:
    stored: int = 0
    already_present: int = 0
    dropped: int = 0


class TierChain:
    def __init__(self, ram: RamTier, pool: SharedPool, sessions: SessionRegistry) -> None:
        self.ram = ram
        self._pool = pool
        self._sessions = sessions
        self._copier = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstored-copy")

    # -- lookup / delete ------------------------------------------------------------------

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> list[TierKind]:
        return [TierKind.RAM if self.ram.contains((ns.namespace_id, k)) else TierKind.NONE for k in keys]

    def delete(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return sum(self.ram.delete((ns.namespace_id, k)) for k in keys)

    # -- pool mapping ---------------------------------------------------------------------

    def reserve(self, session: Session, ns: Namespace, keys: Sequence[bytes]) -> list[SlotGrant]:
        grants = []
        for key in keys:
            result = self.ram.reserve((ns.namespace_id, key), ns.chunk_bytes)
            if result.entry is None:
                grants.append(SlotGrant(result.outcome))
                continue
            handle = self._grant(session, HandleKind.RESERVATION, result.entry)
            grants.append(SlotGrant(result.outcome, handle, tuple(self.ram.extents(result.entry))))
        if keys and all(g.outcome is ReserveOutcome.NO_SPACE for g in grants):
            raise PoolExhausted(
                f"no room for {len(keys)} chunk(s) of {ns.chunk_bytes} bytes: the RAM tier "
                f"({self.ram.capacity_bytes} bytes) is held by leases and reservations"
            )
        return grants

    def commit(self, session: Session, handles: Sequence[int]) -> int:
        taken = self._take_all(session, handles, (HandleKind.RESERVATION,))
        for handle in taken:
            self.ram.commit(handle.entry)
        return len(taken)

    def acquire(self, session: Session, ns: Namespace, keys: Sequence[bytes]) -> list[LeaseGrant]:
        """Leases for the leading cached keys; stops at the first miss."""
        grants = []
        for key in keys:
            entry = self.ram.acquire((ns.namespace_id, key))
            if entry is None:
                break
            handle = self._grant(session, HandleKind.LEASE, entry)
            grants.append(LeaseGrant(handle, tuple(self.ram.extents(entry))))
        return grants

    def release(self, session: Session, handles: Sequence[int]) -> int:
        taken = self._take_all(session, handles, (HandleKind.LEASE, HandleKind.RESERVATION))
        for handle in taken:
            self._drop(handle)
        return len(taken)

    def close_session(self, session: Session) -> None:
        for handle in session.handles.values():
            self._drop(handle)
        session.handles.clear()
        for region in session.regions.values():
            region.close()
        session.regions.clear()
        self._sessions.remove(session)

    # -- region registration --------------------------------------------------------------

    def attach_region(self, session: Session, name: str, fd: int) -> Region:
        try:
            region = Region.from_fd(self._sessions.new_id(), name, fd)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        session.regions[region.region_id] = region
        return region

    def attach_region_path(self, session: Session, path: str) -> Region:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RegionFileMissing(f"region file {path!r} does not exist") from None
        except OSError as exc:
            raise InvalidRequest(f"cannot open region file {path!r}: {exc.strerror}") from None
        try:
            return self.attach_region(session, path, fd)
        finally:
            os.close(fd)

    async def store_from_region(
        self, session: Session, ns: Namespace, region: Region, keys: Sequence[bytes], offsets: Sequence[int]
    ) -> StoreCounts:
        _check_offsets(ns, region, keys, offsets)
        stored, present, dropped = [], 0, 0
        for key, offset in zip(keys, offsets):
            result = self.ram.reserve((ns.namespace_id, key), ns.chunk_bytes)
            if result.entry is not None:
                stored.append((result.entry, offset))
            elif result.outcome is ReserveOutcome.ALREADY_PRESENT:
                present += 1
            else:
                dropped += 1
        jobs = [(offset, self.ram.extents(entry)) for entry, offset in stored]
        try:
            await self._copy(_copy_region_to_pool, region.array, self._pool.array, jobs)
        except BaseException:
            for entry, _ in stored:
                self.ram.abort(entry)
            raise
        for entry, _ in stored:
            self.ram.commit(entry)
        return StoreCounts(len(stored), present, dropped)

    async def load_to_region(
        self, session: Session, ns: Namespace, region: Region, keys: Sequence[bytes], offsets: Sequence[int]
    ) -> int:
        _check_offsets(ns, region, keys, offsets)
        leased: list[tuple[RamEntry, int]] = []
        for key, offset in zip(keys, offsets):
            entry = self.ram.acquire((ns.namespace_id, key))
            if entry is None:
                break
            leased.append((entry, offset))
        try:
            jobs = [(offset, self.ram.extents(entry)) for entry, offset in leased]
            await self._copy(_copy_pool_to_region, region.array, self._pool.array, jobs)
        finally:
            for entry, _ in leased:
                self.ram.release(entry)
        return len(leased)

    def close(self) -> None:
        self._copier.shutdown(wait=True)

    # -- helpers --------------------------------------------------------------------------

    async def _copy(self, fn, region: np.ndarray, pool: np.ndarray, jobs) -> None:
        if jobs:
            await asyncio.get_running_loop().run_in_executor(self._copier, fn, region, pool, jobs)

    def _grant(self, session: Session, kind: HandleKind, entry: RamEntry) -> int:
        handle_id = self._sessions.new_id()
        session.handles[handle_id] = Handle(kind, entry)
        return handle_id

    def _take_all(self, session: Session, handles: Sequence[int], kinds) -> list[Handle]:
        """All or nothing: one bad handle leaves every handle of the batch held."""
        if len(set(handles)) != len(handles):
            raise InvalidRequest("the same handle appears twice in one request")
        for handle_id in handles:
            if session.handles.get(handle_id) is None or session.handles[handle_id].kind not in kinds:
                session.take(handle_id, kinds)  # raises HandleNotHeld naming it
        return [session.take(h, kinds) for h in handles]

    def _drop(self, handle: Handle) -> None:
        if handle.kind is HandleKind.LEASE:
            self.ram.release(handle.entry)
        else:
            self.ram.abort(handle.entry)


def _check_offsets(ns: Namespace, region: Region, keys: Sequence[bytes], offsets: Sequence[int]) -> None:
    if len(keys) != len(offsets):
        raise InvalidRequest(f"{len(keys)} keys but {len(offsets)} offsets: give one offset per key")
    for i, offset in enumerate(offsets):
        if offset + ns.chunk_bytes > region.size:
            raise InvalidRequest(
                f"offset {offset} (key {i}) + chunk_bytes {ns.chunk_bytes} is outside region "
                f"{region.region_id} ({region.size} bytes)"
            )


def _copy_region_to_pool(region: np.ndarray, pool: np.ndarray, jobs: list[tuple[int, list[Extent]]]) -> None:
    for offset, extents in jobs:
        for ext in extents:
            pool[ext.offset:ext.offset + ext.length] = region[offset:offset + ext.length]
            offset += ext.length


def _copy_pool_to_region(region: np.ndarray, pool: np.ndarray, jobs: list[tuple[int, list[Extent]]]) -> None:
    for offset, extents in jobs:
        for ext in extents:
            region[offset:offset + ext.length] = pool[ext.offset:ext.offset + ext.length]
            offset += ext.length
