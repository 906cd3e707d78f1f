# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Write-back: chunks leaving RAM go down to the tiers below first.

WriteBack keeps some RAM free by writing the oldest dirty chunks down to every lower tier that
accepts write-downs before their RAM copy is dropped (write-back), or copies each new chunk down
at once (write-through). A chunk whose write-down is refused (backlog full) or fails is simply
dropped. WriteBackState is the state machine (which chunks go down, what becomes of them after);
RamTier only pins and unpins their pages. Bookkeeping only, on the event loop; the bytes move in
the tiers' own I/O.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstored.chain.lower import ArenaView, LowerTier
from kvstored.choices import Choice
from kvstored.chunks.ids import ChunkId, TierKind
from kvstored.events.bus import Cause, EventBus, EventType
from kvstored.io.scheduler import Priority, TierQueue
from kvstored.tiers.base import WriteOutcome
from kvstored.tiers.ram import QuotaScope, RamEntry, RamTier

if TYPE_CHECKING:
    from kvstored.chain.verify import ChunkVerifier

log = logging.getLogger(__name__)

Admits = Callable[[LowerTier, ChunkId], bool]  # whether a chunk goes down to that tier


def _admit_all(lower: LowerTier, chunk: ChunkId) -> bool:
    return True


class WritePolicy(Choice):
    WRITE_BACK = "write-back"
    WRITE_THROUGH = "write-through"


class WriteBackState:
    """The write-back state machine over RAM's chunks (bookkeeping only: WriteBack does the I/O).

    A READY chunk is dirty until a lower tier holds a copy (`persisted`). A write-down pins it
    (RamTier.start_writing) either as a victim, dropped once written unless used meanwhile (a
    use sets `touched`), or as a keeper (write-through, the flush at stop), back in the LRU
    afterwards. Clean chunks are never written down: making room evicts them as they are.
    """

    def __init__(self, ram: RamTier) -> None:
        self._ram = ram

    def victims(self, bytes_wanted: int, scope: QuotaScope | None = None) -> tuple[list[RamEntry], list[ChunkId]]:
        """Oldest first (of the tier, or of a quota scope), until `bytes_wanted` bytes are
        covered: clean chunks are evicted now (returned as ids), dirty ones are pinned for
        write-down as victims (returned as entries)."""
        ram = self._ram
        to_write: list[RamEntry] = []
        evicted: list[ChunkId] = []
        covered = 0
        while covered < bytes_wanted and (entry := ram.lru_head(scope)) is not None:
            covered += entry.pages * ram.page_bytes
            if entry.persisted:
                ram.evict(entry)
                evicted.append(entry.chunk)
            else:
                ram.start_writing(entry)
                entry.touched = False
                to_write.append(entry)
        return to_write, evicted

    def dirty(self) -> list[RamEntry]:
        """READY chunks with no copy below and no write-down running, most recently used first."""
        return [entry for entry in self._ram.lru_newest_first() if not entry.persisted]

    def begin_keeping(self, entry: RamEntry) -> None:
        """Pin a chunk for a copy it keeps after (write-through, flush): readable, not evictable."""
        self._ram.start_writing(entry)
        entry.touched = True

    def finish(self, entry: RamEntry, persisted: bool) -> bool:
        """End a write-down. Returns True if the chunk left RAM now (a victim, unused since);
        False too for a chunk deleted meanwhile (its removal was reported then)."""
        entry.persisted = entry.persisted or persisted
        if persisted:
            self._ram.counters.writedowns += 1
        return self._ram.end_writing(entry, keep=entry.touched)


