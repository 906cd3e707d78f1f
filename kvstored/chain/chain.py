# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The tier chain: chunks over RAM (the gateway) and the tiers below it, in order.

Lookups go RAM, then each lower tier; a hit below starts its promotion into RAM at once, so the
load that follows finds it there (or waits for it). New chunks enter RAM; write-back moves them
down before RAM drops them. Bookkeeping runs on the event loop; byte copies between a client
region and the pool run in a small thread pool (numpy releases the GIL while copying).

The chain grants RAM entries (reservations and leases) and knows nothing of who holds them: the
server's session broker maps sessions, handles and regions onto what it returns, and hands each
call a `proceed` check that says whether its caller still wants the grant.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvstored.chain.drops import StoreDrops
from kvstored.chain.leases import LeaseRequest, Leases
from kvstored.chain.load_rate import Clock
from kvstored.chain.lower import LowerTier
from kvstored.chain.promotion import DeletionGuard, Promoter
from kvstored.chain.recompute import DEFAULT_PROBE_S, NamespaceFinder, RecomputeGate
from kvstored.chain.region_copy import RegionCopies
from kvstored.chain.region_load import RegionLoader
from kvstored.chain.room import RamRoom
from kvstored.chain.staged import StagedReads
from kvstored.chain.start_by import StartWaits, check_started
from kvstored.chain.store_plan import StorePlan, StorePlanner
from kvstored.chain.verify import ChunkVerifier
from kvstored.chain.writeback import WriteBack, WritePolicy
from kvstored.chunks.ids import ChunkId, RemovalCause, TierKind
from kvstored.errors import (
    InvalidRequest,
    KvstoredError,
    RegionShrunk,
    TierStartError,
    TierUnavailable,
)
from kvstored.events.bus import Cause, EventBus, EventType
from kvstored.namespaces import Namespace
from kvstored.shm.arenas import ArenaSet
from kvstored.shm.copier import CopyJob, default_copy_threads
from kvstored.shm.mapping import Region
from kvstored.shm.staging import Staging
from kvstored.tiers.base import SecondaryTier
from kvstored.tiers.ram import Extent, RamEntry, RamTier, ReserveOutcome
from kvstored_client.kinds import DropReason, LoadInto

log = logging.getLogger(__name__)
T = TypeVar("T")


# Slots reserved ahead (reserve_ahead) one session may hold per namespace, the share of RAM (and
# of a quota) they may take at most, and the share of RAM all sessions together may take (many
# idle writers must not push the cache out of RAM).
AHEAD_PER_SESSION = 32
AHEAD_SHARE = 32
AHEAD_TOTAL_SHARE = 8

Proceed = Callable[[], None]
"""The caller's last word: called once the chain has done its waiting (for room, promotions),
right before it grants or copies anything, with no await in between. It raises to get nothing
(its session closed meanwhile, its start deadline passed); the chain then gives back what it
took on the caller's behalf and lets the exception through."""


def always_proceed() -> None:
    """A caller that always still wants what it asked for (tests, in-process callers)."""


def no_namespaces(namespace_id: str) -> Namespace | None:
    """A chain told of no registered namespaces (tests): write-downs are never gated."""
    return None


@dataclass(frozen=True, slots=True)
class SlotGrant:
    """A reserve() outcome; RESERVED ones carry the entry, to be commit()ed or abort()ed."""

    outcome: ReserveOutcome
    entry: RamEntry | None = None
    extents: tuple[Extent, ...] = ()
    present_in: TierKind = TierKind.NONE  # ALREADY_PRESENT: the tier holding it
    drop: DropReason = DropReason.NONE  # IN_PROGRESS, NO_SPACE: why it is not stored


@dataclass(frozen=True, slots=True)
class AheadGrant:
    """A slot reserved ahead: RAM for a chunk whose key its commit_ahead() names (or abort())."""

    entry: RamEntry
    extents: tuple[Extent, ...]


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """A leased chunk: its pages stay put until release()."""

    entry: RamEntry
    extents: tuple[Extent, ...]


