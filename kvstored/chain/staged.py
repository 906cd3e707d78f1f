# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Region loads past a full RAM: chunks read from a lower tier into staging memory.

When RAM has no free room, promoting a chunk for a region load would evict another (after writing
it down, if it has no copy below) only to copy the chunk out once: the engine's region is where
it lives next. A staged read skips that: the tier reads the chunk into staging pages at load
priority and verifies it, the chain copies it into the region and gives the pages back. A delete
that begins while a staged read runs voids it (its bytes are never served).

A lookup that announces a region load reads ahead the same way (prefetch), into at most half of
staging, so loads always have the other half; its load claims the read. One that no load claims
within PREFETCH_HOLD_S gives its pages back; a delete voids it until then too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvstored.chain.lower import LowerTier
from kvstored.chain.promotion import DeletionGuard, DeletionWatch
from kvstored.chunks.ids import ChunkId
from kvstored.io.scheduler import Priority
from kvstored.shm.staging import Staging, StagingSlot

log = logging.getLogger(__name__)
StagedRead = asyncio.Future  # resolves to the StagingSlot holding the verified chunk, or None
PREFETCH_HOLD_S = 2.0  # how long a chunk a lookup read ahead waits for its load (engines load within a step or two)


@dataclass(eq=False)
class _Prefetch:
    read: StagedRead
    tier_index: int
    watch: DeletionWatch  # deletes after the read, until its load claims it
    expiry: asyncio.TimerHandle | None = None


class StagedReads:
    def __init__(self, staging: Staging, lower: Sequence[LowerTier], deleting: DeletionGuard) -> None:
        self.staging = staging
        self._lower = list(lower)
        self._deleting = deleting
        self._prefetches: dict[ChunkId, _Prefetch] = {}
        self._closing = False
        self.served = 0  # chunks a region load got through staging

    def start(self, chunk: ChunkId, slot: StagingSlot, tier_index: int) -> StagedRead:
        """Read `chunk` from lower tier `tier_index` into `slot` (taken from `staging`), queued at
        load priority now. The result is the slot holding the verified chunk, for its owner to
        give back; or None (a miss, a corrupt copy, a failure, a delete meanwhile, the chain
        closing), the slot given back already: once nothing writes into it any more."""
        outcome: StagedRead = asyncio.get_running_loop().create_future()
        if self._closing:
            self.staging.give(slot)
            outcome.set_result(None)
            return outcome
        lower = self._lower[tier_index]
        views = self.staging.views(slot)
        watch = self._deleting.add_watch(chunk)
        size = slot.size
        read = lower.queue.submit(Priority.LOAD, lambda: lower.timed_read(lower.tier.read(chunk, views, size), size))
        if read is None:  # (loads are never refused)
            self._deleting.drop_watch(watch)
            self.staging.give(slot)
            outcome.set_result(None)
            return outcome

        def done(read: asyncio.Future) -> None:
            self._deleting.drop_watch(watch)
            failed = None if read.cancelled() else read.exception()
            if failed is not None:
                log.warning("staged read from %s failed: %s", lower.tier.name, failed)
            if (
                not read.cancelled()
                and failed is None
                and read.result()
                and not watch.deleted
                and not outcome.cancelled()
            ):
                outcome.set_result(slot)
                return
            self._give_back(slot, lower, views)
            if not outcome.done():
                outcome.set_result(None)

        read.add_done_callback(done)
        return outcome

    def blocked(self, chunk: ChunkId) -> bool:
        return self._deleting.blocks(chunk)

    # -- reading ahead for a lookup -----------------------------------------------------------

    def prefetch(self, chunk: ChunkId, size: int, tier_index: int) -> bool:
        """Read `chunk` ahead for the region load a lookup announced, if it is not being deleted
        and the pages fit in the prefetch half of staging; False when it did not start."""
        if chunk in self._prefetches:
            return True
        staging = self.staging
        if self._closing or self._deleting.blocks(chunk) or staging.used_bytes + size > staging.capacity_bytes // 2:
            return False
        slot = staging.try_take(size)
        if slot is None:
            return False
        prefetch = _Prefetch(self.start(chunk, slot, tier_index), tier_index, self._deleting.add_watch(chunk))
        self._prefetches[chunk] = prefetch
        prefetch.read.add_done_callback(lambda _: self._read_ahead(chunk, prefetch))
        return True

    def claim(self, chunk: ChunkId) -> tuple[StagedRead, int] | None:
        """A load takes the read ahead of `chunk` (done or not) and the tier it reads from; None
        if there is none (or a delete voided it)."""
        prefetch = self._forget(chunk)
        if prefetch is None:
            return None
        if prefetch.watch.deleted:
            self.give_back_when_done(prefetch.read)
            return None
        return prefetch.read, prefetch.tier_index

    def _read_ahead(self, chunk: ChunkId, prefetch: _Prefetch) -> None:
        if self._prefetches.get(chunk) is not prefetch:
            return  # claimed meanwhile
        read = prefetch.read
        if read.cancelled() or read.exception() is not None or read.result() is None:
            self._forget(chunk)  # (its pages went back with the failed read)
            return
        prefetch.expiry = asyncio.get_running_loop().call_later(PREFETCH_HOLD_S, self._unclaimed, chunk, prefetch)

    def _unclaimed(self, chunk: ChunkId, prefetch: _Prefetch) -> None:
        if self._prefetches.get(chunk) is prefetch:
            self._forget(chunk)
            self.give_back_when_done(prefetch.read)

    def _forget(self, chunk: ChunkId) -> _Prefetch | None:
        prefetch = self._prefetches.pop(chunk, None)
        if prefetch is not None:
            if prefetch.expiry is not None:
                prefetch.expiry.cancel()
            self._deleting.drop_watch(prefetch.watch)
        return prefetch

    def _give_back(self, slot: StagingSlot, lower: LowerTier, views: list[memoryview]) -> None:
        busy = lower.tier.views_busy(views)  # a peer transfer that could not be stopped
        if busy is None:
            self.staging.give(slot)
        else:
            self.staging.give_when(slot, busy)

    def give_back_when_done(self, task: StagedRead) -> None:
        """A read whose load gave up: its slot goes back when it ends."""

        def done(finished: StagedRead) -> None:
            if not finished.cancelled() and finished.exception() is None and (slot := finished.result()) is not None:
                self.staging.give(slot)

        task.add_done_callback(done)

    async def close(self) -> None:
        """After the tiers' queues have closed (every read has ended or been dropped, and given its
        pages back): drop the reads ahead, take no more reads, release staging memory."""
        self._closing = True
        for chunk in list(self._prefetches):
            prefetch = self._forget(chunk)
            if prefetch is not None:
                self.give_back_when_done(prefetch.read)
        await asyncio.sleep(0)  # (the reads' last callbacks)
        self.staging.close()
