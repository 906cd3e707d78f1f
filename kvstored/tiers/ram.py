"""Host-RAM tier bookkeeping: which chunk lives in which pool pages, LRU order, leases.

No bytes move here; callers copy through the pool using the extents this returns.
Invariants:
- the LRU holds exactly the READY chunks with no leases and no write-down in flight (the
  evictable ones);
- a chunk's pages return to the allocator only once it is out of the index, unleased and not
  being written down.
Write-back: the chain's evictor pins the oldest dirty chunks (`begin_writeback`), writes them to
the lower tiers, then drops them (`finish_writeback`) unless they were used meanwhile. Chunks
already held below ("persisted": promoted from a lower tier, or written down) are dropped as is.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from kvstored.shm.allocator import PageAllocator, PageRun
from kvstored.tiers.base import ChunkId


class EntryState(enum.Enum):
    RESERVED = enum.auto()  # pages allocated, bytes being written, invisible to readers
    READY = enum.auto()


class ReserveOutcome(enum.Enum):
    RESERVED = enum.auto()
    ALREADY_PRESENT = enum.auto()
    IN_PROGRESS = enum.auto()
    NO_SPACE = enum.auto()


@dataclass(eq=False, slots=True)
class RamEntry:
    chunk: ChunkId
    size: int
    runs: list[PageRun]
    state: EntryState = EntryState.RESERVED
    leases: int = 0
    indexed: bool = True
    persisted: bool = False  # a lower tier holds a copy: dropping it loses nothing
    writing: bool = False  # a write-down is reading its pages
    touched: bool = False  # used while being written down: keep it afterwards
    probation: bool = False  # promoted and not yet read: its first release puts it at the cold end

    @property
    def pinned(self) -> bool:
        return self.leases > 0 or self.writing


@dataclass(frozen=True, slots=True)
class Extent:
    offset: int
    length: int


@dataclass(slots=True)
class RamCounters:
    lookups: int = 0
    hits: int = 0
    evictions: int = 0
    stored: int = 0
    loaded: int = 0
    written_bytes: int = 0  # chunk bytes committed (stored or promoted)
    read_bytes: int = 0  # chunk bytes leased out to readers
    dropped_dirty: int = 0  # evicted before a lower tier had a copy (only counted with lower tiers)
    writebacks: int = 0
    promotions: int = 0


@dataclass(frozen=True, slots=True)
class Reservation:
    outcome: ReserveOutcome
    entry: RamEntry | None = None
    evicted: list[ChunkId] = field(default_factory=list)


class RamTier:
    def __init__(self, pool_bytes: int, page_bytes: int, has_lower_tiers: bool = False) -> None:
        self._has_lower = has_lower_tiers
        self.page_bytes = page_bytes
        self.capacity_bytes = (pool_bytes // page_bytes) * page_bytes
        self._alloc = PageAllocator(pool_bytes // page_bytes)
        self._index: dict[ChunkId, RamEntry] = {}
        self._lru: OrderedDict[ChunkId, RamEntry] = OrderedDict()  # oldest first
        self.counters = RamCounters()
        self._ready = 0  # READY chunks in the index

    @property
    def used_bytes(self) -> int:
        return (self._alloc.total_pages - self._alloc.free_pages) * self.page_bytes

    @property
    def free_bytes(self) -> int:
        return self._alloc.free_pages * self.page_bytes

    def pages_for(self, size: int) -> int:
        return -(-size // self.page_bytes)

    @property
    def chunk_count(self) -> int:
        return self._ready

    def contains(self, chunk: ChunkId, touch: bool = True) -> bool:
        """A READY chunk; a hit refreshes its recency."""
        self.counters.lookups += 1
        entry = self._index.get(chunk)
        if entry is None or entry.state is not EntryState.READY:
            return False
        self.counters.hits += 1
        if touch:
            self._touch(entry)
        return True

    def contains_many(self, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        """`contains` for a batch in one pass (lookups of hundreds of keys per engine step): the
        index lookups run in C (map over zip), only the hits' recency is Python."""
        entries = list(map(self._index.get, zip(itertools.repeat(namespace_id), keys)))
        ready = EntryState.READY
        out = [entry is not None and entry.state is ready for entry in entries]
        move_to_end = self._lru.move_to_end
        for entry, hit in zip(entries, out):
            if hit:
                try:
                    move_to_end(entry.chunk)
                except KeyError:  # leased or being written down: not in the LRU
                    if entry.writing:
                        entry.touched = True
        self.counters.lookups += len(out)
        self.counters.hits += sum(out)
        return out

    def _touch(self, entry: RamEntry) -> None:
        if entry.chunk in self._lru:
            self._lru.move_to_end(entry.chunk)
        elif entry.writing:
            entry.touched = True

    def reserve(self, chunk: ChunkId, size: int) -> Reservation:
        existing = self._index.get(chunk)
        if existing is not None:
            if existing.state is EntryState.READY:
                return Reservation(ReserveOutcome.ALREADY_PRESENT)
            return Reservation(ReserveOutcome.IN_PROGRESS)
        pages = self.pages_for(size)
        evicted: list[ChunkId] = []
        runs = self._alloc.allocate(pages) if self._make_room(pages, evicted) else None
        if runs is None:
            return Reservation(ReserveOutcome.NO_SPACE, evicted=evicted)
        entry = RamEntry(chunk, size, runs)
        self._index[chunk] = entry
        return Reservation(ReserveOutcome.RESERVED, entry, evicted)

    def commit(self, entry: RamEntry, persisted: bool = False) -> None:
        """Publish a reserved chunk; `persisted` when its bytes came from a lower tier."""
        if entry.state is not EntryState.RESERVED:
            raise ValueError("commit of a chunk that is not reserved")
        entry.state = EntryState.READY
        entry.persisted = entry.probation = persisted
        self.counters.written_bytes += entry.size
        if persisted:
            self.counters.promotions += 1
        else:
            self.counters.stored += 1
        if entry.indexed:
            self._ready += 1
            self._lru[entry.chunk] = entry
        else:  # deleted while being written
            self._free(entry)

    def abort(self, entry: RamEntry) -> None:
        if entry.state is not EntryState.RESERVED:
            raise ValueError("abort of a chunk that is not reserved")
        self._unindex(entry)
        self._free(entry)

    def acquire(self, chunk: ChunkId) -> RamEntry | None:
        """Lease a READY chunk: its pages stay put until release()."""
        entry = self._index.get(chunk)
        if entry is None or entry.state is not EntryState.READY:
            return None
        entry.leases += 1
        self._lru.pop(chunk, None)
        self.counters.loaded += 1
        self.counters.read_bytes += entry.size
        return entry

    def release(self, entry: RamEntry) -> None:
        if entry.leases <= 0:
            raise ValueError("release of a chunk that is not leased")
        entry.leases -= 1
        if entry.leases:
            return
        if entry.writing:
            entry.touched = True  # finish_writeback decides
        elif not entry.indexed:
            self._free(entry)
        elif entry.probation:
            # A chunk promoted for one load and read once goes to the cold end: it still has its
            # copy below, and under cyclic reuse (multi-turn sessions larger than RAM) keeping it
            # would push out chunks that hit sooner. A second read treats it like any other.
            entry.probation = False
            self._lru[entry.chunk] = entry
            self._lru.move_to_end(entry.chunk, last=False)
        else:
            self._lru[entry.chunk] = entry  # reading it was a use: most recent

    def ready_chunks(self) -> list[ChunkId]:
        return [c for c, e in self._index.items() if e.state is EntryState.READY]

    def chunks_of(self, namespace_id: str) -> list[ChunkId]:
        """Chunks of a namespace, READY or being written (a scan: for admin operations)."""
        return [c for c in self._index if c[0] == namespace_id]

    def delete(self, chunk: ChunkId) -> bool:
        """Remove a chunk; True if a READY one was there. A chunk still being written (a promotion
        or a client's reservation) is unindexed too, so its commit frees it instead of bringing a
        deleted chunk back."""
        entry = self._index.get(chunk)
        if entry is None:
            return False
        ready = entry.state is EntryState.READY
        self._unindex(entry)
        if ready and not entry.pinned:
            self._free(entry)
        return ready

    # -- write-back -------------------------------------------------------------------------

    def writeback_victims(self, bytes_wanted: int) -> tuple[list[RamEntry], list[ChunkId]]:
        """Oldest first, until `bytes_wanted` bytes are covered: clean chunks are evicted now
        (returned as ids), dirty ones are pinned for write-down (returned as entries)."""
        to_write: list[RamEntry] = []
        evicted: list[ChunkId] = []
        covered = 0
        while covered < bytes_wanted and self._lru:
            _, entry = self._lru.popitem(last=False)
            covered += sum(r.count for r in entry.runs) * self.page_bytes
            if entry.persisted:
                self._evict(entry)
                evicted.append(entry.chunk)
            else:
                entry.writing, entry.touched = True, False
                to_write.append(entry)
        return to_write, evicted

    def dirty_entries(self) -> list[RamEntry]:
        """READY chunks with no copy below and no write-down running, most recently used first."""
        return [entry for entry in reversed(self._lru.values()) if not entry.persisted]

    def begin_writeback(self, entry: RamEntry) -> None:
        """Pin a chunk for a write-through copy (it stays readable, not evictable)."""
        self._lru.pop(entry.chunk, None)
        entry.writing, entry.touched = True, True

    def finish_writeback(self, entry: RamEntry, persisted: bool) -> bool:
        """End a write-down. Returns True if the chunk left RAM now (it was a victim, unused
        since); False too for a chunk deleted meanwhile (its removal was reported then)."""
        entry.writing = False
        entry.persisted = entry.persisted or persisted
        if persisted:
            self.counters.writebacks += 1
        if entry.leases:
            return False
        if not entry.indexed:
            self._free(entry)
            return False
        if entry.touched:
            self._lru[entry.chunk] = entry
            return False
        self._evict(entry)
        return True

    def page_views(self, entry: RamEntry, pool: memoryview) -> list[memoryview]:
        """The chunk's whole pages as views of `pool` (page-aligned, page-multiple lengths)."""
        pb = self.page_bytes
        return [pool[r.start * pb:(r.start + r.count) * pb] for r in entry.runs]

    def _evict(self, entry: RamEntry) -> None:
        if not entry.persisted and self._has_lower:
            self.counters.dropped_dirty += 1
        self._unindex(entry)
        self._free(entry)
        self.counters.evictions += 1

    def extents(self, entry: RamEntry) -> list[Extent]:
        out, remaining = [], entry.size
        for run in entry.runs:
            length = min(run.count * self.page_bytes, remaining)
            out.append(Extent(run.start * self.page_bytes, length))
            remaining -= length
        return out

    def _make_room(self, pages: int, evicted: list[ChunkId]) -> bool:
        """Evict LRU chunks (appended to `evicted`) until `pages` are free; False if leases and
        reservations pin too much of the pool."""
        short = pages - self._alloc.free_pages
        if short <= 0:
            return True
        for entry in self._lru.values():  # oldest first: would evicting these be enough?
            short -= sum(r.count for r in entry.runs)
            if short <= 0:
                break
        else:
            return False  # no: evict nothing, a cache entry lost for nothing is worse
        while self._alloc.free_pages < pages:
            if not self._lru:
                return False
            _, victim = self._lru.popitem(last=False)
            self._evict(victim)
            evicted.append(victim.chunk)
        return True

    def _unindex(self, entry: RamEntry) -> None:
        if entry.indexed:
            entry.indexed = False
            self._ready -= entry.state is EntryState.READY
            del self._index[entry.chunk]
            self._lru.pop(entry.chunk, None)

    def _free(self, entry: RamEntry) -> None:
        self._alloc.free(entry.runs)
        entry.runs = []