@dataclass(frozen=True, slots=True)
class StoreOutcomes:
    """What a region store did with each key, in request order (RESERVED: copied in now), where
    the ALREADY_PRESENT ones are and why the others were dropped (NONE where not)."""

    per_key: list[ReserveOutcome]
    present_in: list[TierKind] = field(default_factory=list)
    drops: list[DropReason] = field(default_factory=list)

    def count(self, *outcomes: ReserveOutcome) -> int:
        return sum(1 for o in self.per_key if o in outcomes)

    @classmethod
    def of(cls, plan: StorePlan) -> StoreOutcomes:
        return cls(
            [p.outcome for p in plan.per_key], [p.present_in for p in plan.per_key], [p.drop for p in plan.per_key]
        )


@dataclass(frozen=True)
class ChainPolicy:
    write_policy: WritePolicy = WritePolicy.WRITE_BACK
    headroom_bytes: int = 0  # RAM kept free by write-back (0: none)
    writeback_wait_s: float = 1.0  # how long a store may wait for write-downs to free RAM
    copy_threads: int = field(default_factory=default_copy_threads)  # region <-> pool copies
    staging_bytes: int = 64 << 20  # region loads past a full RAM read through it (0: they promote, evicting)
    recompute_gate: bool = True  # hits and write-downs only where loading beats recomputing (recompute.py)
    rate_probe_s: float = DEFAULT_PROBE_S  # a tier skipped as slow is measured again this often


_EVENT_CAUSE = {
    RemovalCause.EVICTED: Cause.EVICTED,
    RemovalCause.CORRUPT: Cause.CORRUPT,
    RemovalCause.DELETED: Cause.DELETED,
}


