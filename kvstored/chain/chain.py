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
import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kvstored.chain.lower import LowerTier
from kvstored.chain.promotion import DeletionGuard, Promoter
from kvstored.chain.region_load import RegionLoader
from kvstored.chain.staged import StagedReads
from kvstored.chain.writeback import WriteBack, WritePolicy
from kvstored.chunks.ids import ChunkId, RemovalCause, TierKind
from kvstored.errors import (
    InvalidRequest,
    KvstoredError,
    PoolExhausted,
    RegionShrunk,
    TierStartError,
    TierUnavailable,
    TransferNotStarted,
    UnknownRegion,
)
from kvstored.events.bus import Cause, EventBus, EventType
from kvstored.namespaces import Namespace
from kvstored.shm.arenas import ArenaSet
from kvstored.shm.copier import Copier, CopyJob, default_copy_threads
from kvstored.shm.copy import MappingVanished
from kvstored.shm.mapping import Region
from kvstored.shm.staging import Staging
from kvstored.tiers.base import SecondaryTier
from kvstored.tiers.ram import Extent, QuotaScope, RamEntry, RamTier, ReserveOutcome
from kvstored_client.kinds import LoadInto

log = logging.getLogger(__name__)
T = TypeVar("T")


Proceed = Callable[[], None]
"""The caller's last word: called once the chain has done its waiting (for room, promotions),
right before it grants or copies anything, with no await in between. It raises to get nothing
(its session closed meanwhile, its start deadline passed); the chain then gives back what it
took on the caller's behalf and lets the exception through."""


def always_proceed() -> None:
    """A caller that always still wants what it asked for (tests, in-process callers)."""


@dataclass(frozen=True, slots=True)
class SlotGrant:
    """A reserve() outcome; RESERVED ones carry the entry, to be commit()ed or abort()ed."""

    outcome: ReserveOutcome
    entry: RamEntry | None = None
    extents: tuple[Extent, ...] = ()


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """A leased chunk: its pages stay put until release()."""

    entry: RamEntry
    extents: tuple[Extent, ...]


@dataclass(frozen=True, slots=True)
class StoreOutcomes:
    """What a region store did with each key, in request order (RESERVED: copied in now)."""

    per_key: list[ReserveOutcome]

    def count(self, *outcomes: ReserveOutcome) -> int:
        return sum(1 for o in self.per_key if o in outcomes)


@dataclass(frozen=True)
class ChainPolicy:
    write_policy: WritePolicy = WritePolicy.WRITE_BACK
    headroom_bytes: int = 0  # RAM kept free by write-back (0: none)
    writeback_wait_s: float = 1.0  # how long a store may wait for write-downs to free RAM
    copy_threads: int = field(default_factory=default_copy_threads)  # region <-> pool copies
    staging_bytes: int = 64 << 20  # region loads past a full RAM read through it (0: they promote, evicting)


