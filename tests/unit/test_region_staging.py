# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Region loads past a full RAM: hits below RAM come through staging memory, evicting nothing.

A real chain over a gated in-memory lower tier and a real region file; the gates hold reads and
write-downs for as long as a test needs (no timing)."""

from __future__ import annotations

import asyncio
import os

import pytest

from kvstored.chain.chain import ChainPolicy
from kvstored.chunks.ids import TierKind
from kvstored.errors import TransferNotStarted, UnknownRegion
from kvstored.namespaces import Namespace
from kvstored.shm.mapping import Region
from kvstored.tiers.base import TierCapabilities
from kvstored_client.kinds import LoadInto
from tests.support.tiers import GatedMemoryTier, make_chain, settle, store

CHUNK = 64 << 10
NS = Namespace("ns", "m", "uint8", CHUNK, "", 32)
HANG_S = 30.0  # a hang guard only


def key(i: int) -> bytes:
    return bytes([i]) * 32


def payload(i: int) -> bytes:
    return bytes([i]) * CHUNK


@pytest.fixture
async def rig(tmp_path):
    made = []

    async def make(
        pool: int = 4 * CHUNK, staging_chunks: float = 8, region_chunks: int = 8, tier: GatedMemoryTier | None = None
    ):
        tier = tier or GatedMemoryTier()
        chain = make_chain(
            [(tier, TierCapabilities())],
            pool=pool,
            concurrency=4,
            policy=ChainPolicy(writeback_wait_s=60.0, staging_bytes=int(staging_chunks * CHUNK)),
        )
        await chain.start()
        path = tmp_path / f"region{len(made)}"
        path.write_bytes(bytes(region_chunks * CHUNK))
        fd = os.open(path, os.O_RDWR)
        region = Region.from_fd(len(made) + 1, str(path), fd)
        os.close(fd)
        made.append((chain, region))
        return chain, tier, region

    yield make
    for chain, region in made:
        region.close()
        await chain.close()


async def fill_ram_with_dirty_chunks(chain, tier, count: int = 4) -> None:
    """RAM full of chunks that have no copy below; write-downs held at their gate."""
    for i in range(count):
        await store(chain, NS, key(100 + i), 100 + i)
    tier.close_gate("write")


def read_ahead(chain, k: bytes) -> bool:
    """A lookup's read ahead of chunk `k` is held, unclaimed."""
    return ("ns", k) in chain.staged._prefetches


def reads_ahead_done(chain) -> bool:
    return all(p.read.done() for p in chain.staged._prefetches.values())


def chunk_at(region: Region, index: int) -> bytes:
    return bytes(region.array[index * CHUNK : (index + 1) * CHUNK])


async def load(chain, region, keys, start_by: float | None = None) -> int:
    offsets = [i * CHUNK for i in range(len(keys))]
    return await asyncio.wait_for(chain.load_to_region(NS, region, keys, offsets, start_by=start_by), HANG_S)


async def test_a_region_load_past_a_full_ram_reads_through_staging_and_evicts_nothing(rig):
    chain, tier, region = await rig()
    await fill_ram_with_dirty_chunks(chain, tier)
    for i in range(3):
        tier.data[("ns", key(i))] = payload(i)  # below RAM only
    assert await chain.lookup(NS, [key(0), key(1), key(2)], LoadInto.REGION) == [TierKind.FS] * 3
    assert await load(chain, region, [key(0), key(1), key(2)]) == 3
    assert [chunk_at(region, i) for i in range(3)] == [payload(i) for i in range(3)]
    assert tier.calls["write"] == 0  # nothing written down to make room
    assert sorted(chain.ram.chunks_of("ns")) == sorted(("ns", key(100 + i)) for i in range(4))
    assert chain.ram.counters.dropped_dirty == 0 and chain.ram.counters.evictions == 0
    assert chain.staged.served == 3 and chain.staged.staging.used_bytes == 0


