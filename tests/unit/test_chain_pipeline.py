# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The tier chain's write-back and promotion pipeline: stores short of room keep the lower tier's
I/O slots busy, a load reads into free RAM while the write-downs making room for the rest of it
run, and a stream several times larger than RAM loses nothing and serves exact bytes. A gated
in-memory lower tier holds the I/O where a test needs it to; no daemon, no sleeps."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstored.chunks.ids import TierKind
from kvstored.namespaces import Namespace
from kvstored.tiers.base import TierCapabilities
from kvstored.tiers.ram import PUBLIC, Placement, QuotaScope, ReserveOutcome
from tests.support.tiers import GatedMemoryTier, make_chain, settle, store

CHUNK = 64 << 10
NS = Namespace("ns", "m", "uint8", CHUNK, "", 32)


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


@pytest.fixture
async def rig():
    made = []

    async def make(pool: int, concurrency: int):
        tier = GatedMemoryTier()
        chain = make_chain([(tier, TierCapabilities())], pool=pool, concurrency=concurrency)
        await chain.start()
        made.append(chain)
        return chain, tier

    yield make
    for chain in made:
        await chain.close()


async def test_a_store_short_of_room_keeps_every_io_slot_of_the_tier_busy(rig):
    """Write-downs go beyond the store's own shortfall (one per I/O slot), so the next store's
    room is on its way while this one copies: the disk never idles between stores."""
    chain, tier = await rig(pool=16 * CHUNK, concurrency=4)
    for i in range(16):
        await store(chain, NS, key(i), i)  # RAM full of chunks with no copy below (no headroom)
    tier.close_gate("write")
    storing = asyncio.create_task(chain.reserve(NS, [key(100), key(101)]))
    await tier.until_waiting("write", 4)  # every I/O slot of the tier busy, not just two
    await settle(lambda: chain.writeback.in_flight_bytes == 6 * CHUNK, "2 write-downs for the store + 4 ahead")
    assert not storing.done()  # it waits for its room: nothing without a copy below was dropped
    tier.open_gate("write")
    grants = await storing
    assert [g.outcome for g in grants] == [ReserveOutcome.RESERVED] * 2
    chain.abort([g.entry for g in grants])
    await settle(lambda: chain.writeback.in_flight_bytes == 0, "the write-downs ended")
    assert chain.ram.counters.dropped_dirty == 0
    for i in range(6):  # the six oldest went down, byte-exact
        assert tier.data[("ns", key(i))] == bytes([i]) * CHUNK


async def test_a_load_reads_into_free_ram_while_write_downs_make_room_for_the_rest(rig):
    """A load whose chunks are below RAM starts reading the first into free RAM at once; it does
    not wait for the write-downs that make room for the others."""
    chain, tier = await rig(pool=16 * CHUNK, concurrency=4)
    for i in range(3):
        tier.data[("ns", key(50 + i))] = bytes([50 + i]) * CHUNK  # below RAM only
    for i in range(15):
        await store(chain, NS, key(i), i)  # one chunk of RAM free, the rest without a copy below
    tier.close_gate("write")
    tier.close_gate("read")
    loading = asyncio.create_task(chain.acquire(NS, [key(50), key(51), key(52)]))
    await tier.until_waiting("read")  # the first promotion reads into the free chunk...
    assert tier.waiting["write"] >= 1  # ...while the write-downs for the other two still wait
    tier.open_gate("read")
    tier.open_gate("write")
    leases = await loading
    assert len(leases) == 3
    for lease, i in zip(leases, range(50, 53)):
        for extent in lease.extents:
            assert (chain.arenas.array(extent.arena)[extent.offset : extent.offset + extent.length] == i).all()
    chain.release([lease.entry for lease in leases])
    await settle(lambda: chain.writeback.in_flight_bytes == 0, "the write-downs ended")
    assert chain.ram.counters.dropped_dirty == 0


async def test_a_stream_of_stores_and_loads_larger_than_ram_loses_nothing(rig):
    """Concurrent stores four times the size of RAM, then concurrent loads of all of it: every
    chunk pushed out of RAM was written down first, and every load serves the exact bytes."""
    chain, _ = await rig(pool=16 * CHUNK, concurrency=4)
    rng = np.random.default_rng(7)
    payloads = {i: rng.integers(0, 256, CHUNK, dtype=np.uint8) for i in range(64)}

    async def store_batch(first: int) -> None:
        keys = [key(i) for i in range(first, first + 4)]
        grants = await chain.reserve(NS, keys)
        for grant, i in zip(grants, range(first, first + 4)):
            assert grant.outcome is ReserveOutcome.RESERVED
            offset = 0
            for extent in grant.extents:
                chain.arenas.array(extent.arena)[extent.offset : extent.offset + extent.length] = payloads[i][
                    offset : offset + extent.length
                ]
                offset += extent.length
        chain.commit([g.entry for g in grants])

    async def storer(firsts: list[int]) -> None:
        for first in firsts:
            await store_batch(first)

    await asyncio.gather(*(storer(list(range(k * 4, 64, 16))) for k in range(4)))

    async def load_batch(first: int) -> None:
        keys = [key(i) for i in range(first, first + 4)]
        leases = await chain.acquire(NS, keys)
        try:
            assert len(leases) == 4, f"batch {first}: {len(leases)} of 4 loaded"
            for lease, i in zip(leases, range(first, first + 4)):
                got = np.concatenate(
                    [chain.arenas.array(e.arena)[e.offset : e.offset + e.length] for e in lease.extents]
                )
                np.testing.assert_array_equal(got, payloads[i])
        finally:
            chain.release([lease.entry for lease in leases])

    async def loader(firsts: list[int]) -> None:
        for first in firsts:
            await load_batch(first)

    await asyncio.gather(*(loader(list(range(k * 4, 64, 8))) for k in range(2)))
    await settle(lambda: chain.writeback.in_flight_bytes == 0, "the write-downs ended")
    assert chain.ram.counters.dropped_dirty == 0


