# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Host-RAM tier bookkeeping: which chunk lives in which pool pages, LRU order, leases.

No bytes move here; callers copy through the pool using the extents this returns.

Chunks live in arenas: arena 0 is the public pool every session maps, and each tenant has an
arena of its own (see kvstored/server/tenants.py). There is one capacity and one LRU over all of
them, a page allocator per arena, and quota scopes (a tenant's, a namespace's): a chunk that would
take a scope over its limit evicts that scope's own least recently used chunks first.
Memory: whenever the arenas together hold more than the capacity plus a small slack (a tenant
arena's pages become memory only when first written), free pages of the arena holding the most
are handed to `release` (which returns them to the kernel and calls `released`), so resident
memory stays within the capacity; free pages are otherwise kept for reuse.
Invariants:
- the LRU holds exactly the READY chunks with no leases and no write-down in flight (the
  evictable ones);
- a chunk's pages return to the allocator only once it is out of the index, unleased and not
  being written down.
Write-back (chain/writeback.py) pins the oldest dirty chunks while it writes them to the lower
tiers (`start_writing`), then drops them (`end_writing`) unless they were used meanwhile (a use
sets `touched`). Chunks already held below ("persisted": promoted from a lower tier, or written
down) are dropped as is.
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstored.chunks.ids import ChunkId
from kvstored.shm.allocator import PageAllocator, PageRun
from kvstored.shm.arenas import PUBLIC_ARENA, Extent

# Memory the arenas together may hold beyond the capacity before free pages go back to the
# kernel (a punched hole costs ~0.35 ms per 2 MiB, and a later first write into it runs at ~1/8
# of a copy's speed, so a little is tolerated): 16 MiB, or 1/64 of the tier.
DEFAULT_SLACK_BYTES = 16 << 20
SLACK_FRACTION = 64


class EntryState(enum.Enum):
    RESERVED = enum.auto()  # pages allocated, bytes being written, invisible to readers
    READY = enum.auto()
    HELD = enum.auto()  # a reservation whose writer's session ended: its pages kept, in no index (hold())


class ReserveOutcome(enum.Enum):
    RESERVED = enum.auto()
    ALREADY_PRESENT = enum.auto()
    IN_PROGRESS = enum.auto()
    NO_SPACE = enum.auto()


@dataclass(eq=False, slots=True)
class QuotaScope:
    """A byte quota over some chunks (a tenant's, a namespace's). Its LRU holds the scope's
    evictable chunks, in the order of the tier's LRU."""

    name: str
    limit_pages: int
    used_pages: int = 0
    writing_pages: int = 0  # of chunks being written down (pinned until that ends)
    evictions: int = 0  # chunks evicted to keep this scope within its quota
    lru: OrderedDict[ChunkId, RamEntry] = field(default_factory=OrderedDict)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a namespace's chunks go, and the quotas they count against."""

    arena: int = PUBLIC_ARENA
    scopes: tuple[QuotaScope, ...] = ()


PUBLIC = Placement()


class ResidentListener(Protocol):
    """Told of each chunk that becomes readable in RAM (READY) and of each that stops being so
    (the key indexes clients probe: kvstored/shm/keyindex.py)."""

    def added(self, chunk: ChunkId) -> None: ...

    def removed(self, chunk: ChunkId) -> None: ...


# namespace id -> placement (None: nowhere, e.g. a tenant namespace whose arena is gone)
PlacementOf = Callable[[str], "Placement | None"]
Releaser = Callable[[int, list[PageRun]], None]  # (arena, runs) to return to the kernel


@dataclass(eq=False, slots=True)
class RamEntry:
    chunk: ChunkId
    size: int
    runs: list[PageRun]
    arena: int = PUBLIC_ARENA
    scopes: tuple[QuotaScope, ...] = ()
    pages: int = 0
    state: EntryState = EntryState.RESERVED
    leases: int = 0
    held_leases: int = 0  # of those, kept for readers of sessions a hand-over ended (hold_lease())
    indexed: bool = True
    unkeyed: bool = False  # reserved ahead of its key (reserve_unkeyed), not bound yet
    persisted: bool = False  # a lower tier holds a copy: dropping it loses nothing
    writing: bool = False  # a write-down is reading its pages
    touched: bool = False  # used while being written down: keep it afterwards
    probation: bool = False  # promoted and not yet read: its first release puts it at the cold end
    checksum: int | None = None  # the payload's xxh3-64 once known (a peer send, a hand-over; the bytes never change)
    # False: adopted from a hand-over, its bytes not yet checked against `checksum`; no reader
    # gets it until they are (chain/verify.py), and one that differs is dropped
    verified: bool = True

    @property
    def pinned(self) -> bool:
        return self.leases > 0 or self.writing


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
    writedowns: int = 0
    promotions: int = 0
    verified_chunks: int = 0  # adopted chunks whose bytes were checked and matched their hand-over checksum
    verified_bytes: int = 0
    verify_failures: int = 0  # adopted chunks whose bytes differed: dropped, never served


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """A READY chunk as a hand-over carries it (kvstored/server/handover.py)."""

    chunk: ChunkId
    size: int
    arena: int
    runs: tuple[PageRun, ...]
    persisted: bool
    probation: bool
    checksum: int | None = None  # the payload's xxh3-64, if known


@dataclass(frozen=True, slots=True)
class ArenaPages:
    """An arena's page map as a hand-over carries it: its size in pages and its holes (free
    pages not backed by memory); the chunks' runs are allocated, every other page free."""

    total_pages: int
    holes: tuple[PageRun, ...]


@dataclass(frozen=True, slots=True)
class RamSnapshot:
    page_bytes: int
    capacity_bytes: int
    arenas: dict[int, ArenaPages]
    chunks: list[ChunkRecord]  # least recently used first


@dataclass(frozen=True, slots=True)
class HeldPages:
    """A held reservation's pages (RamTier.hold) as a hand-over carries them."""

    arena: int
    runs: tuple[PageRun, ...]
    namespace_id: str = ""  # whose quotas they count in ("": none)

    @staticmethod
    def of(entry: RamEntry) -> HeldPages:
        return HeldPages(entry.arena, tuple(entry.runs), entry.chunk[0])


@dataclass(frozen=True, slots=True)
class Adopted:
    chunks: int  # adopted READY
    held: list[RamEntry]  # the held pages, as held entries (free them with free_held())


class AdoptionError(ValueError):
    """A snapshot this tier cannot take as it is (its page map or index is inconsistent)."""


@dataclass(frozen=True, slots=True)
class Reservation:
    outcome: ReserveOutcome
    entry: RamEntry | None = None
    evicted: list[ChunkId] = field(default_factory=list)
    over_quota: bool = False  # NO_SPACE within one of the chunk's quota scopes (not the tier)


_CHUNK = operator.attrgetter("chunk")
_SCOPES = operator.attrgetter("scopes")


class RamTier:
    def __init__(
        self,
        pool_bytes: int,
        page_bytes: int,
        has_lower_tiers: bool = False,
        populated: bool = True,
        slack_bytes: int = DEFAULT_SLACK_BYTES,
    ) -> None:
        """pool_bytes: the capacity, and the size of the public arena; populated: whether the
        public arena's memory is resident from the start."""
        self._has_lower = has_lower_tiers
        self.page_bytes = page_bytes
        self._capacity_pages = pool_bytes // page_bytes
        self.capacity_bytes = self._capacity_pages * page_bytes
        self._arenas: dict[int, PageAllocator] = {PUBLIC_ARENA: PageAllocator(self._capacity_pages, populated)}
        self._used_pages = 0  # pages held by chunks, all arenas together
        self._unkeyed_pages = 0  # of those, reservations whose key is not named yet (reserve_unkeyed)
        self._held_pages = 0  # of those, reservations held for a writer that may still write (hold())
        self._held_lease_pages = 0  # chunks leased to a reader of an ended session (hold_lease())
        self._resident_pages = self._arenas[PUBLIC_ARENA].resident_pages  # all arenas together
        self._index: dict[ChunkId, RamEntry] = {}
        self._lru: OrderedDict[ChunkId, RamEntry] = OrderedDict()  # oldest first
        self.counters = RamCounters()
        self._ready = 0  # READY chunks in the index
        self._placement: PlacementOf = lambda _ns: PUBLIC
        self._release: Releaser | None = None  # None: memory is never returned to the kernel
        self._slack_pages = max(1, min(slack_bytes, self.capacity_bytes // SLACK_FRACTION) // page_bytes)
        self._public_releasable = False
        self._releasing_pages = 0  # handed to the releaser, not back yet
        self._unverified = 0  # indexed entries not yet verified (adopted, see RamEntry.verified)
        self._listener: ResidentListener | None = None

    # -- arenas and memory ----------------------------------------------------------------

    def set_placement(self, placement: PlacementOf) -> None:
        self._placement = placement

    def set_listener(self, listener: ResidentListener | None) -> None:
        self._listener = listener

    def set_releaser(self, release: Releaser | None) -> None:
        """`release(arena, runs)` returns pages to the kernel, then calls `released()`."""
        self._release = release

    def set_public_releasable(self, releasable: bool) -> None:
        """Whether the public arena's free pages may be returned to the kernel (never while a
        client has it pinned for DMA: its device would keep writing the old pages)."""
        self._public_releasable = releasable
        self._trim()

    def add_arena(self, arena: int, size_bytes: int) -> None:
        """A sparse arena (no page resident yet)."""
        if arena in self._arenas:
            raise ValueError(f"arena {arena} exists")
        self._arenas[arena] = PageAllocator(size_bytes // self.page_bytes, resident=False)

    def arena_idle(self, arena: int) -> bool:
        """No page of the arena is held by a chunk or being released: it can be removed."""
        alloc = self._arenas.get(arena)
        return alloc is not None and alloc.free_pages == alloc.total_pages

    def remove_arena(self, arena: int) -> None:
        if arena == PUBLIC_ARENA or not self.arena_idle(arena):
            raise ValueError(f"arena {arena} is in use")
        self._resident_pages -= self._arenas.pop(arena).resident_pages

    def released(self, arena: int, runs: list[PageRun], returned: bool = True) -> None:
        """Runs handed to the releaser are done: returned to the kernel (holes now), or not."""
        alloc = self._arenas[arena]
        before = alloc.resident_pages
        alloc.released(runs, returned)
        self._resident_pages += alloc.resident_pages - before
        self._releasing_pages -= sum(run.count for run in runs)

    @property
    def slack_bytes(self) -> int:
        return self._slack_pages * self.page_bytes

    @property
    def resident_bytes(self) -> int:
        """Memory the arenas may hold: pages of chunks, free pages kept for reuse, pages being
        released (pages never written, or returned to the kernel, are not counted)."""
        return self._resident_pages * self.page_bytes

    # -- sizes ----------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used_pages * self.page_bytes

    @property
    def unkeyed_bytes(self) -> int:
        """RAM held by reservations whose key is not named yet (reserve_unkeyed)."""
        return self._unkeyed_pages * self.page_bytes

    @property
    def held_bytes(self) -> int:
        """RAM held for clients whose session ended, until they are done with it: the pages they
        may still write (hold()) and the chunks they may still read (hold_lease())."""
        return (self._held_pages + self._held_lease_pages) * self.page_bytes

    def room_bytes(self, scope: QuotaScope | None = None) -> int:
        """What may still be reserved: in the tier (scope None), or within a quota scope."""
        if scope is None:
            return self.free_bytes
        return max(0, scope.limit_pages - scope.used_pages) * self.page_bytes

    def fits(self, namespace_id: str, size: int) -> bool:
        """Whether a chunk of `size` of the namespace can be reserved now without evicting
        anything: room in the tier, in each of its quotas and in its arena."""
        placement = self._placement(namespace_id)
        alloc = self._arenas.get(placement.arena) if placement is not None else None
        if placement is None or alloc is None:
            return False
        pages = self.pages_for(size)
        return (
            self._capacity_pages - self._used_pages >= pages
            and alloc.free_pages >= pages
            and all(scope.used_pages + pages <= scope.limit_pages for scope in placement.scopes)
        )

    def limit_bytes(self, scope: QuotaScope | None = None) -> int:
        """The most that may be held: the tier's capacity (scope None), or a scope's quota."""
        return self.capacity_bytes if scope is None else scope.limit_pages * self.page_bytes

    def writing_bytes(self, scope: QuotaScope) -> int:
        """Pages of the scope's chunks being written down (their room comes when that ends)."""
        return scope.writing_pages * self.page_bytes

    def placement_of(self, namespace_id: str) -> Placement | None:
        return self._placement(namespace_id)

    @property
    def free_bytes(self) -> int:
        return (self._capacity_pages - self._used_pages) * self.page_bytes

    def pages_for(self, size: int) -> int:
        return -(-size // self.page_bytes)

    @property
    def chunk_count(self) -> int:
        return self._ready

    # -- adopted chunks not yet verified (the checking is chain/verify.py) ---------------------

    @property
    def unverified_count(self) -> int:
        return self._unverified

    def unverified(self, chunks: Sequence[ChunkId] | None = None) -> list[RamEntry]:
        """The entries (of `chunks`, or all) still to be verified."""
        if not self._unverified:
            return []
        if chunks is None:
            return [e for e in self._index.values() if not e.verified]
        return [e for c in chunks if (e := self._index.get(c)) is not None and not e.verified]

    def unhashed(self) -> list[RamEntry]:
        """READY chunks whose checksum is not known (a hand-over takes them)."""
        ready = EntryState.READY
        return [e for e in self._index.values() if e.state is ready and e.checksum is None]

    def verified(self, entry: RamEntry, matches: bool) -> bool:
        """A check's result: the entry is verified, or (its bytes differ) dropped and counted.
        A result for an entry this tier no longer holds, or already checked, changes nothing.
        Returns whether the entry is (still) readable."""
        if not entry.indexed:
            return False
        if entry.verified:
            return True
        if matches:
            self._unverified -= 1
            entry.verified = True
            self.counters.verified_chunks += 1
            self.counters.verified_bytes += entry.size
            return True
        self.counters.verify_failures += 1
        self.delete(entry.chunk)  # (counted off the unverified by _unindex; a leased one is freed at its release)
        return False

    # -- lookups --------------------------------------------------------------------------

    def is_ready(self, chunk: ChunkId) -> bool:
        """A READY chunk, asked without counting a lookup or refreshing its recency."""
        entry = self._index.get(chunk)
        return entry is not None and entry.state is EntryState.READY

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
        index lookups and, in the usual batch, the hits' recency run in C."""
        entries = list(map(self._index.get, zip(itertools.repeat(namespace_id), keys)))
        ready = EntryState.READY
        out = [entry is not None and entry.state is ready for entry in entries]
        hits: list[RamEntry] = list(itertools.compress(entries, out))  # type: ignore[arg-type]  # (no None: out is False for those)
        try:  # the usual batch: every hit in the LRU, none in a quota scope; all in C
            deque(map(self._lru.move_to_end, map(_CHUNK, hits)), maxlen=0)
            scoped = any(map(_SCOPES, hits))
        except KeyError:  # one is leased or being written down (not in the LRU)
            scoped = True
        if scoped:  # once more, entry by entry (moving the same chunks again in order changes nothing)
            for entry in hits:
                self._touch(entry)
        self.counters.lookups += len(out)
        self.counters.hits += len(hits)
        return out

    def count_hits(self, n: int) -> None:
        """Lookups that hit, answered elsewhere (a client's key index)."""
        self.counters.lookups += n
        self.counters.hits += n

    def _touch(self, entry: RamEntry) -> None:
        if entry.chunk in self._lru:
            self._lru.move_to_end(entry.chunk)
            for scope in entry.scopes:
                scope.lru.move_to_end(entry.chunk)
        elif entry.writing:
            entry.touched = True

    # -- reservations ---------------------------------------------------------------------

    def reserve(self, chunk: ChunkId, size: int) -> Reservation:
        existing = self._index.get(chunk)
        if existing is not None:
            if existing.state is EntryState.READY:
                return Reservation(ReserveOutcome.ALREADY_PRESENT)
            return Reservation(ReserveOutcome.IN_PROGRESS)
        reservation = self._allocate(chunk, size)
        if reservation.entry is not None:
            self._index[chunk] = reservation.entry
        return reservation

    def reserve_unkeyed(self, namespace_id: str, size: int) -> Reservation:
        """Pages for a chunk of the namespace whose key is named later (bind()): counted in the
        tier and the namespace's quotas like any reservation, but in no index (nobody can find
        it, nobody else can reserve its key through it) until bound."""
        reservation = self._allocate((namespace_id, b""), size)
        if reservation.entry is not None:
            reservation.entry.indexed = False
            reservation.entry.unkeyed = True
            self._unkeyed_pages += reservation.entry.pages
        return reservation

    def bind(self, entry: RamEntry, chunk: ChunkId) -> ReserveOutcome:
        """Name an unkeyed reservation's chunk: RESERVED (now indexed, to be committed) unless
        RAM holds the key already (ALREADY_PRESENT) or another writer reserved it (IN_PROGRESS);
        then the entry is left as it was, for the caller to abort."""
        if not entry.unkeyed or entry.state is not EntryState.RESERVED or not entry.runs or chunk[0] != entry.chunk[0]:
            raise ValueError("bind of an entry that is not an unkeyed reservation of the chunk's namespace")
        existing = self._index.get(chunk)
        if existing is not None:
            return ReserveOutcome.ALREADY_PRESENT if existing.state is EntryState.READY else ReserveOutcome.IN_PROGRESS
        entry.chunk = chunk
        entry.indexed = True
        entry.unkeyed = False
        self._index[chunk] = entry
        self._unkeyed_pages -= entry.pages
        return ReserveOutcome.RESERVED

    def _allocate(self, chunk: ChunkId, size: int) -> Reservation:
        """Pages for `chunk` in its namespace's arena, evicting what must go (not indexed yet)."""
        placement = self._placement(chunk[0])
        alloc = self._arenas.get(placement.arena) if placement is not None else None
        if placement is None or alloc is None:
            return Reservation(ReserveOutcome.NO_SPACE)
        pages = self.pages_for(size)
        evicted: list[ChunkId] = []
        runs = None
        # Over a quota, the scope's own chunks make room first; then the tier's LRU.
        within_quotas = all(self._fit_scope(scope, pages, evicted) for scope in placement.scopes)
        if within_quotas and self._make_room(pages, evicted) and self._fit_arena(placement.arena, pages, evicted):
            before = alloc.resident_pages
            runs = alloc.allocate(pages)
            if alloc.resident_pages > before:  # it took holes: the arenas hold more memory now
                self._resident_pages += alloc.resident_pages - before
                self._trim(placement.arena)
        if runs is None:
            return Reservation(ReserveOutcome.NO_SPACE, evicted=evicted, over_quota=not within_quotas)
        entry = RamEntry(chunk, size, runs, placement.arena, placement.scopes, pages)
        self._used_pages += pages
        for scope in placement.scopes:
            scope.used_pages += pages
        return Reservation(ReserveOutcome.RESERVED, entry, evicted)

    def commit(self, entry: RamEntry, persisted: bool = False) -> None:
        """Publish a reserved chunk; `persisted` when its bytes came from a lower tier."""
        if entry.state is not EntryState.RESERVED:
            raise ValueError("commit of a chunk that is not reserved")
        entry.state = EntryState.READY
        entry.persisted = entry.probation = persisted
        if not entry.indexed:  # deleted while being written: freed, and counted as nothing stored
            self._free(entry)
            return
        self.counters.written_bytes += entry.size
        if persisted:
            self.counters.promotions += 1
        else:
            self.counters.stored += 1
        self._ready += 1
        self._lru_add(entry)
        if self._listener is not None:
            self._listener.added(entry.chunk)

    def abort(self, entry: RamEntry) -> None:
        self._unreserve(entry, "abort")
        self._free(entry)

    def hold(self, entry: RamEntry) -> None:
        """Keep a reservation's pages from other chunks without its key: its writer may still be
        copying into them (a session ended under it). The key is free to reserve again at once;
        the pages stay counted as used until free_held()."""
        self._unreserve(entry, "hold")
        entry.state = EntryState.HELD
        self._held_pages += entry.pages

    def _unreserve(self, entry: RamEntry, op: str) -> None:
        """A reservation gives up its key (and its unkeyed count); its pages stay for the caller."""
        if entry.state is not EntryState.RESERVED:
            raise ValueError(f"{op} of a chunk that is not reserved")
        if entry.unkeyed:
            entry.unkeyed = False
            self._unkeyed_pages -= entry.pages
        self._unindex(entry)

    def free_held(self, entry: RamEntry) -> None:
        if entry.state is not EntryState.HELD or not entry.runs:
            raise ValueError("free_held of a chunk that is not held (or freed already)")
        self._held_pages -= entry.pages
        self._free(entry)

    # -- leases ---------------------------------------------------------------------------

    def acquire(self, chunk: ChunkId) -> RamEntry | None:
        """Lease a READY chunk: its pages stay put until release()."""
        entry = self.keep(chunk)
        if entry is not None:
            self.counters.loaded += 1
            self.counters.read_bytes += entry.size
        return entry

    def keep(self, chunk: ChunkId) -> RamEntry | None:
        """Lease a READY chunk without counting a load: a reader of an ended session may still be
        copying it out (a hand-over's held lease)."""
        entry = self._index.get(chunk)
        if entry is None or entry.state is not EntryState.READY:
            return None
        entry.leases += 1
        self._lru_remove(entry)
        return entry

    def hold_lease(self, entry: RamEntry) -> None:
        """A lease of an ended session's reader, kept until free_lease(): counted in held_bytes
        (a chunk once, however many such leases it has)."""
        if entry.leases <= entry.held_leases:
            raise ValueError("hold_lease of a chunk that is not leased")
        if not entry.held_leases:
            self._held_lease_pages += entry.pages
        entry.held_leases += 1

    def free_lease(self, entry: RamEntry) -> None:
        entry.held_leases -= 1
        if not entry.held_leases:
            self._held_lease_pages -= entry.pages
        self.release(entry)

    def release(self, entry: RamEntry) -> None:
        if entry.leases <= 0:
            raise ValueError("release of a chunk that is not leased")
        entry.leases -= 1
        if entry.leases:
            return
        if entry.writing:
            entry.touched = True  # the write-down's end decides (chain/writeback.py)
        elif not entry.indexed:
            self._free(entry)
        elif entry.probation:
            # A chunk promoted for one load and read once goes to the cold end: it still has its
            # copy below, and under cyclic reuse (multi-turn sessions larger than RAM) keeping it
            # would push out chunks that hit sooner. A second read treats it like any other.
            entry.probation = False
            self._lru_add(entry, coldest=True)
        else:
            self._lru_add(entry)  # reading it was a use: most recent

    def ready_chunks(self) -> list[ChunkId]:
        return [c for c, e in self._index.items() if e.state is EntryState.READY]

    def chunks_of(self, namespace_id: str) -> list[ChunkId]:
        """Chunks of a namespace, READY or being written (a scan: for admin operations)."""
        return [c for c in self._index if c[0] == namespace_id]

    def usage_by_namespace(self) -> dict[str, tuple[int, int]]:
        """Per namespace: (READY chunks, bytes of pages held by its chunks) (a scan: for admin
        operations)."""
        out: dict[str, tuple[int, int]] = {}
        for (ns, _key), entry in self._index.items():
            chunks, nbytes = out.get(ns, (0, 0))
            out[ns] = (chunks + (entry.state is EntryState.READY), nbytes + entry.pages * self.page_bytes)
        return out

    def attach_scope(self, namespace_id: str, scope: QuotaScope) -> None:
        """Count a namespace's chunks already in RAM against a new quota scope."""
        for chunk in self.chunks_of(namespace_id):
            entry = self._index[chunk]
            entry.scopes = (*entry.scopes, scope)
            scope.used_pages += entry.pages
        for chunk, entry in self._lru.items():  # in LRU order
            if scope in entry.scopes:
                scope.lru[chunk] = entry

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

    # -- write-down pins (the write-back state machine is chain/writeback.py) ------------------

    def lru_head(self, scope: QuotaScope | None = None) -> RamEntry | None:
        """The least recently used evictable chunk (of the tier, or of a quota scope)."""
        return next(iter((self._lru if scope is None else scope.lru).values()), None)

    def lru_newest_first(self) -> Iterator[RamEntry]:
        """The evictable chunks, most recently used first."""
        return reversed(self._lru.values())

    def start_writing(self, entry: RamEntry) -> None:
        """A write-down reads the chunk's pages: it leaves the LRU (pinned) and stays readable."""
        self._lru_remove(entry)
        self._set_writing(entry, True)

    def end_writing(self, entry: RamEntry, keep: bool) -> bool:
        """The write-down ended. The chunk goes back into the LRU if `keep`, else leaves RAM now;
        a leased one stays pinned (its release decides), a deleted one is freed. Returns True if
        it left RAM now (False too for a deleted one: its removal was reported then)."""
        self._set_writing(entry, False)
        if entry.leases:
            return False
        if not entry.indexed:
            self._free(entry)
            return False
        if keep:
            self._lru_add(entry)
            return False
        self.evict(entry)
        return True

    def page_views(self, entry: RamEntry, arena: memoryview) -> list[memoryview]:
        """The chunk's whole pages as views of its arena's mapping `arena` (page-aligned,
        page-multiple lengths)."""
        pb = self.page_bytes
        return [arena[r.start * pb : (r.start + r.count) * pb] for r in entry.runs]

    def extents(self, entry: RamEntry) -> list[Extent]:
        out, remaining = [], entry.size
        for run in entry.runs:
            length = min(run.count * self.page_bytes, remaining)
            out.append(Extent(run.start * self.page_bytes, length, entry.arena))
            remaining -= length
        return out

    # -- hand-over ----------------------------------------------------------------------------

    def snapshot(self) -> RamSnapshot:
        """The READY chunks (evictable ones in LRU order, then any still pinned) and each arena's
        page map. Taken once the daemon has quiesced: no session, no write-down, no release."""
        if self._releasing_pages:
            raise ValueError("snapshot while pages are being released")
        ready = EntryState.READY
        order = list(self._lru.values()) + [
            e for e in self._index.values() if e.state is ready and e.chunk not in self._lru
        ]
        chunks = [
            ChunkRecord(e.chunk, e.size, e.arena, tuple(e.runs), e.persisted, e.probation, e.checksum)
            for e in order
            if e.state is ready and e.indexed
        ]
        arenas = {a: ArenaPages(alloc.total_pages, tuple(alloc.hole_runs())) for a, alloc in self._arenas.items()}
        return RamSnapshot(self.page_bytes, self.capacity_bytes, arenas, chunks)

    def adopt(
        self,
        snapshot: RamSnapshot,
        keep: Callable[[ChunkRecord], bool] = lambda _r: True,
        verify: bool = False,
        held: Sequence[HeldPages] = (),
    ) -> Adopted:
        """Take over a snapshot's chunks into an empty tier whose arenas are already added (the
        adopted arenas' memory): the chunks `keep` accepts become READY in their LRU order,
        the pages of the others free; `held` pages become held entries (hold()). `verify`:
        chunks with a checksum are adopted unverified (RamEntry.verified). AdoptionError if
        anything in it does not add up (this tier is left empty then)."""
        if self._index:
            raise AdoptionError("adoption into a RAM tier that holds chunks")
        if snapshot.page_bytes != self.page_bytes or snapshot.capacity_bytes != self.capacity_bytes:
            raise AdoptionError(
                f"page_bytes/capacity {snapshot.page_bytes}/{snapshot.capacity_bytes} differ from "
                f"{self.page_bytes}/{self.capacity_bytes}"
            )
        if set(snapshot.arenas) != set(self._arenas):
            raise AdoptionError(f"arenas {sorted(snapshot.arenas)} differ from {sorted(self._arenas)}")
        runs_of: dict[int, list[PageRun]] = {arena: [] for arena in self._arenas}
        kept: list[tuple[ChunkRecord, Placement]] = []
        seen: set[ChunkId] = set()
        for record in snapshot.chunks:
            counted = sum(run.count for run in record.runs)
            if record.chunk in seen or record.arena not in runs_of or counted != self.pages_for(record.size):
                raise AdoptionError(f"chunk record {record.chunk!r} is inconsistent")
            seen.add(record.chunk)
            if not keep(record):
                continue
            placement = self._placement(record.chunk[0])
            if placement is None or placement.arena != record.arena:
                raise AdoptionError(f"chunk {record.chunk!r} is in arena {record.arena}, not its namespace's")
            runs_of[record.arena] += record.runs
            kept.append((record, placement))
        for kept_pages in held:
            if kept_pages.arena not in runs_of or not kept_pages.runs:
                raise AdoptionError(f"held pages in arena {kept_pages.arena}, which is not handed over")
            runs_of[kept_pages.arena] += kept_pages.runs
        allocators: dict[int, PageAllocator] = {}
        for arena, map_ in snapshot.arenas.items():
            expected = self._arenas[arena].total_pages
            if map_.total_pages != expected:
                raise AdoptionError(f"arena {arena} has {map_.total_pages} pages, not {expected}")
            try:
                allocators[arena] = PageAllocator.restore(map_.total_pages, runs_of[arena], list(map_.holes))
            except ValueError as exc:
                raise AdoptionError(f"arena {arena}: {exc}") from None
        held_pages = sum(run.count for kept_pages in held for run in kept_pages.runs)
        used = sum(self.pages_for(record.size) for record, _ in kept) + held_pages
        if used > self._capacity_pages:
            raise AdoptionError(f"the chunks hold {used} pages, more than the capacity of {self._capacity_pages}")
        self._arenas = allocators
        self._resident_pages = sum(alloc.resident_pages for alloc in allocators.values())
        for record, placement in kept:
            pages = self.pages_for(record.size)
            entry = RamEntry(record.chunk, record.size, list(record.runs), record.arena, placement.scopes, pages)
            entry.state = EntryState.READY
            entry.persisted, entry.probation = record.persisted, record.probation
            entry.checksum = record.checksum
            if verify and record.checksum is not None:
                entry.verified = False
                self._unverified += 1
            self._index[record.chunk] = entry
            self._used_pages += pages
            for scope in placement.scopes:
                scope.used_pages += pages
            self._ready += 1
            self._lru_add(entry)
            if self._listener is not None:
                self._listener.added(entry.chunk)
        held_entries = []
        for kept_pages in held:
            count = sum(run.count for run in kept_pages.runs)
            placement = self._placement(kept_pages.namespace_id) if kept_pages.namespace_id else None
            scopes = placement.scopes if placement is not None and placement.arena == kept_pages.arena else ()
            chunk = (kept_pages.namespace_id, b"")
            entry = RamEntry(chunk, count * self.page_bytes, list(kept_pages.runs), kept_pages.arena, scopes, count)
            entry.state, entry.indexed = EntryState.HELD, False
            for scope in scopes:  # (as they counted in the daemon that held them first)
                scope.used_pages += count
            held_entries.append(entry)
        self._used_pages += held_pages
        self._held_pages += held_pages
        return Adopted(len(kept), held_entries)

    # -- internals ------------------------------------------------------------------------

    def evict(self, entry: RamEntry) -> None:
        """Drop an unpinned chunk from RAM (counted as an eviction)."""
        if not entry.persisted and self._has_lower:
            self.counters.dropped_dirty += 1
        self._unindex(entry)
        self._free(entry)
        self.counters.evictions += 1

    def _make_room(self, pages: int, evicted: list[ChunkId]) -> bool:
        """Evict LRU chunks (appended to `evicted`) until `pages` are free; False if leases and
        reservations pin too much of the pool."""
        short = pages - (self._capacity_pages - self._used_pages)
        if short <= 0:
            return True
        for entry in self._lru.values():  # oldest first: would evicting these be enough?
            short -= entry.pages
            if short <= 0:
                break
        else:
            return False  # no: evict nothing, a cache entry lost for nothing is worse
        while self._capacity_pages - self._used_pages < pages:
            if not self._lru:
                return False
            victim = next(iter(self._lru.values()))
            self.evict(victim)
            evicted.append(victim.chunk)
        return True

    def _fit_scope(self, scope: QuotaScope, pages: int, evicted: list[ChunkId]) -> bool:
        """Evict the scope's own LRU chunks until `pages` more fit in its quota; False (evicting
        nothing) if its leased and reserved chunks alone leave no room."""
        short = scope.used_pages + pages - scope.limit_pages
        if short <= 0:
            return True
        for entry in scope.lru.values():
            short -= entry.pages
            if short <= 0:
                break
        else:
            return False
        while scope.used_pages + pages > scope.limit_pages:
            victim = next(iter(scope.lru.values()))
            self.evict(victim)
            scope.evictions += 1
            evicted.append(victim.chunk)
        return True

    def _fit_arena(self, arena: int, pages: int, evicted: list[ChunkId]) -> bool:
        """The arena's own free pages may fall short while some are being released (or, for a
        tenant, when its arena is smaller than the capacity): evict its own oldest chunks."""
        alloc = self._arenas[arena]
        if alloc.free_pages >= pages:
            return True
        for victim in [e for e in self._lru.values() if e.arena == arena]:
            self.evict(victim)
            evicted.append(victim.chunk)
            if alloc.free_pages >= pages:
                return True
        return False

    def _set_writing(self, entry: RamEntry, writing: bool) -> None:
        if entry.writing != writing:
            entry.writing = writing
            for scope in entry.scopes:
                scope.writing_pages += entry.pages if writing else -entry.pages

    def _lru_add(self, entry: RamEntry, coldest: bool = False) -> None:
        self._lru[entry.chunk] = entry
        if coldest:
            self._lru.move_to_end(entry.chunk, last=False)
        for scope in entry.scopes:
            scope.lru[entry.chunk] = entry
            if coldest:
                scope.lru.move_to_end(entry.chunk, last=False)

    def _lru_remove(self, entry: RamEntry) -> None:
        if self._lru.pop(entry.chunk, None) is not None:
            for scope in entry.scopes:
                scope.lru.pop(entry.chunk, None)

    def _unindex(self, entry: RamEntry) -> None:
        if entry.indexed:
            entry.indexed = False
            if entry.state is EntryState.READY:
                self._ready -= 1
                if self._listener is not None:
                    self._listener.removed(entry.chunk)
            self._unverified -= not entry.verified
            del self._index[entry.chunk]
            self._lru_remove(entry)

    def _free(self, entry: RamEntry) -> None:
        if not entry.runs:
            return
        self._arenas[entry.arena].free(entry.runs)
        entry.runs = []
        self._used_pages -= entry.pages
        for scope in entry.scopes:
            scope.used_pages -= entry.pages

    def _trim(self, allocated_in: int | None = None) -> None:
        """While the arenas together hold more than the capacity plus the slack, return free
        pages to the kernel, from the arena holding the most (never the one just allocated in,
        whose free pages the rest of its batch wants, nor the public one while it is pinned)."""
        if self._release is None:
            return
        excess = self._resident_pages - self._releasing_pages - self._capacity_pages - self._slack_pages
        while excess > 0:
            candidates = [
                (alloc.resident_free_pages, arena)
                for arena, alloc in self._arenas.items()
                if alloc.resident_free_pages
                and arena != allocated_in
                and (arena != PUBLIC_ARENA or self._public_releasable)
            ]
            if not candidates:
                return
            free, arena = max(candidates)
            self._give_back(arena, min(free, excess))
            excess -= min(free, excess)

    def _give_back(self, arena: int, pages: int) -> None:
        if pages <= 0 or self._release is None:
            return
        runs = self._arenas[arena].take_resident(pages)
        if runs:
            self._releasing_pages += sum(run.count for run in runs)
            self._release(arena, runs)