async def test_a_pool_lookup_still_makes_room_for_its_hits(rig):
    """Acquire needs its chunks in RAM: a POOL lookup starts the write-downs that make room."""
    chain, tier, _ = await rig()
    await fill_ram_with_dirty_chunks(chain, tier)
    tier.data[("ns", key(0))] = payload(0)
    assert await chain.lookup(NS, [key(0)], LoadInto.POOL) == [TierKind.FS]
    await tier.until_waiting("write")


async def test_with_free_ram_a_region_load_promotes_as_before(rig):
    chain, tier, region = await rig(pool=16 * CHUNK)
    tier.data[("ns", key(0))] = payload(0)
    assert await load(chain, region, [key(0)]) == 1
    assert chunk_at(region, 0) == payload(0)
    assert chain.ram.contains(("ns", key(0)), touch=False)  # promoted: the next load finds it in RAM
    assert chain.staged.served == 0


async def test_a_load_larger_than_staging_goes_on_as_pages_come_back(rig):
    """Staging holds 2 chunks, the load needs 7 from below and one RAM hit in between: every
    chunk arrives, in order, and staging is empty afterwards."""
    chain, tier, region = await rig(staging_chunks=2)
    await fill_ram_with_dirty_chunks(chain, tier)
    keys = [key(i) for i in range(7)] + [key(100)]  # the last is in RAM
    for i in range(7):
        tier.data[("ns", key(i))] = payload(i)
    assert await load(chain, region, keys) == 8
    assert [chunk_at(region, i) for i in range(7)] == [payload(i) for i in range(7)]
    assert chunk_at(region, 7) == payload(100)
    assert chain.staged.served == 7 and chain.staged.staging.used_bytes == 0
    assert chain.ram._index[("ns", key(100))].leases == 0  # the RAM hit's lease went back


class CorruptingTier(GatedMemoryTier):
    """Reads of the chunks in `corrupt` fail verification (the tier reports a miss)."""

    def __init__(self) -> None:
        super().__init__()
        self.corrupt: set = set()

    async def read(self, chunk, views, size) -> bool:
        ok = await super().read(chunk, views, size)
        return ok and chunk not in self.corrupt


async def test_a_chunk_that_is_not_delivered_ends_the_load_there(rig):
    """The third chunk's read fails verification: the load copies the two before it, none after
    (their reads succeed), and every staging page goes back."""
    chain, tier, region = await rig(tier=CorruptingTier())
    await fill_ram_with_dirty_chunks(chain, tier)
    for i in range(5):
        tier.data[("ns", key(i))] = payload(i)
    tier.corrupt.add(("ns", key(2)))
    assert await load(chain, region, [key(i) for i in range(5)]) == 2
    assert [chunk_at(region, i) for i in range(2)] == [payload(i) for i in range(2)]
    assert [chunk_at(region, i) for i in range(2, 5)] == [bytes(CHUNK)] * 3  # nothing past the end
    assert tier.calls["read"] == 5
    await settle(lambda: chain.staged.staging.used_bytes == 0, "the staging pages coming back")


async def test_a_staged_chunk_deleted_while_it_is_read_is_not_served(rig):
    chain, tier, region = await rig()
    await fill_ram_with_dirty_chunks(chain, tier)
    tier.data[("ns", key(0))] = payload(0)
    tier.close_gate("read")
    loading = asyncio.create_task(load(chain, region, [key(0)]))
    await tier.until_waiting("read")  # the read has taken the bytes and waits at the gate
    assert await chain.delete(NS, [key(0)]) == 1
    tier.open_gate("read")
    assert await loading == 0
    assert chunk_at(region, 0) == bytes(CHUNK)
    await settle(lambda: chain.staged.staging.used_bytes == 0, "the staging pages coming back")


