# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""load_to_region when RAM may be full: hits below RAM come through staging memory, evicting nothing.

The chunks of a load, in order: RAM hits are leased; promotions under way are awaited; reads
ahead by the load's lookup are claimed; a hit below RAM is promoted into free RAM if RAM has
some, else read from its tier into staging pages (chain/staged.py). Nothing is evicted or written
down for a region load: the engine's region is where its chunks live next.

Before the copy starts, the load waits (until `start_by`) for its leases, its promotions and the
staged reads staging had pages for; then it copies that leading run. Staging is bounded, so a
long load goes on from there: as pages come back, the next chunks are read and each is copied
in order once verified. A load never waits for pages while it holds any, so two loads cannot
wait on each other. The load ends at the first chunk found nowhere or not delivered; it returns
how many leading chunks it copied.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstored.chain.leases import Leases
from kvstored.chain.region_copy import RegionCopies
from kvstored.chain.staged import StagedRead, StagedReads
from kvstored.chain.start_by import StartWaits
from kvstored.chunks.ids import ChunkId, TierKind
from kvstored.namespaces import Namespace
from kvstored.shm.copier import CopyJob
from kvstored.shm.mapping import Region
from kvstored.shm.staging import StagingSlot
from kvstored.tiers.ram import RamEntry


@dataclass(eq=False)
class _Step:
    """One chunk of the load and where its bytes come from."""

    chunk: ChunkId
    offset: int  # in the region
    size: int
    lease: RamEntry | None = None  # in RAM, leased
    promotion: asyncio.Future | None = None  # being promoted into RAM: leased once it lands
    tier: int | None = None  # the lower tier it is read from through staging
    below: int | None = None  # = tier while that read waits for pages
    read: StagedRead | None = None  # that read, under way
    slot: StagingSlot | None = None  # read and verified
    failed: bool = False  # not delivered: the load ends before it

    @property
    def ready(self) -> bool:
        return self.lease is not None or self.slot is not None

    @property
    def waiting_for_pages(self) -> bool:
        return self.below is not None  # (cleared once its read starts)