async def test_a_lookup_starts_every_promotion_its_load_will_need_even_with_ram_full(rig):
    """The misses of a request are known at its lookup: the chunks found below RAM start their
    promotion then, all of them (bounded by the tier's queue), the ones without room as the
    write-downs started for them free it; the load that follows waits for those, reading
    nothing twice."""
    chain, tier = await rig(pool=16 * CHUNK, concurrency=4)
    for i in range(3):
        tier.data[("ns", key(50 + i))] = bytes([50 + i]) * CHUNK
    for i in range(16):
        await store(chain, NS, key(i), i)  # RAM full, nothing below yet
    tier.close_gate("read")
    found = await chain.lookup(NS, [key(50), key(51), key(52), key(99)])
    assert found == [TierKind.FS, TierKind.FS, TierKind.FS, TierKind.NONE]
    await tier.until_waiting("read", 3)  # all three read, no load asked yet
    tier.open_gate("read")
    leases = await chain.acquire(NS, [key(50), key(51), key(52)])
    assert len(leases) == 3
    for lease, i in zip(leases, range(50, 53)):
        for extent in lease.extents:
            assert (chain.arenas.array(extent.arena)[extent.offset : extent.offset + extent.length] == i).all()
    chain.release([lease.entry for lease in leases])
    assert tier.calls["read"] == 3  # nothing read twice
    await settle(lambda: chain.writeback.in_flight_bytes == 0, "the write-downs ended")
    assert chain.ram.counters.dropped_dirty == 0
    for i in range(3):  # the oldest chunks made the room, after their write-down
        assert tier.data[("ns", key(i))] == bytes([i]) * CHUNK


async def test_closing_the_chain_ends_a_lookup_prefetch_still_waiting_for_room(rig):
    chain, tier = await rig(pool=16 * CHUNK, concurrency=4)
    tier.data[("ns", key(50))] = bytes([50]) * CHUNK
    for i in range(16):
        await store(chain, NS, key(i), i)
    tier.close_gate("write")  # no room will come
    assert await chain.lookup(NS, [key(50)]) == [TierKind.FS]
    await tier.until_waiting("write")
    assert chain._prefetches  # waiting for its room
    await chain.close()  # with the write-downs still held: it must not wait for them
    assert not chain._prefetches


async def test_a_lookup_for_a_namespace_at_its_quota_makes_room_within_the_quota(rig):
    """A tenant's (or namespace's) quota is full while the tier has room: the promotions a lookup
    starts (the leading quarter of the quota) wait for write-downs of the quota's own oldest
    chunks, the others are not prefetched at all, instead of evicting those chunks without a
    copy below; the other namespaces' chunks stay in RAM, not written down."""
    chain, tier = await rig(pool=16 * CHUNK, concurrency=4)
    quota = QuotaScope("t", limit_pages=4 * chain.ram.pages_for(CHUNK))
    chain.ram.set_placement(lambda ns: Placement(scopes=(quota,)) if ns == "t" else PUBLIC)
    tenant_ns = Namespace("t", "m", "uint8", CHUNK, "", 32)
    for i in range(8):
        await store(chain, NS, key(i), i)  # public chunks, no copy below; the tier keeps room
    for i in range(4):
        await store(chain, tenant_ns, key(20 + i), 20 + i)  # the quota full, no copy below
    for i in range(2):
        tier.data[("t", key(50 + i))] = bytes([50 + i]) * CHUNK  # below RAM only
    tier.close_gate("write")
    found = await chain.lookup(tenant_ns, [key(50), key(51)])
    assert found == [TierKind.FS, TierKind.FS]
    await tier.until_waiting("write")  # the quota's oldest goes down first (a quarter of 4 chunks)
    assert chain.ram.counters.dropped_dirty == 0 and quota.evictions == 0
    assert tier.calls["read"] == 0  # no room within the quota yet: nothing read
    tier.open_gate("write")
    await settle(lambda: chain.ram.contains(("t", key(50)), touch=False), "the prefetch landing once it had room")
    leases = await chain.acquire(tenant_ns, [key(50), key(51)])
    assert len(leases) == 2
    for lease, i in zip(leases, range(50, 52)):
        for extent in lease.extents:
            assert (chain.arenas.array(extent.arena)[extent.offset : extent.offset + extent.length] == i).all()
    chain.release([lease.entry for lease in leases])
    assert tier.calls["read"] == 2  # nothing read twice
    await settle(lambda: chain.writeback.in_flight_bytes == 0, "the write-downs ended")
    assert chain.ram.counters.dropped_dirty == 0
    assert quota.used_pages <= quota.limit_pages
    for i in range(2):  # the quota's oldest made the room, after their write-down
        assert tier.data[("t", key(20 + i))] == bytes([20 + i]) * CHUNK
    assert not any(chunk[0] == "ns" for chunk in tier.data)  # nothing public was pushed down
    assert all(chain.ram.contains(("ns", key(i)), touch=False) for i in range(8))