class TierChain:
    def __init__(
        self,
        ram: RamTier,
        arenas: ArenaSet,
        lower: Sequence[LowerTier] = (),
        policy: ChainPolicy = ChainPolicy(),
        events: EventBus | None = None,
    ) -> None:
        self.events = events or EventBus()
        self.ram = ram
        self.lower = list(lower)
        self.arenas = arenas
        self._copier = Copier(policy.copy_threads)
        self.writeback = WriteBack(
            ram, arenas.view, self.lower, policy.write_policy, policy.headroom_bytes, policy.writeback_wait_s,
            self.events,
        )
        self._deletable = [t for t in self.lower if t.capabilities.accepts_deletes]
        self._deleting = DeletionGuard()
        self._deletes: set[asyncio.Task] = set()  # run to the end even if their caller gives up
        self._prefetches: set[asyncio.Task] = set()  # promotions started by lookups, waiting for room
        self._outwaited: set[asyncio.Future] = set()  # waits a transfer gave up at its start deadline
        self.promoter = Promoter(ram, arenas.view, self.lower, self.events, self._deleting)
        self.staged: StagedReads | None = None
        self._region_loader: RegionLoader | None = None
        if policy.staging_bytes and self.lower:
            self.staged = StagedReads(Staging(policy.staging_bytes), self.lower, self._deleting)
            self._region_loader = RegionLoader(ram, arenas, self.promoter, self.staged, self._until, self._copy_out)
        for lower_tier in self.lower:
            lower_tier.tier.removal_listener = self._tier_removed

    def _tier_removed(self, tier: SecondaryTier, chunk: ChunkId, cause: RemovalCause) -> None:
        event_cause = Cause.CORRUPT if cause is RemovalCause.CORRUPT else Cause.EVICTED
        self.events.publish(EventType.REMOVED, event_cause, tier.name, tier.kind, [chunk])

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

    async def lookup(self, ns: Namespace, keys: Sequence[bytes], load_into: LoadInto = LoadInto.POOL,
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
            if load_into is LoadInto.REGION and self._region_loader is not None and self._region_loader.serves(ns):
                self._prefetch_for_region(ns, below, first_miss)
                return tiers
            # The load that follows needs the leading run (up to the first miss): room is made
            # for those, up to a quarter of RAM per lookup (more would evict the first of them,
            # and chunks other loads promoted, before their load could lease them).
            room = min(self.ram.limit_bytes(scope) for scope in (None, *self._scopes(ns)))  # (or of a quota)
            limit = max(1, room // 4 // self._slot_bytes(ns))
            leading = [(chunk, t) for i, chunk, t in below if i < first_miss][:limit]
            self._prefetch(ns, leading)
            for _, chunk, tier_index in below[len(leading):]:  # the others: into free RAM only
                self.promoter.start(chunk, ns.chunk_bytes, tier_index, evict=False)
        return tiers

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
        slot = self._slot_bytes(ns)
        self._start_room(ns, len(below) * slot)
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
            await self._make_room(ns, 1, deadline)
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

    async def _lease_prefix(
        self, ns: Namespace, keys: Sequence[bytes], start_by: float | None = None,
    ) -> list[RamEntry]:
        """Lease the leading chunks, promoting from below what RAM lacks; stops at the first miss.
        Waiting for lower tiers ends at `start_by` (loop time) with TransferNotStarted.

        Leased chunks are pinned, so promoting the rest can only evict chunks further on, which
        the next round promotes again (a few rounds at most while RAM holds the batch)."""
        chunks = [(ns.namespace_id, k) for k in keys]
        leased: list[RamEntry] = []
        try:
            for _round in range(4):
                while len(leased) < len(chunks):
                    entry = self.ram.acquire(chunks[len(leased)])
                    if entry is None:
                        break
                    leased.append(entry)
                if len(leased) == len(chunks) or not self.lower:
                    break
                if not await self._promote_prefix(ns, chunks[len(leased):], start_by):
                    break
        except BaseException:
            for entry in leased:
                self.ram.release(entry)
            raise
        return leased

    async def _promote_prefix(self, ns: Namespace, chunks: Sequence[ChunkId], start_by: float | None = None) -> bool:
        """Promote the leading chunks that are below RAM and wait; False if the first is nowhere.
        Waiting ends at `start_by` (loop time) with TransferNotStarted.

        Every promotion starts as soon as RAM has room for it: at once into free RAM, the rest
        as the write-downs started here for all of them free pages, so reads from below and
        the write-downs making room for them run at the same time (bounded by the tier's
        queue), instead of reading only once all the room is there."""
        missing = [i for i, c in enumerate(chunks) if not self.ram.contains(c, touch=False)]
        found = await self._until(start_by, self.promoter.find([chunks[i] for i in missing])) if missing else []
        wanted = sum(1 for _ in itertools.takewhile(lambda t: t is not None, found))
        slot = self._slot_bytes(ns)
        self._start_room(ns, wanted * slot)
        deadline = self.writeback.deadline()  # one wait for room, shared by all of them
        if start_by is not None:
            deadline = min(deadline, start_by)
        waits = []
        for i, tier_index in zip(missing[:wanted], found):
            if tier_index is None:  # (the first `wanted` were found: takewhile above)
                break
            if self.promoter.in_flight(chunks[i]) is TierKind.NONE:  # (a shared one has its room)
                await self._make_room(ns, 1, deadline)
                _check_started(start_by)  # it gave up at start_by: start (and evict for) nothing more
            future = self.promoter.start(chunks[i], ns.chunk_bytes, tier_index)
            if future is None:
                break
            waits.append(future)
        # Shielded: the promotion is shared with other callers, whom our cancellation must not fail.
        results = await self._until(start_by, asyncio.gather(*(asyncio.shield(w) for w in waits)))
        return bool(results) and results[0]

    async def _until(self, start_by: float | None, work: Awaitable[T]) -> T:
        """Await `work`, or raise TransferNotStarted once `start_by` (loop time) has passed. The
        work itself is not cancelled: lookups and promotions serve other callers too (and a
        lookup's verdict teaches the tier's circuit breaker); it ends in the background."""
        if start_by is None:
            return await work
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait((task,), timeout=max(0.0, start_by - asyncio.get_running_loop().time()))
        except BaseException:  # our caller is cancelled: as if it had awaited `work` itself
            task.cancel()
            raise
        if task.done():
            return task.result()
        self._outwaited.add(task)
        task.add_done_callback(self._outwaited_done)
        raise _not_started()

    def _outwaited_done(self, task: asyncio.Future) -> None:
        self._outwaited.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a wait given up by a transfer failed later: %s", task.exception())

    # -- grants (pool mapping) ------------------------------------------------------------

    async def reserve(
        self, ns: Namespace, keys: Sequence[bytes], proceed: Proceed = always_proceed,
    ) -> list[SlotGrant]:
        """Reserve RAM for new chunks (waiting briefly for write-downs to make room)."""
        await self._make_room(ns, len(keys))
        proceed()  # nothing reserved yet: nothing to give back
        grants, evicted = [], []
        for key in keys:
            result = self.ram.reserve((ns.namespace_id, key), ns.chunk_bytes)
            evicted += result.evicted
            if result.entry is None:
                grants.append(SlotGrant(result.outcome))
            else:
                grants.append(SlotGrant(result.outcome, result.entry, tuple(self.ram.extents(result.entry))))
        self._publish_ram(EventType.REMOVED, Cause.EVICTED, evicted)
        if keys and all(g.outcome is ReserveOutcome.NO_SPACE for g in grants):
            raise PoolExhausted(
                f"no room for {len(keys)} chunk(s) of {ns.chunk_bytes} bytes: the RAM tier "
                f"({self.ram.capacity_bytes} bytes) is held by leases and reservations"
            )
        return grants

    def commit(self, entries: Sequence[RamEntry]) -> None:
        """Publish reserved chunks whose bytes are in place."""
        for entry in entries:
            self.ram.commit(entry)
        self._publish_ram(EventType.STORED, Cause.STORED, [entry.chunk for entry in entries])
        self.writeback.after_commit(entries)

    def abort(self, entries: Sequence[RamEntry]) -> None:
        """Give back reservations that will not be committed."""
        for entry in entries:
            self.ram.abort(entry)

    async def acquire(
        self, ns: Namespace, keys: Sequence[bytes], proceed: Proceed = always_proceed,
    ) -> list[LeaseGrant]:
        """Leases for the leading cached keys (promoted from below first); stops at the first miss."""
        entries = await self._lease_prefix(ns, keys)
        try:
            proceed()
        except BaseException:
            self.release(entries)  # nobody would ever release these
            raise
        return [LeaseGrant(entry, tuple(self.ram.extents(entry))) for entry in entries]

    def release(self, entries: Sequence[RamEntry]) -> None:
        for entry in entries:
            self.ram.release(entry)

    # -- region transfers -----------------------------------------------------------------

    async def store_from_region(
        self, ns: Namespace, region: Region, keys: Sequence[bytes], offsets: Sequence[int],
        proceed: Proceed = always_proceed, start_by: float | None = None,
    ) -> StoreOutcomes:
        """Copy chunks from a client region into RAM. Once the copy starts, it runs to the end.
        Waiting for room ends at `start_by` (loop time) with TransferNotStarted."""
        _check_offsets(ns, region, keys, offsets)
        deadline = self.writeback.deadline()
        if start_by is not None:
            deadline = min(deadline, start_by)
        # Awaited here, not in a task: the room _make_room saw is still there when it returns.
        await self._make_room(ns, len(keys), deadline)
        _check_started(start_by)
        proceed()  # (no await from here to the copy's start)
        stored, per_key, evicted = [], [], []
        for key, offset in zip(keys, offsets):
            result = self.ram.reserve((ns.namespace_id, key), ns.chunk_bytes)
            evicted += result.evicted
            per_key.append(result.outcome)
            if result.entry is not None:
                stored.append((result.entry, offset))
        self._publish_ram(EventType.REMOVED, Cause.EVICTED, evicted)
        jobs = [CopyJob(offset, self.ram.extents(entry)) for entry, offset in stored]
        entries = [entry for entry, _ in stored]
        try:
            await self._copy(region, entries, jobs, to_pool=True)
        except BaseException:
            self.abort(entries)
            raise
        self.commit(entries)
        return StoreOutcomes(per_key)

    async def load_to_region(
        self, ns: Namespace, region: Region, keys: Sequence[bytes], offsets: Sequence[int],
        proceed: Proceed = always_proceed, start_by: float | None = None,
    ) -> int:
        """Copy the leading cached chunks into a client region; returns how many. Once the copy
        starts, it runs to the end. Waiting for promotions ends at `start_by` (loop time) with
        TransferNotStarted. Hits below RAM come through staging when RAM has no free room
        (region_load.py): a started transfer then goes on as staging pages come back."""
        _check_offsets(ns, region, keys, offsets)
        if self._region_loader is not None and self._region_loader.serves(ns):
            return await self._region_loader.load(ns, region, keys, offsets, proceed, start_by)
        leased = list(zip(await self._lease_prefix(ns, keys, start_by), offsets))
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
        for waited in list(self._outwaited):  # the queues are closed: what they waited for will not come
            waited.cancel()
        if self._outwaited:
            await asyncio.wait(self._outwaited)
        for lower in self.lower:
            await lower.tier.close()
        self._copier.close()

    # -- helpers --------------------------------------------------------------------------

    async def make_room(self, ns: Namespace, chunks: int) -> None:
        """Room for `chunks` new chunks of `ns`, dirty ones written down first (for callers that
        promote on their own: the peer tier's serving side)."""
        await self._make_room(ns, chunks)

    async def _make_room(self, ns: Namespace, chunks: int, deadline: float | None = None) -> bool:
        """Write down what a reservation would evict: within the namespace's quotas (its tenant's,
        its own) first, then in the tier; the waits end at `deadline` (by default the write-back
        wait from when it starts). Returns whether the room is there now (no await follows the
        check); False once it gives up, and the reservation evicts what it must."""
        nbytes = chunks * self._slot_bytes(ns)
        deadline = self.writeback.deadline() if deadline is None else deadline
        while True:
            # Each wait may let others take the room an earlier one made: check them all again.
            for scope in self._scopes(ns):
                if not await self.writeback.make_room(nbytes, ns.chunk_bytes, deadline, scope):
                    return False
            if not await self.writeback.make_room(nbytes, ns.chunk_bytes, deadline):
                return False
            if self._has_room(ns, chunks):
                return True

    def _has_room(self, ns: Namespace, chunks: int) -> bool:
        """Room for `chunks` chunks of `ns` in the tier and in each of its quotas, evicting nothing."""
        nbytes = chunks * self._slot_bytes(ns)
        return all(self.ram.room_bytes(scope) >= nbytes for scope in (None, *self._scopes(ns)))

    def _start_room(self, ns: Namespace, nbytes: int) -> None:
        """Start the write-downs _make_room would wait for (quotas first), without waiting."""
        for scope in self._scopes(ns):
            self.writeback.start_room(nbytes, ns.chunk_bytes, scope)
        self.writeback.start_room(nbytes, ns.chunk_bytes)

    def _scopes(self, ns: Namespace) -> tuple[QuotaScope, ...]:
        placement = self.ram.placement_of(ns.namespace_id)
        return placement.scopes if placement is not None else ()

    def _slot_bytes(self, ns: Namespace) -> int:
        """RAM one chunk of `ns` takes (whole pages)."""
        return self.ram.pages_for(ns.chunk_bytes) * self.ram.page_bytes

    async def _copy(self, region: Region, entries: Sequence[RamEntry], jobs: list[CopyJob], to_pool: bool) -> None:
        """Copy the chunks of one namespace (so of one arena)."""
        if jobs:
            await self._copy_between(region, self.arenas.array(entries[0].arena), jobs, to_pool)

    async def _copy_out(self, region: Region, source: np.ndarray, jobs: list[CopyJob]) -> None:
        """Copy chunks from the pool or staging (`source`) into a region."""
        await self._copy_between(region, source, jobs, to_pool=False)

    async def _copy_between(self, region: Region, pool: np.ndarray, jobs: list[CopyJob], to_pool: bool) -> None:
        if region.closed:  # (a long region load goes on between copies: its session may end meanwhile)
            raise UnknownRegion(f"region {region.region_id} ({region.name}) was closed during the transfer "
                                f"(its session ended)")
        try:
            await self._copier.run(region.array, pool, jobs, to_pool)
        except MappingVanished:
            raise RegionShrunk(
                f"region {region.region_id} ({region.name}) shrank during the copy: register it again"
            ) from None


def _not_started() -> TransferNotStarted:
    return TransferNotStarted("the transfer could not start within start_within_ms (lower tiers were too slow "
                              "to deliver its chunks); nothing was copied")


def _check_started(start_by: float | None) -> None:
    """Raise TransferNotStarted if the start deadline `start_by` (loop time) has passed."""
    if start_by is not None and asyncio.get_running_loop().time() >= start_by:
        raise _not_started()


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