async def test_loads_sharing_a_small_staging_do_not_wait_on_each_other(rig):
    """Two loads of 4 chunks each over staging for 3: both finish (a load never waits for pages
    while it holds some)."""
    chain, tier, region = await rig(staging_chunks=3)
    await fill_ram_with_dirty_chunks(chain, tier)
    for i in range(8):
        tier.data[("ns", key(i))] = payload(i)
    first = chain.load_to_region(NS, region, [key(i) for i in range(4)], [i * CHUNK for i in range(4)])
    second = chain.load_to_region(NS, region, [key(i) for i in range(4, 8)], [i * CHUNK for i in range(4, 8)])
    assert await asyncio.wait_for(asyncio.gather(first, second), HANG_S) == [4, 4]
    assert [chunk_at(region, i) for i in range(8)] == [payload(i) for i in range(8)]
    assert chain.staged.staging.used_bytes == 0


async def test_a_load_that_finds_staging_taken_gives_up_at_its_start_deadline(rig):
    """Another load holds every staging page (its reads held at the gate): a load whose first
    chunk needs pages waits for them only until its start deadline, copying nothing."""
    chain, tier, region = await rig(staging_chunks=2)
    await fill_ram_with_dirty_chunks(chain, tier)
    for i in range(3):
        tier.data[("ns", key(i))] = payload(i)
    tier.close_gate("read")
    holder = asyncio.create_task(load(chain, region, [key(0), key(1)]))
    await tier.until_waiting("read", 2)
    assert chain.staged.staging.used_bytes == 2 * CHUNK
    start_by = asyncio.get_running_loop().time() + 0.05
    with pytest.raises(TransferNotStarted):
        await chain.load_to_region(NS, region, [key(2)], [2 * CHUNK], start_by=start_by)
    assert chunk_at(region, 2) == bytes(CHUNK)
    tier.open_gate("read")
    assert await holder == 2
    assert await load(chain, region, [key(2)]) == 1  # (pages free again)
    assert chain.staged.staging.used_bytes == 0


async def test_a_region_lookup_evicts_nothing_and_starts_no_write_down(rig):
    chain, tier, _ = await rig()
    await fill_ram_with_dirty_chunks(chain, tier)
    tier.data[("ns", key(0))] = payload(0)
    assert await chain.lookup(NS, [key(0)], LoadInto.REGION) == [TierKind.FS]
    await settle(lambda: tier.calls["read"] == 1, "the read ahead")
    assert chain.staged.staging.used_bytes == CHUNK  # read ahead into staging, not RAM
    assert tier.calls["write"] == 0 and not chain._prefetches  # nothing pushed out of RAM for it
    assert sorted(chain.ram.chunks_of("ns")) == sorted(("ns", key(100 + i)) for i in range(4))


async def test_closing_the_chain_with_a_staged_read_held_gives_its_pages_back(rig):
    chain, tier, region = await rig()
    await fill_ram_with_dirty_chunks(chain, tier)
    tier.data[("ns", key(0))] = payload(0)
    tier.close_gate("read")
    loading = asyncio.create_task(chain.load_to_region(NS, region, [key(0)], [0]))
    await tier.until_waiting("read")
    staged = chain.staged
    tier.open_gate("read")  # (close() waits for the queue's running reads)
    await chain.close()
    await asyncio.gather(loading, return_exceptions=True)
    assert staged.staging.used_bytes == 0


async def test_chunks_larger_than_staging_are_promoted_as_acquire_would(rig):
    """Staging smaller than one chunk can never hold one: the load promotes it, after the write-down
    that makes its room."""
    chain, tier, region = await rig(staging_chunks=0.5)
    await fill_ram_with_dirty_chunks(chain, tier)
    tier.open_gate("write")
    tier.data[("ns", key(0))] = payload(0)
    assert await load(chain, region, [key(0)]) == 1
    assert chunk_at(region, 0) == payload(0)
    assert tier.calls["write"] >= 1 and chain.ram.counters.dropped_dirty == 0
    assert chain.ram.contains(("ns", key(0)), touch=False) and chain.staged.served == 0


