# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A tier below RAM as the chain drives it: the tier, its bounded I/O queue, what it may be asked
(its kind's capabilities) and the latency observer around each operation."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvstored.chain.load_rate import LoadRate
from kvstored.chunks.ids import ChunkId
from kvstored.io.scheduler import Priority, TierQueue
from kvstored.tiers.base import SecondaryTier, TierCapabilities

T = TypeVar("T")
DIRECT_REMOVALS = 256  # removals run at once past a tier's backlog (a delete is never skipped)

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
    load_rate: LoadRate = field(default_factory=LoadRate)  # measured by timed_read

    async def timed(self, op: str, awaitable: Awaitable[T]) -> T:
        """Await one tier operation, reporting how long it took (queue wait not included)."""
        start = time.perf_counter()
        try:
            return await awaitable
        finally:
            self.observe(self.tier.name, op, time.perf_counter() - start)

    async def timed_read(self, read: Awaitable[bool], nbytes: int) -> bool:
        """Await one read of `nbytes` (a tier's read: True once delivered and verified), timed as
        timed() does and measured into load_rate."""
        began = self.load_rate.begin()
        ok = False
        try:
            ok = bool(await self.timed("read", read))
            return ok
        finally:
            self.load_rate.end(began, nbytes, ok)

    async def remove_all(self, chunks: Sequence[ChunkId]) -> Removal:
        """Remove chunks at deletion priority (behind loads and write-downs already queued),
        concurrently within the tier's bound. A delete is never skipped: with the backlog full,
        it runs directly. Every removal has ended when this returns, failed ones included."""

        def remove(chunk: ChunkId):
            return self.timed("remove", self.tier.remove(chunk))

        queued = [self.queue.submit(Priority.DELETE, functools.partial(remove, c)) for c in chunks]
        direct = [i for i, q in enumerate(queued) if q is None]
        waiting = [(i, q) for i, q in enumerate(queued) if q is not None]
        results: list[object] = list(queued)
        # Past the backlog, a slice at a time: a clear of 32,000 chunks started them all in one
        # loop pass (and sent the tier that many requests at once).
        for start in range(0, len(direct), DIRECT_REMOVALS):
            part = direct[start : start + DIRECT_REMOVALS]
            done = await asyncio.gather(*(remove(chunks[i]) for i in part), return_exceptions=True)
            for i, result in zip(part, done):
                results[i] = result
        done = await asyncio.gather(*(q for _, q in waiting), return_exceptions=True)
        for (i, _), result in zip(waiting, done):
            results[i] = result
        return Removal([r is True for r in results], [r for r in results if isinstance(r, BaseException)])
