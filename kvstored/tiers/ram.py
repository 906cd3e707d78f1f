"""Host-RAM tier bookkeeping: which chunk lives in which pool pages, LRU order, leases.

No bytes move here; callers copy through the pool using the extents this returns.
Invariants:
- the LRU holds exactly the READY chunks with no leases (the evictable ones);
- a chunk's pages return to the allocator only once it is out of the index and unleased.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

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


@dataclass(frozen=True, slots=True)
class Reservation:
    outcome: ReserveOutcome
    entry: RamEntry | None = None
    evicted: list[ChunkId] = field(default_factory=list)


class RamTier:
    def __init__(self, pool_bytes: int, page_bytes: int) -> None:
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
    def chunk_count(self) -> int:
        return self._ready

    def contains(self, chunk: ChunkId, touch: bool = True) -> bool:
        """A READY chunk; a hit refreshes its recency."""
        self.counters.lookups += 1
        entry = self._index.get(chunk)
        if entry is None or entry.state is not EntryState.READY:
            return False
        self.counters.hits += 1
        if touch and chunk in self._lru:
            self._lru.move_to_end(chunk)
        return True

    def reserve(self, chunk: ChunkId, size: int) -> Reservation:
        existing = self._index.get(chunk)
        if existing is not None:
            if existing.state is EntryState.READY:
                return Reservation(ReserveOutcome.ALREADY_PRESENT)
            return Reservation(ReserveOutcome.IN_PROGRESS)
        pages = -(-size // self.page_bytes)
        evicted: list[ChunkId] = []
        runs = self._alloc.allocate(pages) if self._make_room(pages, evicted) else None
        if runs is None:
            return Reservation(ReserveOutcome.NO_SPACE, evicted=evicted)
        entry = RamEntry(chunk, size, runs)
        self._index[chunk] = entry
        return Reservation(ReserveOutcome.RESERVED, entry, evicted)

    def commit(self, entry: RamEntry) -> None:
        if entry.state is not EntryState.RESERVED:
            raise ValueError("commit of a chunk that is not reserved")
        entry.state = EntryState.READY
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
        return entry

    def release(self, entry: RamEntry) -> None:
        if entry.leases <= 0:
            raise ValueError("release of a chunk that is not leased")
        entry.leases -= 1
        if entry.leases:
            return
        if entry.indexed:
            self._lru[entry.chunk] = entry  # reading it was a use: most recent
        else:
            self._free(entry)

    def delete(self, chunk: ChunkId) -> bool:
        entry = self._index.get(chunk)
        if entry is None or entry.state is not EntryState.READY:
            return False
        self._unindex(entry)
        if not entry.leases:
            self._free(entry)
        return True

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
        if pages > self._alloc.total_pages:
            return False
        while self._alloc.free_pages < pages:
            if not self._lru:
                return False
            _, victim = self._lru.popitem(last=False)
            self._unindex(victim)
            self._free(victim)
            self.counters.evictions += 1
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