class RegionLoader:
    """Region loads through staging. Its RAM side is the chain's leasing primitive (chain/leases.py:
    pin, locate, promote into free RAM, land); what RAM cannot take comes through `staged`."""

    def __init__(self, leases: Leases, staged: StagedReads, waits: StartWaits, copies: RegionCopies) -> None:
        self._leases = leases
        self._staged = staged
        self._waits = waits
        self._copies = copies

    def serves(self, ns: Namespace) -> bool:
        """Whether staging can hold a chunk of `ns` (else its region loads promote, evicting)."""
        return self._staged.staging.holds(ns.chunk_bytes)

    async def load(
        self,
        ns: Namespace,
        region: Region,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        proceed: Callable[[], None],
        start_by: float | None,
    ) -> int:
        steps = await self._plan(ns, keys, offsets, start_by)
        try:
            await self._ready_first(steps, start_by)
            proceed()  # (no await from here to the copy's start)
            copied = await self._copy_leading(region, steps)
            copied = await self._go_on(region, steps, copied)
        finally:
            self._abandon(steps)
        return copied

    # -- before the copy starts -------------------------------------------------------------

    async def _plan(
        self, ns: Namespace, keys: Sequence[bytes], offsets: Sequence[int], start_by: float | None
    ) -> list[_Step]:
        """A step per leading chunk that is somewhere: leased, promoting, or to be staged."""
        wanted = [((ns.namespace_id, k), offset) for k, offset in zip(keys, offsets)]
        steps: list[_Step] = []
        await self._leases.check([c for c, _ in wanted])  # (adopted chunks: verified before their lease)
        # RAM hits pinned before the lookup below awaits: a full RAM would evict them meanwhile.
        leases = {c: entry for c, _ in wanted if (entry := self._leases.pin(c)) is not None}
        ahead = {c: claimed for c, _ in wanted if c not in leases and (claimed := self._staged.claim(c)) is not None}
        unknown = [
            c for c, _ in wanted if c not in leases and c not in ahead and self._leases.in_flight(c) is TierKind.NONE
        ]
        try:
            found = dict(zip(unknown, await self._leases.locate(unknown, start_by)))
        except BaseException:
            self._drop(leases, ahead)
            self._abandon(steps)
            raise
        for chunk, offset in wanted:
            step = _Step(chunk, offset, ns.chunk_bytes, leases.pop(chunk, None) or self._leases.pin(chunk))
            if step.lease is None and chunk in ahead:
                step.read, step.tier = ahead.pop(chunk)  # read ahead by its lookup
            elif step.lease is None:
                step.promotion = self._leases.pending(chunk)
                tier_index = found.get(chunk)
                if step.promotion is None and tier_index is not None and not self._staged.blocked(chunk):
                    step.tier = tier_index  # (a promotion that lands and goes again is staged instead)
                    if self._leases.fits(ns):  # free RAM: promote (others may want it)
                        step.promotion = self._leases.promote(chunk, ns.chunk_bytes, tier_index, evict=False)
                    if step.promotion is None:
                        step.below = tier_index
            if step.lease is None and step.promotion is None and step.tier is None:
                break  # found nowhere: the load ends before it
            steps.append(step)
        self._drop(leases, ahead)  # past the end of the load
        return steps

    def _drop(self, leases: dict[ChunkId, RamEntry], ahead: dict[ChunkId, tuple[StagedRead, int]]) -> None:
        self._leases.release(list(leases.values()))
        for read, _ in ahead.values():
            self._staged.give_back_when_done(read)

    async def _ready_first(self, steps: list[_Step], start_by: float | None) -> None:
        """Wait (until start_by) for the promotions and for the staged reads staging has pages
        for now; for pages too when the first chunk needs them (other loads hold them all)."""
        self._launch(steps, 0)
        while steps and steps[0].waiting_for_pages:
            if not self._hold_none_after(steps, 0):
                await self._waits.until(start_by, self._staged.staging.wait_for_room())
            self._launch(steps, 0)
        waits = [s.promotion for s in steps if s.promotion is not None] + [s.read for s in steps if s.read]
        if waits:  # shielded: promotions serve other loads too; staged reads end on their own
            await self._waits.until(start_by, asyncio.gather(*map(asyncio.shield, waits), return_exceptions=True))
        for step in steps:
            self._settle(step)

    def _launch(self, steps: list[_Step], start: int) -> None:
        """Start the staged reads from `start` on, in order, while staging has pages."""
        for step in steps[start:]:
            if step.below is None:
                continue
            slot = self._staged.staging.try_take(step.size)
            if slot is None:
                return  # in order: the later ones wait for pages behind this one
            step.read = self._staged.start(step.chunk, slot, step.below)
            step.below = None

    def _settle(self, step: _Step) -> None:
        """A promotion or a staged read that ended: lease the promoted chunk, keep the slot."""
        if step.promotion is not None and step.promotion.done() and step.lease is None and not step.failed:
            landed = not step.promotion.cancelled() and step.promotion.exception() is None and step.promotion.result()
            step.lease = self._leases.land(step.chunk) if landed else None
            step.promotion = None
            if step.lease is None and landed and step.tier is not None:
                step.below = step.tier  # landed and evicted again before its lease: read it through staging
            else:
                step.failed = step.lease is None
        if step.read is not None and step.read.done() and step.slot is None and not step.failed:
            step.slot = step.read.result() if not step.read.cancelled() else None
            step.failed = step.slot is None
            step.read = None

    # -- copies -----------------------------------------------------------------------------

    async def _copy_leading(self, region: Region, steps: list[_Step]) -> int:
        """Copy the leading run of ready steps, RAM's and staging's each in one batch."""
        n = 0
        while n < len(steps) and steps[n].ready:
            n += 1
        leases = [(s.offset, s.lease) for s in steps[:n] if s.lease is not None]
        slots = [(s.offset, s.slot) for s in steps[:n] if s.slot is not None]
        if leases:
            await self._copy(
                region,
                self._leases.pool_of(leases[0][1]),
                [CopyJob(offset, self._leases.extents(entry)) for offset, entry in leases],
            )
        if slots:
            staging = self._staged.staging
            await self._copy(region, staging.array, [CopyJob(offset, staging.extents(slot)) for offset, slot in slots])
        for step in steps[:n]:
            self._give_back(step)
        self._staged.served += len(slots)
        return n

    async def _go_on(self, region: Region, steps: list[_Step], copied: int) -> int:
        """Once the copy has started: the chunks staging had no pages for, each read as pages come
        back and copied in order. Runs to the end (a started transfer is not given up)."""
        staging = self._staged.staging
        while copied < len(steps) and not steps[copied].failed:
            step = steps[copied]
            self._launch(steps, copied)
            if step.waiting_for_pages:
                if not self._hold_none_after(steps, copied):
                    await staging.wait_for_room()
                continue
            if step.read is not None:
                await asyncio.wait((step.read,))
                self._settle(step)
            if step.slot is not None:
                await self._copy(region, staging.array, [CopyJob(step.offset, staging.extents(step.slot))])
                self._staged.served += 1
            elif step.lease is not None:
                await self._copy(
                    region, self._leases.pool_of(step.lease), [CopyJob(step.offset, self._leases.extents(step.lease))]
                )
            else:
                break
            self._give_back(step)
            copied += 1
        return copied

    # -- giving back ------------------------------------------------------------------------

    def _give_back(self, step: _Step) -> None:
        if step.lease is not None:
            self._leases.release([step.lease])
            step.lease = None
        if step.slot is not None:
            self._staged.staging.give(step.slot)
            step.slot = None

    def _hold_none_after(self, steps: list[_Step], index: int) -> bool:
        """Before waiting for pages: give back those of later steps (only reads ahead by a lookup
        can hold them: reads start in order), to read those chunks again later. A load that
        waits for pages holds none, so no two loads wait on each other. True if pages came back
        now (then there is no need to wait)."""
        gave = False
        for step in steps[index + 1 :]:
            if step.read is None and step.slot is None:
                continue  # (leased, promoting, failed, or already waiting for pages)
            if step.read is not None:
                self._staged.give_back_when_done(step.read)
                step.read = None
            if step.slot is not None:
                self._staged.staging.give(step.slot)
                step.slot = None
                gave = True
            step.below = step.tier
        return gave

    def _abandon(self, steps: list[_Step]) -> None:
        """What the load will not copy: leases and pages back now, reads' pages once they end."""
        for step in steps:
            self._give_back(step)
            if step.read is not None:
                self._staged.give_back_when_done(step.read)
                step.read = None
            step.below = None
            step.failed = True

    async def _copy(self, region: Region, source: np.ndarray, jobs: list[CopyJob]) -> None:
        """Copy chunks from the pool or staging (`source`) into the region."""
        await self._copies.copy(region, source, jobs, to_pool=False)
