"""Tier chain races: requests that outlive their session, deletes racing promotions and
write-downs. A slow in-memory lower tier makes the windows wide; no daemon needed."""

from __future__ import annotations

import asyncio

import pytest

from kvstored.errors import UnknownSession
from kvstored.io.scheduler import Priority, TierQueue
from kvstored.namespaces import Namespace
from kvstored.server.sessions import HandleKind, SessionRegistry
from kvstored.shm.mapping import SharedPool
from kvstored.tiers.base import SecondaryTier, TierKind, TierUsage, WriteOutcome
from kvstored.tiers.chain import ChainPolicy, TierChain
from kvstored.tiers.lower import LowerTier, WritePolicy
from kvstored.tiers.ram import RamTier, ReserveOutcome

CHUNK = 64 << 10
NS = Namespace("ns", "m", "uint8", CHUNK, "", 32)


def key(i: int) -> bytes:
    return bytes([i]) * 32


class SlowMemoryTier(SecondaryTier):
    """A lower tier in a dict whose every operation takes `delay` seconds (bytes are taken or
    handed over before the delay, as a real read of a file unlinked meanwhile would)."""

    kind = TierKind.FS

    def __init__(self, delay: float) -> None:
        super().__init__("mem")
        self.data: dict = {}
        self.delay = delay

    async def contains(self, chunks):
        return [c in self.data for c in chunks]

    async def write(self, chunk, views, size):
        payload = b"".join(bytes(v) for v in views)[:size]
        await asyncio.sleep(self.delay)
        self.data[chunk] = payload
        return WriteOutcome.WRITTEN

    async def read(self, chunk, views, size):
        payload = self.data.get(chunk)
        await asyncio.sleep(self.delay)
        if payload is None:
            return False
        offset = 0
        for view in views:
            n = min(len(view), size - offset)
            view[:n] = payload[offset:offset + n]
            offset += n
        return True

    async def remove(self, chunk):
        return self.data.pop(chunk, None) is not None

    def usage(self):
        return TierUsage(0, 0, len(self.data))


@pytest.fixture
async def rig():
    made = []

    async def make(delay: float = 0.2, pool: int = 1 << 20, concurrency: int = 2):
        sessions = SessionRegistry()
        tier = SlowMemoryTier(delay)
        chain = TierChain(RamTier(pool, 4096, has_lower_tiers=True), SharedPool(pool, populate=False), sessions,
                          [LowerTier(tier, TierQueue("mem", concurrency, 64))], ChainPolicy())
        await chain.start()
        made.append(chain)
        return chain, sessions, tier

    yield make
    for chain in made:
        await chain.close()


async def test_acquire_for_a_session_that_closed_meanwhile_leaks_no_lease(rig):
    chain, sessions, tier = await rig()
    tier.data[("ns", key(1))] = b"x" * CHUNK  # only below RAM: Acquire waits for a promotion
    session = sessions.open("c")
    acquiring = asyncio.create_task(chain.acquire(session, NS, [key(1)]))
    await asyncio.sleep(0.05)
    chain.close_session(session)  # the client's connection drops mid-Acquire
    with pytest.raises(UnknownSession):
        await acquiring
    assert chain.ram.delete(("ns", key(1)))
    assert chain.ram.used_bytes == 0  # nothing stayed leased


async def test_reserve_for_a_session_that_closed_meanwhile_leaves_the_key_storable(rig):
    chain, sessions, _ = await rig(delay=0.3, pool=4 * CHUNK)
    filler = sessions.open("filler")
    for i in range(4):  # RAM full of dirty chunks: the next reserve waits for write-downs
        grant = (await chain.reserve(filler, NS, [key(10 + i)]))[0]
        chain.commit(filler, [grant.handle])
    session = sessions.open("c")
    reserving = asyncio.create_task(chain.reserve(session, NS, [key(1)]))
    await asyncio.sleep(0.05)
    chain.close_session(session)
    with pytest.raises(UnknownSession):
        await reserving
    assert sessions.count(HandleKind.RESERVATION) == 0
    later = sessions.open("c2")
    assert (await chain.reserve(later, NS, [key(1)]))[0].outcome is ReserveOutcome.RESERVED


