"""Moving chunks between the RAM tier and the tiers below it.

- WriteBack: keeps some RAM free by writing the oldest dirty chunks down to every lower tier
  that accepts write-downs before their RAM copy is dropped (write-back), or copies each new
  chunk down at once (write-through). A chunk whose write-down is refused (backlog full) or
  fails is simply dropped.
- Promoter: finds chunks below RAM (one batched `contains` per tier) and copies hits up into RAM,
  verified by the tier, at load priority.
Both only do bookkeeping on the event loop; the bytes move in the tiers' own I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvstored.choices import Choice
from kvstored.io.scheduler import Priority, TierQueue
from kvstored.observability.events import Cause, EventBus, EventType
from kvstored.tiers.base import ChunkId, SecondaryTier, TierCapabilities, TierKind, WriteOutcome
from kvstored.tiers.ram import QuotaScope, RamEntry, RamTier, ReserveOutcome

log = logging.getLogger(__name__)
T = TypeVar("T")


class WritePolicy(Choice):
    WRITE_BACK = "write-back"
    WRITE_THROUGH = "write-through"


OpObserver = Callable[[str, str, float], None]  # (tier name, op, seconds)
ArenaView = Callable[[int], memoryview]  # arena id -> the daemon's mapping of it


def _ignore(tier: str, op: str, seconds: float) -> None:
    pass


@dataclass(frozen=True)
class Removal:
    gone: list[bool]  # per chunk: a copy was there and is gone now
    failures: list[BaseException]


@dataclass
class LowerTier:
    tier: SecondaryTier
    queue: TierQueue
    capabilities: TierCapabilities = field(default_factory=TierCapabilities)  # what the chain asks of it
    observe: OpObserver = _ignore  # the daemon plugs its latency histograms in here

    async def timed(self, op: str, awaitable: Awaitable[T]) -> T:
        """Await one tier operation, reporting how long it took (queue wait not included)."""
        start = time.perf_counter()
        try:
            return await awaitable
        finally:
            self.observe(self.tier.name, op, time.perf_counter() - start)

    async def remove_all(self, chunks: Sequence[ChunkId]) -> Removal:
        """Remove chunks at deletion priority (behind loads and write-downs already queued),
        concurrently within the tier's bound. A delete is never skipped: with the backlog full,
        it runs directly. Every removal has ended when this returns, failed ones included."""
        def remove(chunk: ChunkId):
            return self.timed("remove", self.tier.remove(chunk))

        queued = [self.queue.submit(Priority.DELETE, functools.partial(remove, c)) for c in chunks]
        results = await asyncio.gather(*(q if q is not None else remove(c) for q, c in zip(queued, chunks)),
                                       return_exceptions=True)
        return Removal([r is True for r in results], [r for r in results if isinstance(r, BaseException)])


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
    ) -> None:
        self._events = events
        self._ram = ram
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
                    self._ram.begin_writeback(entry)
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
        self, nbytes: int, chunk_bytes: int, deadline: float | None = None, scope: QuotaScope | None = None,
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
            for entry in self._ram.dirty_entries():
                while not all(lower.queue.has_room(Priority.WRITEDOWN) for lower in self._lower):
                    if not await self._wait_for_space(deadline):
                        return sum(e.persisted for e in flushed)
                if not entry.indexed or entry.persisted or entry.writing:  # deleted or written meanwhile
                    continue
                self._ram.begin_writeback(entry)
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
        to_write, evicted = self._ram.writeback_victims(shortfall, scope)
        if evicted:
            self._events.publish(EventType.REMOVED, Cause.EVICTED, "ram", TierKind.RAM, evicted)
        for entry in to_write:
            self._write_down(entry)

    def _write_down(self, entry: RamEntry) -> list[tuple[TierQueue, asyncio.Future]]:
        views = self._ram.page_views(entry, self._arena_view(entry.arena))
        futures = []
        for lower in self._lower:
            job = _write_job(lower, entry, views, self._events)
            future = lower.queue.submit(Priority.WRITEDOWN, job)
            if future is not None:
                futures.append((lower.queue, future))
        if not futures:  # every tier is behind: this chunk is dropped (counted by the queues)
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
        if self._ram.finish_writeback(entry, persisted):
            self._events.publish(EventType.REMOVED, Cause.EVICTED, "ram", TierKind.RAM, [entry.chunk])
        self._writing_bytes -= nbytes
        self._space.set()


@dataclass(eq=False)
class _WriteDown:
    entry: RamEntry
    nbytes: int
    tiers: int  # write-downs submitted
    outcomes: list[WriteOutcome] = field(default_factory=list)


def _write_job(lower: LowerTier, entry: RamEntry, views: list[memoryview], events: EventBus):
    chunk = entry.chunk

    async def job() -> WriteOutcome:
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
    def __init__(self, ram: RamTier, arena_view: ArenaView, lower: Sequence[LowerTier], events: EventBus,
                 deleting: DeletionGuard) -> None:
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
        read = lower.queue.submit(Priority.LOAD, lambda: lower.timed("read", lower.tier.read(chunk, views, size)))
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