class TierChain:
    def __init__(
        self,
        ram: RamTier,
        arenas: ArenaSet,
        lower: Sequence[LowerTier] = (),
        policy: ChainPolicy = ChainPolicy(),
        events: EventBus | None = None,
        namespaces: NamespaceFinder = no_namespaces,
        clock: Clock = time.monotonic,  # when the gate's probes are due (tests pass their own)
    ) -> None:
        self.events = events or EventBus()
        self.ram = ram
        self.lower = list(lower)
        self.arenas = arenas
        self.gate = RecomputeGate(self.lower, namespaces, policy.recompute_gate, policy.rate_probe_s, clock)
        self._copies = RegionCopies(policy.copy_threads)
        self._waits = StartWaits()  # waits a transfer gave up at its start deadline
        self.verifier = ChunkVerifier(ram, arenas.view, self.events, policy.copy_threads)
        self.writeback = WriteBack(
            ram,
            arenas.view,
            self.lower,
            policy.write_policy,
            policy.headroom_bytes,
            policy.writeback_wait_s,
            self.events,
            self.gate.admits,
            self.verifier,
        )
        self._deletable = [t for t in self.lower if t.capabilities.accepts_deletes]
        self._deleting = DeletionGuard()
        self._deletes: set[asyncio.Task] = set()  # run to the end even if their caller gives up
        self._prefetches: set[asyncio.Task] = set()  # promotions started by lookups, waiting for room
        self.promoter = Promoter(ram, arenas.view, self.lower, self.events, self._deleting)
        self._room = RamRoom(ram, self.writeback)
        self._planner = StorePlanner(ram, self.lower, self._deleting)
        self.drops = StoreDrops()
        self.leases = Leases(ram, arenas, self.promoter, self._room, self._waits, bool(self.lower), self.verifier)
        self.staged: StagedReads | None = None
        self._region_loader: RegionLoader | None = None
        if policy.staging_bytes and self.lower:
            self.staged = StagedReads(Staging(policy.staging_bytes), self.lower, self._deleting)
            self._region_loader = RegionLoader(self.leases, self.staged, self._waits, self._copies)
        for lower_tier in self.lower:
            lower_tier.tier.removal_listener = self._tier_removed

    def _tier_removed(self, tier: SecondaryTier, chunk: ChunkId, cause: RemovalCause) -> None:
        self.events.publish(EventType.REMOVED, _EVENT_CAUSE[cause], tier.name, tier.kind, [chunk])

    def _publish_ram(self, type: EventType, cause: Cause, chunks: Sequence[ChunkId]) -> None:
        if chunks:
            self.events.publish(type, cause, "ram", TierKind.RAM, chunks)

    async def start(self) -> None:
        for lower in self.lower:
            try:
                await lower.tier.start()
            except Exception as exc:
                raise TierStartError(f"cannot start tier {lower.tier.name!r}: {exc}") from exc
            lower.queue.start()

    # -- lookup / delete ------------------------------------------------------------------

    async def lookup(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        load_into: LoadInto = LoadInto.POOL,
    ) -> list[TierKind]:
        """Where each key is; hits below RAM start their promotion (prefetch). A region load
        (`load_into`) gets them through staging when RAM is full: its lookup promotes into free
        RAM and reads ahead into staging, evicting nothing."""
        in_ram = self.ram.contains_many(ns.namespace_id, keys)
        if all(in_ram):
            return [TierKind.RAM] * len(keys)
        chunks = [(ns.namespace_id, k) for k in keys]
        tiers = [TierKind.RAM if hit else self.promoter.in_flight(c) for hit, c in zip(in_ram, chunks)]
        missing = [i for i, t in enumerate(tiers) if t is TierKind.NONE]
        if missing and self.lower:
            found = await self.promoter.find([chunks[i] for i in missing])
            below = []
            for i, tier_index in zip(missing, found):
                if tier_index is not None:
                    tiers[i] = self.lower[tier_index].tier.kind
                    below.append((i, chunks[i], tier_index))
            first_miss = tiers.index(TierKind.NONE) if TierKind.NONE in tiers else len(tiers)
            if self.gate.applies(ns):
                first_miss = self._cut_slow_hits(ns, tiers, below, first_miss)
                below = [b for b in below if tiers[b[0]] is not TierKind.NONE]
            if load_into is LoadInto.REGION and self._region_loader is not None and self._region_loader.serves(ns):
                self._prefetch_for_region(ns, below, first_miss)
                return tiers
            # The load that follows needs the leading run (up to the first miss): room is made
            # for those, up to a quarter of RAM per lookup (more would evict the first of them,
            # and chunks other loads promoted, before their load could lease them).
            room = min(self.ram.limit_bytes(scope) for scope in (None, *self._room.scopes(ns)))  # (or of a quota)
            limit = max(1, room // 4 // self._room.slot_bytes(ns))
            leading = [(chunk, t) for i, chunk, t in below if i < first_miss][:limit]
            self._prefetch(ns, leading)
            for _, chunk, tier_index in below[len(leading) :]:  # the others: into free RAM only
                self.promoter.start(chunk, ns.chunk_bytes, tier_index, evict=False)
        return tiers

    def resident(self, ns: Namespace) -> tuple[int, list[bytes]]:
        """For a key index of `ns`: the most chunks of it RAM could hold (all of RAM), and the
        keys of those it holds (READY) now."""
        held = [key for namespace_id, key in self.ram.ready_chunks() if namespace_id == ns.namespace_id]
        return self.pool_bytes // self._room.slot_bytes(ns), held

    def touch(self, ns: Namespace, keys: Sequence[bytes], lookups: int = 0) -> int:
        """Keys a client found in RAM by itself (its key index), each once for `lookups` key
        lookups that all hit (0: one per key): counted as RAM lookups and hits and made most
        recently used, as lookup() would; returns how many RAM still holds."""
        held = sum(self.ram.contains_many(ns.namespace_id, keys))
        self.ram.count_hits(max(0, lookups - len(keys)))
        return held

    def _cut_slow_hits(
        self, ns: Namespace, tiers: list[TierKind], below: list[tuple[int, ChunkId, int]], first_miss: int
    ) -> int:
        """Report the hit prefix only as far as loading it beats recomputing it (recompute.py):
        the hits below RAM past that become misses (counted per tier). A tier due a measurement
        gets those on it promoted anyway, side by side as a load would read them, into free RAM,
        with nobody waiting on them. Returns the new first miss."""
        lower_of: dict[int, int] = {i: tier_index for i, _, tier_index in below if i < first_miss}
        prefix = self.gate.prefix(ns, [lower_of.get(i) for i in range(first_miss)])
        skipped: dict[int, list[ChunkId]] = {}
        for i, chunk, tier_index in below:
            if prefix <= i < first_miss:
                tiers[i] = TierKind.NONE
                self.gate.skip_hit(tier_index)
                skipped.setdefault(tier_index, []).append(chunk)
        for tier_index, chunks in skipped.items():
            if self.gate.take_probe(tier_index, len(chunks)):
                for chunk in chunks:
                    self.promoter.start(chunk, ns.chunk_bytes, tier_index, evict=False)
        return prefix

    def _prefetch_for_region(self, ns: Namespace, below: list[tuple[int, ChunkId, int]], first_miss: int) -> None:
        """A region load follows: hits below RAM start their promotion into free RAM; once RAM has
        none, the leading ones (up to the first miss) are read ahead into staging, as far as its
        prefetch half has pages. Nothing is evicted."""
        staged = self.staged
        for i, chunk, tier_index in below:
            if self.promoter.start(chunk, ns.chunk_bytes, tier_index, evict=False) is None:
                if staged is None or i >= first_miss or not staged.prefetch(chunk, ns.chunk_bytes, tier_index):
                    break

    def _prefetch(self, ns: Namespace, below: list[tuple[ChunkId, int]]) -> None:
        """Start promoting chunks a lookup found below RAM: all at once, bounded by the tiers'
        queues. Free RAM takes them now; for the rest, write-downs start here and a background
        task promotes each as room appears, until the write-back wait runs out (the load then
        promotes what is left). Evicting for them follows the usual order: the least recently
        used chunks, after their write-down."""
        if not below:
            return
        self._room.start(ns, len(below) * self._room.slot_bytes(ns))
        for n, (chunk, tier_index) in enumerate(below):
            if not self.ram.fits(ns.namespace_id, ns.chunk_bytes):
                task = asyncio.ensure_future(self._prefetch_when_room(ns, below[n:], self.writeback.deadline()))
                self._prefetches.add(task)
                task.add_done_callback(self._prefetch_done)
                return
            self.promoter.start(chunk, ns.chunk_bytes, tier_index, evict=False)

    async def _prefetch_when_room(self, ns: Namespace, below: list[tuple[ChunkId, int]], deadline: float) -> None:
        for chunk, tier_index in below:
            if self.promoter.in_flight(chunk) is not TierKind.NONE:
                continue  # (a load got there first)
            await self._room.make(ns, 1, deadline)
            if self.promoter.start(chunk, ns.chunk_bytes, tier_index, evict=False) is None:
                return  # no room in time (or the chunk is being deleted): the load does the rest

    def _prefetch_done(self, task: asyncio.Task) -> None:
        self._prefetches.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("prefetch failed: %s", task.exception())  # the load promotes them itself

    async def delete(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Remove from RAM and every tier that accepts deletes; counts keys that were anywhere.
        Runs to the end even if the caller is cancelled (a half-done delete would leave copies
        below)."""
        chunks = [(ns.namespace_id, k) for k in keys]
        return await self._unskippable(self._delete(chunks))

    async def clear_namespace(self, ns: Namespace) -> int:
        """Remove every chunk of `ns` this daemon knows of, from RAM and every tier that accepts
        deletes (an admin operation)."""
        return await self._unskippable(self._clear(ns.namespace_id))

    async def _delete(self, chunks: list[ChunkId]) -> int:
        failures: list[BaseException] = []
        with self._deleting.chunks(chunks):
            removed = [self.ram.delete(c) for c in chunks]
            self._publish_ram(EventType.REMOVED, Cause.DELETED, [c for c, r in zip(chunks, removed) if r])
            for lower in self._deletable:
                below = await lower.remove_all(chunks)
                failures += below.failures
                gone = [c for c, hit in zip(chunks, below.gone) if hit]
                if gone:
                    self.events.publish(EventType.REMOVED, Cause.DELETED, lower.tier.name, lower.tier.kind, gone)
                removed = [r or hit for r, hit in zip(removed, below.gone)]
        _raise_first(failures)
        return sum(removed)

    async def _clear(self, namespace_id: str) -> int:
        failures: list[BaseException] = []
        # Each removed key is an event (routers in vLLM's format know no per-namespace clear),
        # then one CLEARED per tier for watchers that track namespaces.
        with self._deleting.namespace(namespace_id):
            chunks = self.ram.chunks_of(namespace_id)
            gone = [c for c in chunks if self.ram.delete(c)]
            removed = len(gone)
            self._publish_ram(EventType.REMOVED, Cause.DELETED, gone)
            self.events.publish_cleared("ram", TierKind.RAM, namespace_id)
            for lower in self._deletable:
                try:
                    known = await lower.tier.namespace_chunks(namespace_id)
                except TierUnavailable as exc:  # could not look: clear what it knows, and say so
                    failures.append(exc)
                    known = lower.tier.known_chunks(namespace_id)
                below = await lower.remove_all(known)
                failures += below.failures
                gone = [c for c, hit in zip(known, below.gone) if hit]
                removed += len(gone)
                if gone:
                    self.events.publish(EventType.REMOVED, Cause.DELETED, lower.tier.name, lower.tier.kind, gone)
                self.events.publish_cleared(lower.tier.name, lower.tier.kind, namespace_id)
        _raise_first(failures)
        return removed

    async def _unskippable(self, work: Coroutine[Any, Any, T]) -> T:
        task = asyncio.ensure_future(work)
        self._deletes.add(task)
        task.add_done_callback(self._delete_done)
        return await asyncio.shield(task)

    def _delete_done(self, task: asyncio.Task) -> None:
        self._deletes.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("delete failed: %s", task.exception())  # its caller may have gone already

    # -- grants (pool mapping) ------------------------------------------------------------

    async def reserve(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        proceed: Proceed = always_proceed,
    ) -> list[SlotGrant]:
        """Reserve RAM for new chunks (waiting briefly for write-downs to make room). Chunks RAM
        or a tier below holds already are not reserved (store_plan.py); a full RAM is an answer,
        each refused slot saying why."""
        await self._make_room(ns, keys)
        proceed()  # nothing reserved yet: nothing to give back
        plan = self._planner.place(ns, keys)
        self._publish_ram(EventType.REMOVED, Cause.EVICTED, plan.evicted)
        self.drops.record(p.drop for p in plan.per_key)
        return [
            SlotGrant(p.outcome, p.entry, tuple(self.ram.extents(p.entry)), p.present_in)
            if p.entry is not None
            else SlotGrant(p.outcome, present_in=p.present_in, drop=p.drop)
            for p in plan.per_key
        ]

    async def _make_room(self, ns: Namespace, keys: Sequence[bytes], start_by: float | None = None) -> None:
        """Write down what reserving RAM for the keys held nowhere yet would evict (none: no wait)."""
        needed = self._planner.to_store(ns, keys)
        if needed:
            await self._room.make(ns, needed, self._room.deadline(start_by))

    def commit(self, entries: Sequence[RamEntry]) -> int:
        """Publish reserved chunks whose bytes are in place; returns how many RAM now holds (one
        deleted while it was being written is freed instead, and no event says it was stored)."""
        for entry in entries:
            self.ram.commit(entry)
        stored = [entry for entry in entries if entry.indexed]
        self._publish_ram(EventType.STORED, Cause.STORED, [entry.chunk for entry in stored])
        self.writeback.after_commit(stored)
        return len(stored)

    @property
    def reserves_ahead(self) -> bool:
        """Whether slots may be reserved ahead of their keys: only where RAM is the only tier,
        so that whether a chunk is present already is RAM's to say (a store through a slot
        reserved ahead learns it only at its commit, after its copy)."""
        return not self.lower

    def ahead_limit(self, ns: Namespace) -> int:
        """Slots one session may hold reserved ahead in `ns`: enough for one-chunk stores that
        follow each other, at most 1/AHEAD_SHARE of RAM and of each quota the namespace counts
        against (a small one grants fewer, or none), so idle writers keep little of either."""
        if not self.reserves_ahead:
            return 0
        smallest = min(self.ram.limit_bytes(scope) for scope in (None, *self._room.scopes(ns)))
        return min(AHEAD_PER_SESSION, smallest // AHEAD_SHARE // self._room.slot_bytes(ns))

    def ahead_room(self, ns: Namespace) -> int:
        """Slots of `ns` that may still be reserved ahead by any session: every session's
        together stay within 1/AHEAD_TOTAL_SHARE of RAM."""
        unclaimed = self.ram.limit_bytes() // AHEAD_TOTAL_SHARE - self.ram.unkeyed_bytes
        return max(0, unclaimed // self._room.slot_bytes(ns))

    def reserve_ahead(self, ns: Namespace, count: int) -> list[AheadGrant]:
        """Up to `count` RAM slots for chunks of `ns` whose keys come with their commit
        (commit_ahead): reserved at once, evicting the least recently used chunks as a store's
        reservation would (with RAM the only tier there is nothing to wait for); fewer, or
        none, where RAM or a quota has no room."""
        if not self.reserves_ahead:
            return []
        grants: list[AheadGrant] = []
        evicted: list[ChunkId] = []
        for _ in range(count):
            result = self.ram.reserve_unkeyed(ns.namespace_id, ns.chunk_bytes)
            evicted += result.evicted
            if result.entry is None:
                break
            grants.append(AheadGrant(result.entry, tuple(self.ram.extents(result.entry))))
        self._publish_ram(EventType.REMOVED, Cause.EVICTED, evicted)
        return grants

    def commit_ahead(self, ns: Namespace, entries: Sequence[RamEntry], keys: Sequence[bytes]) -> list[ReserveOutcome]:
        """Publish slots reserved ahead under their keys, whose bytes are in place: RESERVED for
        those committed; a key RAM holds already (ALREADY_PRESENT) or another writer is storing
        (IN_PROGRESS) only frees its slot."""
        outcomes = [self.ram.bind(entry, (ns.namespace_id, key)) for entry, key in zip(entries, keys)]
        self.abort([e for e, o in zip(entries, outcomes) if o is not ReserveOutcome.RESERVED])
        self.commit([e for e, o in zip(entries, outcomes) if o is ReserveOutcome.RESERVED])
        return outcomes

    def abort(self, entries: Sequence[RamEntry]) -> None:
        """Give back reservations that will not be committed."""
        for entry in entries:
            self.ram.abort(entry)

    async def acquire(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        proceed: Proceed = always_proceed,
    ) -> list[LeaseGrant]:
        """Leases for the leading cached keys (promoted from below first); stops at the first miss."""
        entries = (await self.leases.lease(ns, keys)).held
        try:
            proceed()
        except BaseException:
            self.release(entries)  # nobody would ever release these
            raise
        return [LeaseGrant(entry, tuple(self.ram.extents(entry))) for entry in entries]

    def release(self, entries: Sequence[RamEntry]) -> None:
        self.leases.release(entries)

    def ready_chunks(self) -> list[ChunkId]:
        """Every chunk RAM holds (READY)."""
        return self.ram.ready_chunks()

    @property
    def page_bytes(self) -> int:
        return self.ram.page_bytes

    @property
    def pool_bytes(self) -> int:
        """The RAM tier's capacity."""
        return self.ram.capacity_bytes

    def ram_usage_by_namespace(self) -> dict[str, tuple[int, int]]:
        """Per namespace: (chunks in RAM, bytes of pages they hold) (a scan: for admin operations)."""
        return self.ram.usage_by_namespace()

    # -- region transfers -----------------------------------------------------------------

    async def store_from_region(
        self,
        ns: Namespace,
        region: Region,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        proceed: Proceed = always_proceed,
        start_by: float | None = None,
    ) -> StoreOutcomes:
        """Copy chunks from a client region into RAM. Once the copy starts, it runs to the end.
        Waiting for room ends at `start_by` (loop time) with TransferNotStarted."""
        _check_offsets(ns, region, keys, offsets)
        # Awaited here, not in a task: the room it saw is still there when it returns.
        await self._make_room(ns, keys, start_by)
        check_started(start_by)
        proceed()  # (no await from here to the copy's start)
        plan = self._planner.place(ns, keys)
        self._publish_ram(EventType.REMOVED, Cause.EVICTED, plan.evicted)
        self.drops.record(p.drop for p in plan.per_key)
        stored = [(p.entry, offset) for p, offset in zip(plan.per_key, offsets) if p.entry is not None]
        jobs = [CopyJob(offset, self.ram.extents(entry)) for entry, offset in stored]
        entries = [entry for entry, _ in stored]
        try:
            await self._copy(region, entries, jobs, to_pool=True)
        except BaseException:
            self.abort(entries)
            raise
        self.commit(entries)
        return StoreOutcomes.of(plan)

    async def load_to_region(
        self,
        ns: Namespace,
        region: Region,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        proceed: Proceed = always_proceed,
        start_by: float | None = None,
    ) -> int:
        """Copy the leading cached chunks into a client region; returns how many. Once the copy
        starts, it runs to the end. Waiting for promotions ends at `start_by` (loop time) with
        TransferNotStarted. Hits below RAM come through staging when RAM has no free room
        (region_load.py): a started transfer then goes on as staging pages come back."""
        _check_offsets(ns, region, keys, offsets)
        if self._region_loader is not None and self._region_loader.serves(ns):
            return await self._region_loader.load(ns, region, keys, offsets, proceed, start_by)
        leased = list(zip((await self.leases.lease(ns, keys, LeaseRequest(start_by=start_by))).held, offsets))
        try:
            proceed()  # (no await from here to the copy's start)
            jobs = [CopyJob(offset, self.ram.extents(entry)) for entry, offset in leased]
            await self._copy(region, [entry for entry, _ in leased], jobs, to_pool=False)
        finally:
            self.release([entry for entry, _ in leased])
        return len(leased)

    async def close(self) -> None:
        """Let deletes finish, stop the I/O queues (abandoning queued write-downs: this is a
        cache), then the tiers."""
        await self.verifier.close()  # (what it did not check yet is handed over unverified, as it came)
        if self._deletes:
            await asyncio.wait(self._deletes)
        for task in self._prefetches:
            task.cancel()
        if self._prefetches:
            await asyncio.wait(self._prefetches)
        for lower in self.lower:
            await lower.queue.close()
        if self.staged is not None:
            await self.staged.close()
        await self._waits.close()  # the queues are closed: what they waited for will not come
        for lower in self.lower:
            await lower.tier.close()
        self._copies.close()

    # -- helpers --------------------------------------------------------------------------

    async def _copy(self, region: Region, entries: Sequence[RamEntry], jobs: list[CopyJob], to_pool: bool) -> None:
        """Copy the chunks of one namespace (so of one arena)."""
        if jobs:
            await self._copies.copy(region, self.arenas.array(entries[0].arena), jobs, to_pool)


def _check_offsets(ns: Namespace, region: Region, keys: Sequence[bytes], offsets: Sequence[int]) -> None:
    now = region.current_size()
    if now < region.size:
        raise RegionShrunk(
            f"region {region.region_id} ({region.name}) shrank from {region.size} to {now} bytes: register it again"
        )
    if len(keys) != len(offsets):
        raise InvalidRequest(f"{len(keys)} keys but {len(offsets)} offsets: give one offset per key")
    for i, offset in enumerate(offsets):
        if offset + ns.chunk_bytes > region.size:
            raise InvalidRequest(
                f"offset {offset} (key {i}) + chunk_bytes {ns.chunk_bytes} is outside region "
                f"{region.region_id} ({region.size} bytes)"
            )


def _raise_first(failures: list[BaseException]) -> None:
    """After every tier had its turn: report the first failed removal (TierUnavailable and the
    like reach the caller as such; anything else becomes TierUnavailable naming it)."""
    if not failures:
        return
    first = failures[0]
    if isinstance(first, KvstoredError):
        raise first
    raise TierUnavailable(f"{len(failures)} removal(s) below RAM failed, first: {first!r}; retry the delete") from first