class WriteBack:
    def __init__(
        self,
        ram: RamTier,
        arena_view: ArenaView,
        lower: Sequence[LowerTier],
        policy: WritePolicy,
        headroom_bytes: int,
        wait_s: float,
        events: EventBus,
        admits: Admits = _admit_all,
        verifier: ChunkVerifier | None = None,
    ) -> None:
        self._verifier = verifier  # an adopted chunk is checked before it is written down
        self._events = events
        self._admits = admits  # a tier that cannot beat recomputing a chunk is not written to
        self._ram = ram
        self.state = WriteBackState(ram)
        self._arena_view = arena_view
        self._lower = [t for t in lower if t.capabilities.accepts_writedowns]
        self.policy = policy
        self._headroom = headroom_bytes
        # Write-downs that keep every I/O slot of the tiers busy (see _ahead).
        self._depth = max((t.queue.concurrency for t in self._lower), default=0)
        self._wait_s = wait_s
        self._writing_bytes = 0
        self._space = asyncio.Event()  # set whenever a write-down finishes

    @property
    def in_flight_bytes(self) -> int:
        return self._writing_bytes

    def after_commit(self, entries: Sequence[RamEntry]) -> None:
        """Called once new chunks are READY: copy them down (write-through) or keep headroom."""
        if not self._lower:
            return
        if self.policy is WritePolicy.WRITE_THROUGH:
            for entry in entries:
                if entry.indexed:
                    self.state.begin_keeping(entry)
                    self._write_down(entry)
        self._keep_headroom(self._headroom)

    def deadline(self) -> float:
        """When a wait for room that starts now gives up (loop time)."""
        return asyncio.get_running_loop().time() + self._wait_s

    def start_room(self, nbytes: int, chunk_bytes: int, scope: QuotaScope | None = None) -> None:
        """Start the write-downs that will free `nbytes` (and, in the tier, keep the pipeline
        full behind them, see _ahead) without waiting for them. `scope` as for make_room."""
        if self._lower and self._ram.room_bytes(scope) < nbytes:
            self._keep_headroom(nbytes + self._ahead(chunk_bytes, scope), scope)

    async def make_room(
        self,
        nbytes: int,
        chunk_bytes: int,
        deadline: float | None = None,
        scope: QuotaScope | None = None,
    ) -> bool:
        """Before reserving `nbytes` (in chunks of `chunk_bytes`): start write-downs for the
        shortfall and wait (until `deadline`, by default the configured wait from now) for them,
        so stores don't evict chunks that have no copy below yet. `scope`: room within a quota
        (a tenant's, a namespace's), made by writing down that scope's own oldest chunks.

        While it waits, write-downs beyond the shortfall keep the tiers' I/O slots busy: the next
        store's room is on its way while this one copies, instead of starting only when it asks.

        Returns whether the room is there now; False once it gives up (nothing being written
        down that could free it, or the deadline passed)."""
        if not self._lower:
            return self._ram.room_bytes(scope) >= nbytes
        loop = asyncio.get_running_loop()
        deadline = self.deadline() if deadline is None else deadline
        while self._ram.room_bytes(scope) < nbytes:
            self._keep_headroom(nbytes + self._ahead(chunk_bytes, scope), scope)
            remaining = deadline - loop.time()
            writing = self._writing_bytes if scope is None else self._ram.writing_bytes(scope)
            if writing == 0 or remaining <= 0:
                return False  # reserve() evicts what it must; dirty drops are counted there
            self._space.clear()
            try:
                await asyncio.wait_for(self._space.wait(), remaining)
            except TimeoutError:
                return False
        return True

    def _ahead(self, chunk_bytes: int, scope: QuotaScope | None = None) -> int:
        """Room to free beyond a store's shortfall while RAM is short: the configured headroom,
        and at least one write-down per I/O slot of the lower tiers (their queue's concurrency),
        so the disk never idles between one store's write-downs and the next one's. At most a
        quarter of RAM (a small pool would otherwise be written out whole). Within a quota
        scope, none: a scope's write-downs free only its shortfall (its own oldest chunks), the
        tier's room that follows keeps the pipeline full."""
        if scope is not None:
            return 0
        pipeline = self._depth * self._ram.pages_for(chunk_bytes) * self._ram.page_bytes
        return max(self._headroom, min(pipeline, self._ram.capacity_bytes // 4))

    async def flush(self, budget_s: float) -> int:
        """At shutdown: write down chunks that have no copy below, most recently used first, for
        up to `budget_s` (then the rest is lost with RAM). Returns how many were written down."""
        if not self._lower or budget_s <= 0:
            return 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget_s
        flushed: list[RamEntry] = []
        queued: list[tuple[TierQueue, asyncio.Future]] = []
        try:
            for entry in self.state.dirty():
                while not all(lower.queue.has_room(Priority.WRITEDOWN) for lower in self._lower):
                    if not await self._wait_for_space(deadline):
                        return sum(e.persisted for e in flushed)
                if not entry.indexed or entry.persisted or entry.writing:  # deleted or written meanwhile
                    continue
                self.state.begin_keeping(entry)
                queued += self._write_down(entry)
                flushed.append(entry)
            while self._writing_bytes and await self._wait_for_space(deadline):
                pass
            return sum(e.persisted for e in flushed)
        finally:
            # Out of time: what has not started never will (a delete queued behind it, and the
            # stop itself, must not wait for it).
            for queue, future in queued:
                queue.withdraw(future)

    async def _wait_for_space(self, deadline: float) -> bool:
        """Wait until a write-down ends; False once the deadline has passed."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return False
        self._space.clear()
        try:
            await asyncio.wait_for(self._space.wait(), remaining)
        except TimeoutError:
            return False
        return True

    def _keep_headroom(self, wanted_free: int, scope: QuotaScope | None = None) -> None:
        writing = self._writing_bytes if scope is None else self._ram.writing_bytes(scope)
        shortfall = wanted_free - self._ram.room_bytes(scope) - writing
        if shortfall <= 0:
            return
        to_write, evicted = self.state.victims(shortfall, scope)
        if evicted:
            self._events.publish(EventType.REMOVED, Cause.EVICTED, "ram", TierKind.RAM, evicted)
        for entry in to_write:
            self._write_down(entry)

    def _write_down(self, entry: RamEntry) -> list[tuple[TierQueue, asyncio.Future]]:
        views = self._ram.page_views(entry, self._arena_view(entry.arena))
        futures = []
        for lower in self._lower:
            if not self._admits(lower, entry.chunk):
                continue
            job = _write_job(lower, entry, views, self._events, self._verifier)
            future = lower.queue.submit(Priority.WRITEDOWN, job)
            if future is not None:
                futures.append((lower.queue, future))
        if not futures:  # every tier is behind, or skipped it: this chunk is dropped (counted)
            self._finish(entry, [], 0)
            return []
        write = _WriteDown(entry, self._ram.pages_for(entry.size) * self._ram.page_bytes, len(futures))
        self._writing_bytes += write.nbytes
        for _, future in futures:
            future.add_done_callback(functools.partial(self._one_done, write))
        return futures

    def _one_done(self, write: _WriteDown, future: asyncio.Future) -> None:
        if future.cancelled():
            write.outcomes.append(WriteOutcome.FAILED)
        elif future.exception() is not None:
            log.warning("write-down of a chunk failed: %s", future.exception())
            write.outcomes.append(WriteOutcome.FAILED)
        else:
            write.outcomes.append(future.result())
        if len(write.outcomes) == write.tiers:
            self._finish(write.entry, write.outcomes, write.nbytes)

    def _finish(self, entry: RamEntry, outcomes: list[WriteOutcome], nbytes: int) -> None:
        persisted = any(o in (WriteOutcome.WRITTEN, WriteOutcome.ALREADY_PRESENT) for o in outcomes)
        if self.state.finish(entry, persisted):
            self._events.publish(EventType.REMOVED, Cause.EVICTED, "ram", TierKind.RAM, [entry.chunk])
        self._writing_bytes -= nbytes
        self._space.set()


@dataclass(eq=False)
class _WriteDown:
    entry: RamEntry
    nbytes: int
    tiers: int  # write-downs submitted
    outcomes: list[WriteOutcome] = field(default_factory=list)


def _write_job(
    lower: LowerTier, entry: RamEntry, views: list[memoryview], events: EventBus, verifier: ChunkVerifier | None
):
    chunk = entry.chunk

    async def job() -> WriteOutcome:
        if not entry.verified and verifier is not None:
            await verifier.check_entries([entry])  # (altered: dropped, so unindexed below)
        if not entry.indexed:  # deleted while queued: writing it now would bring it back
            return WriteOutcome.FAILED
        outcome = await lower.timed("write", lower.tier.write(chunk, views, entry.size))
        if not entry.indexed:  # deleted while being written: undo
            if lower.capabilities.accepts_deletes:
                await lower.timed("remove", lower.tier.remove(chunk))
            return WriteOutcome.FAILED
        if outcome is WriteOutcome.WRITTEN:
            events.publish(EventType.STORED, Cause.WRITTEN_DOWN, lower.tier.name, lower.tier.kind, [chunk])
        return outcome

    return job
