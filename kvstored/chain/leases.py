# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Leases on RAM chunks for readers: the one place that leases the chunks a request names and
promotes from below what RAM lacks.

Every reader goes through here: a load into the pool or a region (Reach.LEADING: the leading
run of chunks, up to the first found nowhere, since an engine can use nothing past it), a peer's
fetch (Reach.EACH: every chunk this node holds itself, each on its own), and a region load past
a full RAM (chain/region_load.py), which stages what it cannot promote and so uses the building
blocks (pin, locate, promote, land) rather than `lease`.

Leased chunks are pinned, so promoting the rest can only evict chunks further on, which the next
round promotes again (a few rounds at most while RAM holds the batch).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstored.chain.promotion import Promoter
from kvstored.chain.room import RamRoom
from kvstored.chain.start_by import StartWaits, check_started
from kvstored.chunks.ids import ChunkId, TierKind
from kvstored.namespaces import Namespace
from kvstored.shm.arenas import ArenaSet, Extent
from kvstored.tiers.ram import RamEntry, RamTier

if TYPE_CHECKING:
    from kvstored.chain.verify import ChunkVerifier

ROUNDS = 4  # lease-then-promote rounds for a leading run (see the module docstring)


class Reach(enum.Enum):
    """Which of a request's chunks it wants."""

    LEADING = enum.auto()  # a load: the leading run; the first chunk found nowhere ends it
    EACH = enum.auto()  # a peer's fetch: every chunk that can be had, each on its own


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    reach: Reach = Reach.LEADING
    # Loop time. LEADING: waits for lower tiers end here with TransferNotStarted. EACH: promotions
    # that have not landed by then are misses.
    start_by: float | None = None
    local_only: bool = False  # only tiers whose chunks are on this node (what peers are served from)


@dataclass(frozen=True, slots=True)
class Leased:
    """Per key of the request, in order: its leased RAM entry, or None. LEADING: the leased
    ones are the leading run (None from the first miss on)."""

    entries: list[RamEntry | None]

    @property
    def held(self) -> list[RamEntry]:
        return [e for e in self.entries if e is not None]