async def test_a_region_lookup_reads_ahead_into_staging_and_its_load_claims_the_read(rig):
    chain, tier, region = await rig()
    await fill_ram_with_dirty_chunks(chain, tier)
    for i in range(2):
        tier.data[("ns", key(i))] = payload(i)
    assert await chain.lookup(NS, [key(0), key(1)], LoadInto.REGION) == [TierKind.FS] * 2
    await settle(lambda: tier.calls["read"] == 2, "the reads ahead")
    assert chain.staged.staging.used_bytes == 2 * CHUNK and tier.calls["write"] == 0
    assert await load(chain, region, [key(0), key(1)]) == 2
    assert [chunk_at(region, i) for i in range(2)] == [payload(0), payload(1)]
    assert tier.calls["read"] == 2  # nothing read twice
    assert chain.staged.served == 2 and chain.staged.staging.used_bytes == 0


async def test_reads_ahead_take_at_most_half_of_staging(rig):
    chain, tier, _ = await rig(staging_chunks=4)
    await fill_ram_with_dirty_chunks(chain, tier)
    for i in range(4):
        tier.data[("ns", key(i))] = payload(i)
    await chain.lookup(NS, [key(i) for i in range(4)], LoadInto.REGION)
    await settle(lambda: tier.calls["read"] == 2, "the reads ahead")
    await asyncio.sleep(0)
    assert tier.calls["read"] == 2 and chain.staged.staging.used_bytes == 2 * CHUNK


async def test_a_read_ahead_no_load_claims_gives_its_pages_back(rig, monkeypatch):
    monkeypatch.setattr("kvstored.chain.staged.PREFETCH_HOLD_S", 0.0)
    chain, tier, _ = await rig()
    await fill_ram_with_dirty_chunks(chain, tier)
    tier.data[("ns", key(0))] = payload(0)
    await chain.lookup(NS, [key(0)], LoadInto.REGION)
    await settle(lambda: tier.calls["read"] == 1, "the read ahead")
    await settle(lambda: chain.staged.staging.used_bytes == 0, "its pages coming back")
    assert not read_ahead(chain, key(0))


async def test_a_chunk_deleted_after_it_was_read_ahead_is_not_served(rig):
    chain, tier, region = await rig()
    await fill_ram_with_dirty_chunks(chain, tier)
    tier.data[("ns", key(0))] = payload(0)
    await chain.lookup(NS, [key(0)], LoadInto.REGION)
    await settle(lambda: chain.staged.staging.used_bytes == CHUNK and tier.calls["read"] == 1, "the read ahead")
    await settle(lambda: reads_ahead_done(chain), "the read ahead ending")
    assert await chain.delete(NS, [key(0)]) == 1
    tier.data[("ns", key(0))] = payload(9)  # (even if the tier had it again, the staged bytes are void)
    assert await load(chain, region, [key(0)]) == 1
    assert chunk_at(region, 0) == payload(9)  # read again, not the bytes read before the delete
    assert tier.calls["read"] == 2
    await settle(lambda: chain.staged.staging.used_bytes == 0, "the pages coming back")


async def test_a_load_holding_reads_ahead_gives_them_back_before_it_waits_for_pages(rig):
    """Staging for 4 chunks: a lookup read k2 and k3 ahead (the prefetch half), load B holds the
    other half at the gate, load A wants k0..k3. A gives k2 and k3 back instead of waiting for
    pages while holding them, and both loads finish."""
    chain, tier, region = await rig(staging_chunks=4)
    await fill_ram_with_dirty_chunks(chain, tier)
    for i in range(6):
        tier.data[("ns", key(i))] = payload(i)
    await chain.lookup(NS, [key(2), key(3)], LoadInto.REGION)
    await settle(lambda: tier.calls["read"] == 2 and reads_ahead_done(chain), "the reads ahead")
    tier.close_gate("read")
    b = asyncio.create_task(chain.load_to_region(NS, region, [key(4), key(5)], [4 * CHUNK, 5 * CHUNK]))
    await tier.until_waiting("read", 2)
    a = asyncio.create_task(load(chain, region, [key(i) for i in range(4)]))
    await tier.until_waiting("read", 4)  # A read k0 and k1 with the pages k2 and k3 gave back
    tier.open_gate("read")
    assert await asyncio.wait_for(asyncio.gather(a, b), HANG_S) == [4, 2]
    assert [chunk_at(region, i) for i in range(6)] == [payload(i) for i in range(6)]
    assert chain.staged.staging.used_bytes == 0