async def test_delete_during_a_promotion_does_not_bring_the_chunk_back(rig):
    chain, sessions, tier = await rig()
    chunk = ("ns", key(1))
    tier.data[chunk] = b"OLD!" * (CHUNK // 4)
    assert await chain.lookup(NS, [key(1)]) == [TierKind.FS]  # starts a prefetch promotion
    await asyncio.sleep(0.05)
    assert await chain.delete(NS, [key(1)]) == 1
    await asyncio.sleep(0.4)  # the promotion's read completes after the delete
    assert await chain.lookup(NS, [key(1)]) == [TierKind.NONE]
    # a new value under the same key is stored and served, never the deleted bytes
    session = sessions.open("c")
    grant = (await chain.reserve(session, NS, [key(1)]))[0]
    assert grant.outcome is ReserveOutcome.RESERVED
    extent = grant.extents[0]
    chain._pool.array[extent.offset:extent.offset + extent.length] = ord("N")
    chain.commit(session, [grant.handle])
    lease = (await chain.acquire(session, NS, [key(1)]))[0]
    extent = lease.extents[0]
    assert bytes(chain._pool.array[extent.offset:extent.offset + 4]) == b"NNNN"
    chain.release(session, [lease.handle])
    chain.close_session(session)
    assert chain.ram.delete(chunk) and chain.ram.used_bytes == 0


async def test_delete_during_a_queued_write_down_does_not_bring_the_chunk_back_below(rig):
    chain, sessions, tier = await rig(delay=0.3, pool=4 * CHUNK, concurrency=1)
    session = sessions.open("c")
    for i in range(4):
        grant = (await chain.reserve(session, NS, [key(i)]))[0]
        chain.commit(session, [grant.handle])
    # make room for two more: key(0) is written down first, key(1) waits in the queue behind it
    storing = asyncio.create_task(chain.reserve(session, NS, [key(8), key(9)]))
    await asyncio.sleep(0.05)
    assert await chain.delete(NS, [key(1)]) == 1  # queued behind key(0)'s write-down
    await storing
    await asyncio.sleep(1.0)
    assert await chain.lookup(NS, [key(1)]) == [TierKind.NONE]
    assert ("ns", key(1)) not in tier.data


def occupy_the_io_slot(chain) -> asyncio.Future:
    """Keep the lower tier's single I/O slot busy for 0.2 s: what is queued next waits, in
    priority order (loads before deletes)."""
    return chain.lower[0].queue.submit(Priority.WRITEDOWN, lambda: asyncio.sleep(0.2))


def write_chunk(chain, extents, byte: int) -> None:
    for extent in extents:
        chain._pool.array[extent.offset:extent.offset + extent.length] = byte


async def first_word(chain, session, k: bytes) -> bytes | None:
    leases = await chain.acquire(session, NS, [k])
    if not leases:
        return None
    extent = leases[0].extents[0]
    word = bytes(chain._pool.array[extent.offset:extent.offset + 4])
    chain.release(session, [leases[0].handle])
    return word


async def test_a_load_arriving_during_a_delete_does_not_bring_the_deleted_bytes_back(rig):
    """Delete drops RAM at once but removes below at deletion priority, behind queued I/O: a load
    arriving in between must not promote the copy that is about to go."""
    chain, sessions, tier = await rig(concurrency=1)
    owner, other = sessions.open("owner"), sessions.open("other")
    tier.data[("ns", key(1))] = b"OLD!" * (CHUNK // 4)
    blocker = occupy_the_io_slot(chain)
    deleting = asyncio.create_task(chain.delete(NS, [key(1)]))
    await asyncio.sleep(0.01)
    loading = asyncio.create_task(first_word(chain, other, key(1)))
    assert await deleting == 1
    assert await loading is None  # a miss: never the bytes being deleted
    assert await chain.lookup(NS, [key(1)]) == [TierKind.NONE]
    grant = (await chain.reserve(owner, NS, [key(1)]))[0]
    assert grant.outcome is ReserveOutcome.RESERVED
    write_chunk(chain, grant.extents, ord("N"))
    chain.commit(owner, [grant.handle])
    assert await first_word(chain, owner, key(1)) == b"NNNN"
    await blocker


async def test_a_cancelled_delete_still_removes_every_copy(rig):
    chain, sessions, tier = await rig(concurrency=1)
    tier.data[("ns", key(1))] = b"OLD!" * (CHUNK // 4)
    blocker = occupy_the_io_slot(chain)  # the removal waits behind it
    deleting = asyncio.create_task(chain.delete(NS, [key(1)]))
    await asyncio.sleep(0.05)
    deleting.cancel()  # the Delete RPC's deadline
    with pytest.raises(asyncio.CancelledError):
        await deleting
    await blocker
    await chain.close()  # waits for deletes still running
    assert ("ns", key(1)) not in tier.data


async def test_one_cancelled_load_does_not_fail_others_waiting_for_the_same_promotion(rig):
    chain, sessions, tier = await rig(concurrency=2)
    a, b = sessions.open("a"), sessions.open("b")
    tier.data[("ns", key(1))] = b"DATA" * (CHUNK // 4)
    first = asyncio.create_task(chain.acquire(a, NS, [key(1)]))
    second = asyncio.create_task(chain.acquire(b, NS, [key(1)]))
    await asyncio.sleep(0.05)
    first.cancel()  # a's deadline
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert len(results[1]) == 1  # b got its lease
    chain.release(b, [results[1][0].handle])
    assert await first_word(chain, a, key(1)) == b"DATA"


async def test_a_session_closing_during_a_region_load_gives_unknown_session(rig, tmp_path):
    import os

    chain, sessions, tier = await rig(concurrency=2)
    session = sessions.open("c")
    tier.data[("ns", key(1))] = b"DATA" * (CHUNK // 4)
    path = tmp_path / "region"
    path.write_bytes(bytes(CHUNK))
    fd = os.open(path, os.O_RDWR)
    region = chain.attach_region(session, "r", fd)
    os.close(fd)
    loading = asyncio.create_task(chain.load_to_region(session, NS, region, [key(1)], [0]))
    await asyncio.sleep(0.05)  # waiting for the promotion
    chain.close_session(session)
    with pytest.raises(UnknownSession):
        await loading
    assert chain.ram.delete(("ns", key(1)))  # promoted, and no lease was left behind
    assert chain.ram.used_bytes == 0


async def test_a_chunk_deleted_and_stored_again_during_its_write_down_is_reported_once_as_stored(rig):
    """The old write-down ends after the delete and the new store: no stale REMOVED(ram) may
    follow the new STORED(ram) (a router would drop a chunk RAM holds)."""
    chain, sessions, tier = await rig(delay=0.2)
    chain.writeback.policy = WritePolicy.WRITE_THROUGH
    events = []
    chain.events.add_listener(lambda e: events.append((e.tier, e.type.name, e.cause.name)))
    session = sessions.open("c")

    async def store() -> None:
        grant = (await chain.reserve(session, NS, [key(1)]))[0]
        chain.commit(session, [grant.handle])

    await store()  # its write-down starts
    await asyncio.sleep(0.05)
    deleting = asyncio.create_task(chain.delete(NS, [key(1)]))  # waits behind the write-down below
    await asyncio.sleep(0.05)
    await store()  # stored again while the first write-down still runs
    assert await deleting == 1
    await asyncio.sleep(0.6)
    ram = [e for e in events if e[0] == "ram"]
    assert ram == [("ram", "STORED", "STORED"), ("ram", "REMOVED", "DELETED"), ("ram", "STORED", "STORED")]
    assert await chain.lookup(NS, [key(1)]) == [TierKind.RAM]


async def test_a_flush_out_of_time_withdraws_its_queued_write_downs(rig):
    """At stop, flush() fills the tier's queue; what has not started by the deadline must not run
    after it (a delete queued behind would hold the stop for all of them)."""
    chain, sessions, tier = await rig(delay=0.2, concurrency=1)
    session = sessions.open("c")
    for i in range(10):
        grant = (await chain.reserve(session, NS, [key(20 + i)]))[0]
        chain.commit(session, [grant.handle])
    assert not tier.data  # write-back: nothing below yet
    flushing = asyncio.create_task(chain.writeback.flush(0.3))
    await asyncio.sleep(0.05)
    deleting = asyncio.create_task(chain.delete(NS, [key(20)]))  # queued behind the write-downs
    await flushing
    await deleting
    assert len(tier.data) < 9, "write-downs queued by the flush ran after its deadline"
