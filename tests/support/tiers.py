# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A small real lower tier for chain tests: chunks in a dict, lookups, reads and writes held at gates.

No timing: a test closes a gate, waits until an operation has arrived at it (`until`), does what
it wants to race with that operation, then opens the gate.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence

from kvstored.chain.chain import ChainPolicy, TierChain, no_namespaces
from kvstored.chain.load_rate import Clock, LoadRate
from kvstored.chain.lower import LowerTier
from kvstored.chain.recompute import NamespaceFinder
from kvstored.chunks.ids import ChunkId, TierKind
from kvstored.io.scheduler import TierQueue
from kvstored.namespaces import Namespace
from kvstored.shm.arenas import ArenaSet
from kvstored.shm.mapping import SharedPool
from kvstored.tiers.base import SecondaryTier, TierCapabilities, TierUsage, WriteOutcome
from kvstored.tiers.ram import RamTier

GATED_OPS = ("contains", "read", "write")
SPINS = 100_000  # loop turns `settle` waits at most (a hang fails the test instead)


async def settle(predicate: Callable[[], bool], what: str = "the condition") -> None:
    """Let the loop run until `predicate()` holds: a wait on other tasks' progress, not on time."""
    for _ in range(SPINS):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{what} never held")


class GatedMemoryTier(SecondaryTier):
    """Chunks in a dict. Lookups, reads and writes wait at their gate (open unless closed); a read takes the
    bytes before its gate, and a write hands them over after it, as a real tier's I/O would."""

    kind = TierKind.FS

    def __init__(self, name: str = "mem", indexed: bool = False) -> None:
        super().__init__(name)
        self.indexed = indexed  # holds() answers from `data`, as fs and s3 do from their index
        self.data: dict[ChunkId, bytes] = {}
        self.calls: Counter[str] = Counter()  # operations called, by name
        self.waiting: Counter[str] = Counter()  # operations at their gate now
        self._open = {op: True for op in GATED_OPS}
        self._passes: Counter[str] = Counter()  # operations let through a closed gate, not yet taken
        self._changed = {op: asyncio.Event() for op in GATED_OPS}

    def close_gate(self, op: str) -> None:
        self._open[op] = False

    def open_gate(self, op: str) -> None:
        self._open[op] = True
        self._changed[op].set()

    def let_through(self, op: str, count: int = 1) -> None:
        """Let `count` operations (waiting or to come) pass the closed gate, one each."""
        self._passes[op] += count
        self._changed[op].set()

    async def until_waiting(self, op: str, count: int = 1) -> None:
        await settle(lambda: self.waiting[op] >= count, f"{count} {op}(s) at the gate")

    async def _gate(self, op: str) -> None:
        self.waiting[op] += 1
        try:
            while not self._open[op]:
                if self._passes[op]:
                    self._passes[op] -= 1
                    return
                self._changed[op].clear()  # (checked and cleared with no await between: no lost wake-up)
                await self._changed[op].wait()
        finally:
            self.waiting[op] -= 1

    def holds(self, chunks: Sequence[ChunkId]) -> list[bool]:
        self.calls["holds"] += 1
        return [self.indexed and c in self.data for c in chunks]

    async def contains(self, chunks: Sequence[ChunkId]) -> list[bool]:
        self.calls["contains"] += 1
        await self._gate("contains")
        return [c in self.data for c in chunks]

    async def write(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> WriteOutcome:
        self.calls["write"] += 1
        payload = b"".join(bytes(v) for v in views)[:size]
        await self._gate("write")
        self.data[chunk] = payload
        return WriteOutcome.WRITTEN

    async def read(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> bool:
        self.calls["read"] += 1
        payload = self.data.get(chunk)
        await self._gate("read")
        if payload is None:
            return False
        offset = 0
        for view in views:
            n = min(len(view), size - offset)
            view[:n] = payload[offset : offset + n]
            offset += n
        return True

    async def remove(self, chunk: ChunkId) -> bool:
        self.calls["remove"] += 1
        return self.data.pop(chunk, None) is not None

    def known_chunks(self, namespace_id: str) -> list[ChunkId]:
        return [c for c in self.data if c[0] == namespace_id]

    def usage(self) -> TierUsage:
        return TierUsage(0, sum(map(len, self.data.values())), len(self.data))


def make_chain(
    tiers: Sequence[tuple[SecondaryTier, TierCapabilities]],
    pool: int = 1 << 20,
    page: int = 4096,
    concurrency: int = 2,
    policy: ChainPolicy | None = None,
    namespaces: NamespaceFinder = no_namespaces,
    clock: Clock = time.monotonic,
) -> TierChain:
    """A chain over a fresh pool and the given lower tiers (not started). `namespaces` and
    `clock`: what its recompute gate knows of namespaces, and its time (rates and probes)."""
    lower = [
        LowerTier(tier, TierQueue(tier.name, concurrency, 64), capabilities=caps, load_rate=LoadRate(clock=clock))
        for tier, caps in tiers
    ]
    # Stores wait for write-downs as long as a test holds them (no timeout decides a race).
    policy = policy or ChainPolicy(writeback_wait_s=60.0)
    return TierChain(
        RamTier(pool, page, has_lower_tiers=bool(lower)),
        ArenaSet(SharedPool(pool, populate=False)),
        lower,
        policy,
        namespaces=namespaces,
        clock=clock,
    )


async def store(chain: TierChain, ns: Namespace, key: bytes, byte: int) -> None:
    """Store one chunk whose every byte is `byte` (reserve, fill the pool slot, commit)."""
    grant = (await chain.reserve(ns, [key]))[0]
    assert grant.entry is not None, grant.outcome
    fill(chain, grant.extents, byte)
    chain.commit([grant.entry])


def fill(chain: TierChain, extents, byte: int) -> None:
    for extent in extents:
        chain.arenas.array(extent.arena)[extent.offset : extent.offset + extent.length] = byte


async def first_word(chain: TierChain, ns: Namespace, key: bytes) -> bytes | None:
    """The first 4 bytes of a chunk as a load sees them (None: a miss)."""
    leases = await chain.acquire(ns, [key])
    if not leases:
        return None
    extent = leases[0].extents[0]
    word = bytes(chain.arenas.array(extent.arena)[extent.offset : extent.offset + 4])
    chain.release([leases[0].entry])
    return word