async def test_pages_given_back_just_before_a_deadline_bound_wait_still_wake_it(rig):
    """A load with a start deadline whose first chunk finds no pages gives back the read ahead it
    claimed for its second chunk and waits for pages: that give-back wakes it (the wait is armed
    before the pages come back), so it reads its first chunk at once instead of at the deadline."""
    chain, tier, region = await rig(staging_chunks=2)
    await fill_ram_with_dirty_chunks(chain, tier)
    for i in (0, 1, 9):
        tier.data[("ns", key(i))] = payload(i)
    await chain.lookup(NS, [key(1)], LoadInto.REGION)
    await settle(lambda: read_ahead(chain, key(1)) and reads_ahead_done(chain), "k1 read ahead")
    tier.close_gate("read")
    holder = asyncio.create_task(chain.load_to_region(NS, region, [key(9)], [7 * CHUNK]))
    await tier.until_waiting("read")  # the holder has the other page
    start_by = asyncio.get_running_loop().time() + HANG_S
    loading = asyncio.create_task(chain.load_to_region(NS, region, [key(0), key(1)], [0, CHUNK], start_by=start_by))
    await tier.until_waiting("read", 2)  # k0 read with k1's pages, well before the deadline
    tier.open_gate("read")
    assert await asyncio.wait_for(loading, HANG_S) == 2 and await holder == 1
    assert [chunk_at(region, 0), chunk_at(region, 1)] == [payload(0), payload(1)]
    assert chain.staged.staging.used_bytes == 0


async def test_a_region_closed_between_copies_ends_the_load_with_unknown_region(rig):
    """A load longer than staging has started copying when its session ends (the region closes):
    the next copy stops with UnknownRegion (NOT_FOUND), and every page comes back."""
    chain, tier, region = await rig(staging_chunks=2)
    await fill_ram_with_dirty_chunks(chain, tier)
    for i in range(4):
        tier.data[("ns", key(i))] = payload(i)
    tier.close_gate("read")
    loading = asyncio.create_task(load(chain, region, [key(i) for i in range(4)]))
    await tier.until_waiting("read", 2)
    tier.let_through("read", 2)  # k0 and k1: the transfer starts
    await tier.until_waiting("read", 2)  # k2 and k3, with the pages k0 and k1 gave back
    region.close()
    tier.open_gate("read")
    with pytest.raises(UnknownRegion, match="closed during the transfer"):
        await loading
    await settle(lambda: chain.staged.staging.used_bytes == 0, "the pages coming back")


async def test_ram_hits_behind_a_miss_are_pinned_while_the_load_looks_below(rig):
    """The load's second chunk is in RAM (clean, at the cold end) while its first is looked up
    below: a store meanwhile evicts the cold end, but not that chunk: the load gets both."""
    chain, tier, region = await rig()
    tier.data[("ns", key(1))] = payload(1)
    chain.release([lease.entry for lease in await chain.acquire(NS, [key(1)])])  # promoted: clean, cold end
    for i in range(3):
        await store(chain, NS, key(100 + i), 100 + i)  # RAM full
    tier.data[("ns", key(0))] = payload(0)
    tier.close_gate("contains")
    loading = asyncio.create_task(load(chain, region, [key(0), key(1)]))
    await tier.until_waiting("contains")
    await store(chain, NS, key(103), 103)  # needs room: the clean cold end would go first
    tier.open_gate("contains")
    assert await loading == 2
    assert [chunk_at(region, 0), chunk_at(region, 1)] == [payload(0), payload(1)]
