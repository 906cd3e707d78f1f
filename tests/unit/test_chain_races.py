# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Tier chain races: deletes racing promotions and write-downs, cancelled callers, a caller that
stops wanting its grant. A gated in-memory lower tier holds each operation for as long as the
test needs; no daemon, no sleeps."""

from __future__ import annotations

import asyncio

import pytest

from kvstored.chain.writeback import WritePolicy
from kvstored.chunks.ids import TierKind
from kvstored.errors import UnknownSession
from kvstored.events.bus import KvEvent
from kvstored.io.scheduler import Priority
from kvstored.namespaces import Namespace
from kvstored.tiers.base import TierCapabilities
from kvstored.tiers.ram import ReserveOutcome
from tests.support.tiers import GatedMemoryTier, first_word, make_chain, settle, store

CHUNK = 64 << 10
NS = Namespace("ns", "m", "uint8", CHUNK, "", 32)


def key(i: int) -> bytes:
    return bytes([i]) * 32


@pytest.fixture
async def rig():
    made = []

    async def make(pool: int = 1 << 20, concurrency: int = 2):
        tier = GatedMemoryTier()
        chain = make_chain([(tier, TierCapabilities())], pool=pool, concurrency=concurrency)
        await chain.start()
        made.append(chain)
        return chain, tier

    yield make
    for chain in made:
        await chain.close()


def recorder(chain) -> list[tuple[str, str, str]]:
    """(tier, type, cause) of every event the chain publishes from now on."""
    events: list[tuple[str, str, str]] = []

    def listen(e: KvEvent) -> None:
        events.append((e.tier, e.type.name, e.cause.name))

    chain.events.add_listener(listen)
    return events


def hold_the_io_slot(chain) -> asyncio.Event:
    """Occupy the lower tier's only I/O slot until the returned gate is set: what is queued next
    waits, in priority order (loads before write-downs before deletes)."""
    gate = asyncio.Event()
    chain.lower[0].queue.submit(Priority.WRITEDOWN, gate.wait)
    return gate


class Gone(Exception):
    """What a caller that stopped wanting its grant raises from `proceed`."""


async def test_an_acquire_whose_caller_gives_up_during_the_promotion_leaks_no_lease(rig):
    chain, tier = await rig()
    tier.data[("ns", key(1))] = b"x" * CHUNK  # only below RAM: the acquire waits for a promotion
    tier.close_gate("read")
    wanted = True

    def proceed() -> None:
        if not wanted:
            raise Gone

    acquiring = asyncio.create_task(chain.acquire(NS, [key(1)], proceed))
    await tier.until_waiting("read")
    wanted = False
    tier.open_gate("read")
    with pytest.raises(Gone):
        await acquiring
    assert chain.ram.delete(("ns", key(1)))  # promoted, and left unleased: deleting frees it
    assert chain.ram.used_bytes == 0


async def test_a_reserve_whose_caller_gives_up_while_waiting_for_room_reserves_nothing(rig):
    chain, tier = await rig(pool=4 * CHUNK)
    for i in range(4):  # RAM full of dirty chunks: the next reserve waits for a write-down
        await store(chain, NS, key(10 + i), i)
    tier.close_gate("write")

    def gone() -> None:
        raise UnknownSession("gone")

    reserving = asyncio.create_task(chain.reserve(NS, [key(1)], gone))
    await tier.until_waiting("write")
    tier.open_gate("write")
    with pytest.raises(UnknownSession):
        await reserving
    assert chain.ram.chunks_of("ns").count(("ns", key(1))) == 0  # not even a reservation left
    assert (await chain.reserve(NS, [key(1)]))[0].outcome is ReserveOutcome.RESERVED


async def test_delete_during_a_promotion_does_not_bring_the_chunk_back(rig):
    chain, tier = await rig()
    chunk = ("ns", key(1))
    tier.data[chunk] = b"OLD!" * (CHUNK // 4)
    tier.close_gate("read")
    assert await chain.lookup(NS, [key(1)]) == [TierKind.FS]  # starts a prefetch promotion
    await tier.until_waiting("read")  # it has the old bytes and waits to hand them over
    promotion = chain.promoter.start(chunk, CHUNK, 0)  # (in flight: the prefetch's own future)
    assert promotion is not None
    assert await chain.delete(NS, [key(1)]) == 1
    tier.open_gate("read")
    assert await promotion is False  # the read completed after the delete: not promoted
    assert await chain.lookup(NS, [key(1)]) == [TierKind.NONE]
    # a new value under the same key is stored and served, never the deleted bytes
    await store(chain, NS, key(1), ord("N"))
    assert await first_word(chain, NS, key(1)) == b"NNNN"
    assert chain.ram.delete(chunk) and chain.ram.used_bytes == 0


async def test_delete_during_a_queued_write_down_does_not_bring_the_chunk_back_below(rig):
    chain, tier = await rig(pool=4 * CHUNK, concurrency=1)
    for i in range(4):
        await store(chain, NS, key(i), i)
    events = recorder(chain)
    tier.close_gate("write")
    # make room for two more: key(0) is written down first, key(1) waits in the queue behind it
    storing = asyncio.create_task(chain.reserve(NS, [key(8), key(9)]))
    await tier.until_waiting("write")
    deleting = asyncio.create_task(chain.delete(NS, [key(1)]))  # its removal queues behind key(1)'s
    await settle(lambda: ("ram", "REMOVED", "DELETED") in events, "the delete's RAM part")
    tier.open_gate("write")
    assert await deleting == 1
    await storing
    assert await chain.lookup(NS, [key(1)]) == [TierKind.NONE]
    assert ("ns", key(1)) not in tier.data
    assert ("ns", key(0)) in tier.data


async def test_a_load_arriving_during_a_delete_does_not_bring_the_deleted_bytes_back(rig):
    """Delete drops RAM at once but removes below at deletion priority, behind queued I/O: a load
    arriving in between must not promote the copy that is about to go."""
    chain, tier = await rig(concurrency=1)
    tier.data[("ns", key(1))] = b"OLD!" * (CHUNK // 4)
    slot = hold_the_io_slot(chain)
    deleting = asyncio.create_task(chain.delete(NS, [key(1)]))
    await settle(lambda: chain.lower[0].queue.backlog[Priority.DELETE] == 1, "the removal queued")
    assert await first_word(chain, NS, key(1)) is None  # a miss: never the bytes being deleted
    slot.set()
    assert await deleting == 1
    assert await chain.lookup(NS, [key(1)]) == [TierKind.NONE]
    await store(chain, NS, key(1), ord("N"))
    assert await first_word(chain, NS, key(1)) == b"NNNN"


async def test_a_cancelled_delete_still_removes_every_copy(rig):
    chain, tier = await rig(concurrency=1)
    tier.data[("ns", key(1))] = b"OLD!" * (CHUNK // 4)
    slot = hold_the_io_slot(chain)  # the removal waits behind it
    deleting = asyncio.create_task(chain.delete(NS, [key(1)]))
    await settle(lambda: chain.lower[0].queue.backlog[Priority.DELETE] == 1, "the removal queued")
    deleting.cancel()  # the Delete RPC's deadline
    with pytest.raises(asyncio.CancelledError):
        await deleting
    assert ("ns", key(1)) in tier.data  # not yet: the removal still waits for the slot
    slot.set()
    await chain.close()  # waits for deletes still running
    assert ("ns", key(1)) not in tier.data


async def test_one_cancelled_load_does_not_fail_others_waiting_for_the_same_promotion(rig):
    chain, tier = await rig(concurrency=2)
    tier.data[("ns", key(1))] = b"DATA" * (CHUNK // 4)
    tier.close_gate("read")
    first = asyncio.create_task(chain.acquire(NS, [key(1)]))
    second = asyncio.create_task(chain.acquire(NS, [key(1)]))
    await tier.until_waiting("read")
    await settle(lambda: tier.calls["contains"] == 2, "both loads looked below RAM")
    assert tier.calls["read"] == 1  # one promotion, shared
    first.cancel()  # the first caller's deadline
    tier.open_gate("read")
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert len(results[1]) == 1  # the second got its lease
    chain.release([results[1][0].entry])
    assert await first_word(chain, NS, key(1)) == b"DATA"


async def test_a_chunk_deleted_and_stored_again_during_its_write_down_is_reported_once_as_stored(rig):
    """The old write-down ends after the delete and the new store: no stale REMOVED(ram) may
    follow the new STORED(ram) (a router would drop a chunk RAM holds)."""
    chain, tier = await rig()
    chain.writeback.policy = WritePolicy.WRITE_THROUGH
    events = recorder(chain)
    tier.close_gate("write")
    await store(chain, NS, key(1), 1)  # its write-down starts and waits
    await tier.until_waiting("write")
    deleting = asyncio.create_task(chain.delete(NS, [key(1)]))
    await settle(lambda: ("ram", "REMOVED", "DELETED") in events, "the delete's RAM part")
    await store(chain, NS, key(1), 2)  # stored again while the first write-down still runs
    tier.open_gate("write")
    assert await deleting == 1
    await settle(lambda: chain.writeback.in_flight_bytes == 0, "the write-downs ended")
    ram = [e for e in events if e[0] == "ram"]
    assert ram == [("ram", "STORED", "STORED"), ("ram", "REMOVED", "DELETED"), ("ram", "STORED", "STORED")]
    assert await chain.lookup(NS, [key(1)]) == [TierKind.RAM]


async def test_a_flush_out_of_time_withdraws_its_queued_write_downs(rig):
    """At stop, flush() fills the tier's queue; what has not started by the deadline must not run
    after it (a delete queued behind would hold the stop for all of them)."""
    chain, tier = await rig(concurrency=1)
    for i in range(10):
        await store(chain, NS, key(20 + i), i)
    assert not tier.data  # write-back: nothing below yet
    tier.close_gate("write")  # the first write-down holds the only slot past the flush's deadline
    flushing = asyncio.create_task(chain.writeback.flush(0.05))
    await tier.until_waiting("write")
    deleting = asyncio.create_task(chain.delete(NS, [key(20)]))  # queued behind the write-downs
    assert await flushing == 0  # out of time, nothing written down yet
    tier.open_gate("write")
    await deleting
    assert tier.calls["write"] == 1, "write-downs queued by the flush ran after its deadline"
