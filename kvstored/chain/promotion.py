# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Chunks coming up into RAM from the tiers below, and the deletes they must not undo.

- Promoter: finds chunks below RAM (one batched `contains` per tier) and copies hits up into RAM,
  verified by the tier, at load priority.
- DeletionGuard: chunks and namespaces being deleted; nothing is found below or promoted for them
  meanwhile.
Bookkeeping only, on the event loop; the bytes move in the tiers' own I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvstored.chain.lower import ArenaView, LowerTier
from kvstored.chunks.ids import ChunkId, TierKind
from kvstored.events.bus import Cause, EventBus, EventType
from kvstored.io.scheduler import Priority
from kvstored.tiers.ram import RamTier, ReserveOutcome

log = logging.getLogger(__name__)


@dataclass(eq=False)
class DeletionWatch:
    """A read of `chunk` outside RAM (staging): `deleted` once a delete of it began meanwhile."""

    chunk: ChunkId
    deleted: bool = False


class DeletionGuard:
    """Chunks and namespaces being deleted. Nothing is found below or promoted for them until the
    delete has removed every copy: a read racing the delete would bring the deleted bytes back.
    Reads that land outside RAM are watched: a delete that begins while one runs marks it."""

    def __init__(self) -> None:
        self._chunks: Counter[ChunkId] = Counter()
        self._namespaces: Counter[str] = Counter()
        self._watches: set[DeletionWatch] = set()

    def blocks(self, chunk: ChunkId) -> bool:
        return bool(self._chunks[chunk] or self._namespaces[chunk[0]])

    def add_watch(self, chunk: ChunkId) -> DeletionWatch:
        """Watch `chunk` until drop_watch()."""
        watch = DeletionWatch(chunk, self.blocks(chunk))
        self._watches.add(watch)
        return watch

    def drop_watch(self, watch: DeletionWatch) -> None:
        self._watches.discard(watch)

    @contextlib.contextmanager
    def chunks(self, chunks: Sequence[ChunkId]):
        self._chunks.update(chunks)
        if self._watches:
            deleting = set(chunks)
            for watch in self._watches:
                watch.deleted |= watch.chunk in deleting
        try:
            yield
        finally:
            self._chunks.subtract(chunks)
            self._chunks = +self._chunks  # drop the zeros

    @contextlib.contextmanager
    def namespace(self, namespace_id: str):
        self._namespaces[namespace_id] += 1
        for watch in self._watches:
            watch.deleted |= watch.chunk[0] == namespace_id
        try:
            yield
        finally:
            self._namespaces[namespace_id] -= 1
            if not self._namespaces[namespace_id]:
                del self._namespaces[namespace_id]


class Promoter:
    def __init__(
        self, ram: RamTier, arena_view: ArenaView, lower: Sequence[LowerTier], events: EventBus, deleting: DeletionGuard
    ) -> None:
        self._events = events
        self._ram = ram
        self._arena_view = arena_view
        self._lower = list(lower)
        self._deleting = deleting
        self._in_flight: dict[ChunkId, tuple[asyncio.Future, TierKind]] = {}

    def in_flight(self, chunk: ChunkId) -> TierKind:
        entry = self._in_flight.get(chunk)
        return entry[1] if entry else TierKind.NONE

    def pending(self, chunk: ChunkId) -> asyncio.Future | None:
        """The promotion of `chunk` under way (as start() returns it), if any."""
        entry = self._in_flight.get(chunk)
        return entry[0] if entry else None

    async def find(self, chunks: Sequence[ChunkId], local_only: bool = False) -> list[int | None]:
        """Index of the first lower tier holding each chunk (None: nowhere). `local_only`: only
        tiers whose chunks are on this node (what peers are served from: never a peer tier)."""
        found: list[int | None] = [None] * len(chunks)
        todo = [i for i, chunk in enumerate(chunks) if not self._deleting.blocks(chunk)]
        for index, lower in enumerate(self._lower):
            if not todo:
                break
            if local_only and not lower.capabilities.local:
                continue
            try:
                present = await lower.timed("lookup", lower.tier.contains([chunks[i] for i in todo]))
            except Exception as exc:  # a failing tier is a miss, never an error for the caller
                log.warning("%s lookup failed: %s", lower.tier.name, exc)
                continue
            for i, hit in zip(list(todo), present):
                if hit:
                    found[i] = index
            todo = [i for i in todo if found[i] is None]
        return found

    def start(self, chunk: ChunkId, size: int, tier_index: int, evict: bool = True) -> asyncio.Future | None:
        """Begin copying `chunk` up from lower tier `tier_index`; the future resolves to True
        once it is READY in RAM (False if it could not be promoted). Without `evict`, only free
        RAM is used, within the namespace's quotas too (prefetch must not push out chunks a load
        is about to need, nor a quota's chunks before their write-down)."""
        if chunk in self._in_flight:
            return self._in_flight[chunk][0]
        if self._deleting.blocks(chunk):
            return None
        if not evict and not self._ram.fits(chunk[0], size):
            return None
        reservation = self._ram.reserve(chunk, size)
        if reservation.evicted:
            self._events.publish(EventType.REMOVED, Cause.EVICTED, "ram", TierKind.RAM, reservation.evicted)
        if reservation.outcome is ReserveOutcome.ALREADY_PRESENT:  # landed meanwhile
            landed: asyncio.Future = asyncio.get_running_loop().create_future()
            landed.set_result(True)
            return landed
        if reservation.entry is None:
            return None
        entry = reservation.entry
        lower = self._lower[tier_index]
        views = self._ram.page_views(entry, self._arena_view(entry.arena))
        read = lower.queue.submit(Priority.LOAD, lambda: lower.timed_read(lower.tier.read(chunk, views, size), size))
        if read is None:  # (loads are never refused: only write-downs and deletions have a backlog bound)
            self._ram.abort(entry)
            return None
        result: asyncio.Future = asyncio.get_running_loop().create_future()
        self._in_flight[chunk] = (result, lower.tier.kind)

        def done(future: asyncio.Future) -> None:
            ok = not future.cancelled() and future.exception() is None and bool(future.result())
            if not future.cancelled() and future.exception() is not None:
                log.warning("promotion from %s failed: %s", lower.tier.name, future.exception())
            if ok:
                deleted = not entry.indexed  # deleted while it was read: commit() just frees it
                self._ram.commit(entry, persisted=True)
                ok = not deleted
                if ok:
                    self._events.publish_soon(EventType.STORED, Cause.PROMOTED, "ram", TierKind.RAM, [chunk])
            else:
                # A network read that could not be stopped may still write these pages (peer tier):
                # the slot stays reserved (invisible, not reusable) until it cannot.
                busy = lower.tier.views_busy(views)
                if busy is None:
                    self._ram.abort(entry)
                else:
                    busy.add_done_callback(lambda _: self._ram.abort(entry))
            del self._in_flight[chunk]
            if not result.done():
                result.set_result(ok)

        read.add_done_callback(done)
        return result
