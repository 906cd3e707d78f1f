# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What the chain does for the peer tier: a slot a failed network read may still write stays
reserved until the transfer lets go of it (never handed to another chunk meanwhile), and the
serving side finds chunks only in tiers whose chunks are on this node."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvstored.chunks.ids import ChunkId, TierKind
from kvstored.namespaces import Namespace
from kvstored.tiers.base import TierCapabilities
from kvstored.tiers.ram import ReserveOutcome
from tests.support.tiers import GatedMemoryTier, make_chain

CHUNK = 64 << 10
NS = Namespace("ns", "m", "uint8", CHUNK, "", 32)
KEY = b"k" * 32


class StuckReadTier(GatedMemoryTier):
    """Its reads fail while their transfer still holds the slot (a quarantine), until let go."""

    kind = TierKind.PEER

    def __init__(self) -> None:
        super().__init__("peer")
        self.let_go: asyncio.Future | None = None

    async def read(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> bool:
        self.calls["read"] += 1
        self.let_go = asyncio.get_running_loop().create_future()
        return False

    def views_busy(self, views):
        return self.let_go


async def test_a_slot_a_failed_read_may_still_write_stays_reserved_until_let_go():
    tier = StuckReadTier()
    tier.data[("ns", KEY)] = b"x" * CHUNK
    chain = make_chain(
        [(tier, TierCapabilities(accepts_writedowns=False, accepts_deletes=False, local=False))], pool=4 * CHUNK
    )
    await chain.start()
    try:
        assert await chain.acquire(NS, [KEY]) == []  # the read failed: a miss
        assert tier.calls["read"] == 1
        assert chain.ram.used_bytes == CHUNK  # ...but its slot is still the transfer's
        grant = (await chain.reserve(NS, [KEY]))[0]
        assert grant.outcome is ReserveOutcome.IN_PROGRESS  # not handed out again
        tier.let_go.set_result(None)
        await asyncio.sleep(0)
        assert chain.ram.used_bytes == 0
        grant = (await chain.reserve(NS, [KEY]))[0]
        assert grant.outcome is ReserveOutcome.RESERVED
        chain.abort([grant.entry])
    finally:
        await chain.close()


async def test_serving_peers_looks_only_in_tiers_whose_chunks_are_on_this_node():
    disk, shared = GatedMemoryTier("fs"), GatedMemoryTier("s3")
    chain = make_chain([(disk, TierCapabilities()), (shared, TierCapabilities(local=False))])
    await chain.start()
    try:
        on_disk, in_bucket = ("ns", b"d" * 32), ("ns", b"s" * 32)
        disk.data[on_disk] = shared.data[in_bucket] = b"x" * CHUNK
        assert await chain.promoter.find([on_disk, in_bucket]) == [0, 1]
        assert await chain.promoter.find([on_disk, in_bucket], local_only=True) == [0, None]
        assert shared.calls["contains"] == 1  # asked by the first find only
    finally:
        await chain.close()