class Leases:
    def __init__(
        self,
        ram: RamTier,
        arenas: ArenaSet,
        promoter: Promoter,
        room: RamRoom,
        waits: StartWaits,
        has_lower: bool,
        verifier: ChunkVerifier | None = None,
    ) -> None:
        self._verifier = verifier  # adopted chunks are checked before their first lease
        self._ram = ram
        self._arenas = arenas
        self._promoter = promoter
        self._room = room
        self._waits = waits
        self._has_lower = has_lower

    async def lease(self, ns: Namespace, keys: Sequence[bytes], request: LeaseRequest = LeaseRequest()) -> Leased:
        """Lease what RAM holds of `keys`, promote from below what it lacks (writing dirty chunks
        down for the room first, as a store would) and lease what lands."""
        chunks = [(ns.namespace_id, k) for k in keys]
        entries: list[RamEntry | None] = [None] * len(chunks)
        await self.check(chunks)
        try:
            for _round in range(ROUNDS if request.reach is Reach.LEADING else 1):
                todo = self._pin_wanted(chunks, entries, request.reach)
                if not todo or not self._has_lower:
                    break
                landed = await self._promote_wanted(ns, chunks, todo, request)
                if request.reach is Reach.EACH:
                    for i in landed:
                        entries[i] = self.pin(chunks[i])
                elif not landed or landed[0] != todo[0]:  # the first one did not land: the run ends there
                    break
        except BaseException:
            self.release([e for e in entries if e is not None])
            raise
        return Leased(entries)

    def _pin_wanted(self, chunks: list[ChunkId], entries: list[RamEntry | None], reach: Reach) -> list[int]:
        """Lease what RAM holds now; return the indexes still wanted (LEADING: from the first one
        RAM lacks on; EACH: every one it lacks)."""
        if reach is Reach.LEADING:
            n = sum(1 for e in itertools.takewhile(lambda e: e is not None, entries))
            while n < len(chunks) and (entry := self.pin(chunks[n])) is not None:
                entries[n] = entry
                n += 1
            return list(range(n, len(chunks)))
        for i, chunk in enumerate(chunks):
            if entries[i] is None:
                entries[i] = self.pin(chunk)
        return [i for i, e in enumerate(entries) if e is None]

    async def _promote_wanted(
        self, ns: Namespace, chunks: list[ChunkId], todo: list[int], request: LeaseRequest
    ) -> list[int]:
        """Promote the wanted chunks found below and wait for them; returns the indexes that
        landed. LEADING: only the leading run found below (the first found nowhere ends it).

        Every promotion starts as soon as RAM has room for it: at once into free RAM, the rest
        as the write-downs started here for all of them free pages, so reads from below and the
        write-downs making room for them run at the same time (bounded by the tier's queue),
        instead of reading only once all the room is there."""
        leading = request.reach is Reach.LEADING
        start_by = request.start_by
        if leading:  # (a chunk further on that RAM holds needs no promotion)
            missing = [i for i in todo if not self._ram.contains(chunks[i], touch=False)]
        else:  # never a chunk on its way from a peer: a peer is not served another peer's chunks
            missing = [i for i in todo if self._promoter.in_flight(chunks[i]) is not TierKind.PEER]
        found = await self.locate([chunks[i] for i in missing], start_by if leading else None, request.local_only)
        pairs = list(zip(missing, found))
        if leading:
            pairs = list(itertools.takewhile(lambda pair: pair[1] is not None, pairs))
        below = [(i, t) for i, t in pairs if t is not None]
        self._room.start(ns, len(below) * self._room.slot_bytes(ns))
        deadline = self._room.deadline(start_by)  # one wait for room, shared by all of them
        waits: dict[int, asyncio.Future] = {}
        for i, tier_index in below:
            if self._promoter.in_flight(chunks[i]) is TierKind.NONE:  # (a shared one has its room)
                await self._room.make(ns, 1, deadline)
                if leading:
                    check_started(start_by)  # it gave up at start_by: start (and evict for) nothing more
            elif not leading and self._promoter.in_flight(chunks[i]) is TierKind.PEER:
                continue  # (it began arriving from a peer meanwhile)
            future = self.promote(chunks[i], ns.chunk_bytes, tier_index)
            if future is None:
                if leading:
                    break
                continue
            waits[i] = future
        # Shielded: a promotion is shared with other callers, whom our cancellation must not fail.
        shielded = {i: asyncio.shield(f) for i, f in waits.items()}
        if leading:
            results = await self._waits.until(start_by, asyncio.gather(*shielded.values()))
            return [i for i, ok in zip(shielded, results) if ok]
        if shielded:
            timeout = None if start_by is None else max(0.0, start_by - asyncio.get_running_loop().time())
            await asyncio.wait(shielded.values(), timeout=timeout)
        return [i for i, f in waits.items() if f.done() and not f.cancelled() and f.result()]

    # -- building blocks (region loads use these too) ---------------------------------------

    async def check(self, chunks: Sequence[ChunkId]) -> None:
        """Verify those of `chunks` adopted and not yet verified (chain/verify.py), so that pin()
        finds them checked; one whose bytes changed is dropped (a miss)."""
        if self._verifier is not None:
            await self._verifier.check(chunks)

    def pin(self, chunk: ChunkId) -> RamEntry | None:
        """Lease `chunk` if RAM holds it (READY): its pages stay put until release(). An adopted
        chunk not yet verified is verified first (here, blocking, if check() did not)."""
        entry = self._ram.acquire(chunk)
        if entry is not None and not entry.verified:
            if self._verifier is None or not self._verifier.check_now(entry):
                self._ram.release(entry)
                return None
        return entry

    def release(self, entries: Sequence[RamEntry]) -> None:
        for entry in entries:
            self._ram.release(entry)

    async def locate(
        self, chunks: Sequence[ChunkId], start_by: float | None = None, local_only: bool = False
    ) -> list[int | None]:
        """The index of the first lower tier holding each chunk (None: nowhere); waiting for the
        tiers ends at `start_by` with TransferNotStarted."""
        if not chunks:
            return []
        return await self._waits.until(start_by, self._promoter.find(chunks, local_only))

    def in_flight(self, chunk: ChunkId) -> TierKind:
        """The tier a promotion of `chunk` under way comes from (NONE: none is)."""
        return self._promoter.in_flight(chunk)

    def pending(self, chunk: ChunkId) -> asyncio.Future | None:
        """The promotion of `chunk` under way, if any (as promote() returns it)."""
        return self._promoter.pending(chunk)

    def promote(self, chunk: ChunkId, size: int, tier_index: int, evict: bool = True) -> asyncio.Future | None:
        """Start copying `chunk` up from lower tier `tier_index` (see Promoter.start); lease it
        with land() once the future says it landed."""
        return self._promoter.start(chunk, size, tier_index, evict)

    def land(self, chunk: ChunkId) -> RamEntry | None:
        """Lease a promoted chunk (None: it landed and was evicted again before its lease)."""
        return self._ram.acquire(chunk)

    def fits(self, ns: Namespace) -> bool:
        """Whether free RAM takes a chunk of `ns` now, evicting nothing."""
        return self._ram.fits(ns.namespace_id, ns.chunk_bytes)

    def extents(self, entry: RamEntry) -> list[Extent]:
        return self._ram.extents(entry)

    def pool_of(self, entry: RamEntry) -> np.ndarray:
        """The arena array holding a leased chunk's pages (a copy's source or target)."""
        return self._arenas.array(entry.arena)

    def page_views(self, entry: RamEntry) -> list[memoryview]:
        """A leased chunk's whole pages as views of the daemon's mapping of its arena."""
        return self._ram.page_views(entry, self._arenas.view(entry.arena))
