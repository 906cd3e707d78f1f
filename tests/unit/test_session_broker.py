# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The session broker over a real tier chain: what sessions hold, and requests that outlive their
session (the chain waits at a gated in-memory lower tier for as long as the test needs)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import pytest

from kvstored.chain.chain import ChainPolicy
from kvstored.errors import HandleNotHeld, InvalidRequest, TransferNotStarted, UnknownRegion, UnknownSession
from kvstored.namespaces import Namespace
from kvstored.server.broker import SessionBroker
from kvstored.server.sessions import SessionRegistry
from kvstored.shm.mapping import Region
from kvstored.tiers.base import TierCapabilities
from kvstored.tiers.ram import ReserveOutcome
from tests.support.tiers import GatedMemoryTier, make_chain, settle, store

CHUNK = 64 << 10
HANG_S = 30.0  # a hang guard only: the gates stay closed until the test opens them
NS = Namespace("ns", "m", "uint8", CHUNK, "", 32)


def key(i: int) -> bytes:
    return bytes([i]) * 32


@pytest.fixture
async def rig():
    made = []

    async def make(pool: int = 1 << 20, staging_bytes: int = ChainPolicy.staging_bytes):
        tier = GatedMemoryTier()
        chain = make_chain(
            [(tier, TierCapabilities())],
            pool=pool,
            policy=ChainPolicy(writeback_wait_s=60.0, staging_bytes=staging_bytes),
        )
        await chain.start()
        broker = SessionBroker(chain)
        made.append((broker, chain))
        return broker, chain, tier

    yield make
    for broker, chain in made:
        for session in broker.sessions:
            broker.close_session(session)
        await broker.close()
        await chain.close()


@pytest.fixture
def region_fd(tmp_path):
    path = tmp_path / "region"
    path.write_bytes(bytes(4 * CHUNK))
    fd = os.open(path, os.O_RDWR)
    yield fd
    os.close(fd)


async def test_an_acquire_for_a_session_that_closed_meanwhile_leaks_no_lease(rig):
    broker, chain, tier = await rig()
    tier.data[("ns", key(1))] = b"x" * CHUNK  # only below RAM: the acquire waits for a promotion
    tier.close_gate("read")
    session = broker.open("c")
    acquiring = asyncio.create_task(broker.acquire(session, NS, [key(1)]))
    await tier.until_waiting("read")
    broker.close_session(session)  # the client's connection drops mid-Acquire
    tier.open_gate("read")
    with pytest.raises(UnknownSession):
        await acquiring
    assert broker.counts().leases == 0
    assert chain.ram.delete(("ns", key(1)))  # promoted, and nothing stayed leased
    assert chain.ram.used_bytes == 0


async def test_a_reserve_for_a_session_that_closed_meanwhile_leaves_the_key_storable(rig):
    broker, chain, tier = await rig(pool=4 * CHUNK)
    filler = broker.open("filler")
    for i in range(4):  # RAM full of dirty chunks: the next reserve waits for a write-down
        slot = (await broker.reserve(filler, NS, [key(10 + i)]))[0]
        broker.commit(filler, [slot.handle])
    tier.close_gate("write")
    session = broker.open("c")
    reserving = asyncio.create_task(broker.reserve(session, NS, [key(1)]))
    await tier.until_waiting("write")
    broker.close_session(session)
    tier.open_gate("write")
    with pytest.raises(UnknownSession):
        await reserving
    assert broker.counts().reservations == 0
    later = broker.open("c2")
    assert (await broker.reserve(later, NS, [key(1)]))[0].outcome is ReserveOutcome.RESERVED


async def test_a_session_closing_during_a_region_load_gives_unknown_session(rig, region_fd):
    broker, chain, tier = await rig()
    session = broker.open("c")
    tier.data[("ns", key(1))] = b"DATA" * (CHUNK // 4)
    tier.close_gate("read")
    region = broker.attach_region(session, "r", region_fd)
    loading = asyncio.create_task(broker.load_to_region(session, NS, region, [key(1)], [0]))
    await tier.until_waiting("read")  # the load waits for the promotion
    broker.close_session(session)
    tier.open_gate("read")
    with pytest.raises(UnknownSession):
        await loading
    assert chain.ram.delete(("ns", key(1)))  # promoted, and no lease was left behind
    assert chain.ram.used_bytes == 0


async def test_a_session_closing_during_a_region_store_stores_nothing(rig, region_fd):
    broker, chain, tier = await rig(pool=4 * CHUNK)
    for i in range(4):  # RAM full of dirty chunks: the store waits for a write-down
        await store(chain, NS, key(10 + i), i)
    tier.close_gate("write")
    session = broker.open("c")
    region = broker.attach_region(session, "r", region_fd)
    storing = asyncio.create_task(broker.store_from_region(session, NS, region, [key(1)], [0]))
    await tier.until_waiting("write")
    broker.close_session(session)
    tier.open_gate("write")
    with pytest.raises(UnknownSession):
        await storing
    assert ("ns", key(1)) not in chain.ram.chunks_of("ns")


async def test_a_region_transfer_past_its_start_deadline_copies_nothing(rig, region_fd):
    broker, chain, _ = await rig()
    session = broker.open("c")
    region = broker.attach_region(session, "r", region_fd)
    past = asyncio.get_running_loop().time() - 1
    with pytest.raises(TransferNotStarted):
        await broker.store_from_region(session, NS, region, [key(1)], [0], start_by=past)
    assert chain.ram.chunks_of("ns") == []
    await store(chain, NS, key(2), 7)
    with pytest.raises(TransferNotStarted):
        await broker.load_to_region(session, NS, region, [key(2)], [0], start_by=past)
    assert broker.counts().leases == 0 and chain.ram.delete(("ns", key(2))) and chain.ram.used_bytes == 0


async def deadline_outcome(transfer) -> BaseException | None:
    """Run a region transfer whose lower tier is held at a gate; what it raised (None: it
    returned) once it gave up by itself."""
    task = asyncio.create_task(transfer)
    done, _ = await asyncio.wait({task}, timeout=HANG_S)
    assert task in done, "the transfer waited on past its start deadline"
    return task.exception()


@pytest.mark.parametrize("gate", ["contains", "read"])
async def test_a_region_load_waiting_on_a_slow_lower_tier_gives_up_at_its_start_deadline(rig, region_fd, gate):
    """Waiting for a lookup or a promotion counts against the start deadline. The shared work is
    not cancelled: it ends later, and the chunk is there for the next load."""
    broker, chain, tier = await rig()
    session = broker.open("c")
    region = broker.attach_region(session, "r", region_fd)
    tier.data[("ns", key(1))] = b"DATA" * (CHUNK // 4)
    tier.close_gate(gate)
    start_by = asyncio.get_running_loop().time() + 0.05
    error = await deadline_outcome(broker.load_to_region(session, NS, region, [key(1)], [0], start_by=start_by))
    assert isinstance(error, TransferNotStarted), error
    assert tier.waiting[gate] == 1  # still under way
    assert bytes(region.array[:CHUNK]) == bytes(CHUNK) and broker.counts().leases == 0
    tier.open_gate(gate)
    if gate == "read":
        await settle(lambda: chain.ram.contains(("ns", key(1)), touch=False), "the promotion landing in RAM")
    assert await broker.load_to_region(session, NS, region, [key(1)], [0]) == 1
    assert bytes(region.array[:8]) == b"DATADATA"


async def test_a_region_store_waiting_for_room_gives_up_at_its_start_deadline(rig, region_fd):
    broker, chain, tier = await rig(pool=4 * CHUNK)
    for i in range(4):  # RAM full of dirty chunks: the store waits for a write-down
        await store(chain, NS, key(10 + i), i)
    tier.close_gate("write")
    session = broker.open("c")
    region = broker.attach_region(session, "r", region_fd)
    start_by = asyncio.get_running_loop().time() + 0.05
    error = await deadline_outcome(broker.store_from_region(session, NS, region, [key(1)], [0], start_by=start_by))
    assert isinstance(error, TransferNotStarted), error
    assert tier.waiting["write"] >= 1
    assert ("ns", key(1)) not in chain.ram.chunks_of("ns") and broker.counts().reservations == 0
    tier.open_gate("write")


async def test_a_region_load_waiting_for_room_to_promote_gives_up_at_its_start_deadline(rig, region_fd):
    """Without staging (staging_bytes 0), a region load promotes like Acquire: its wait for room
    (write-downs of dirty chunks) ends at the start deadline, not the longer write-back wait:
    nothing is copied, and nothing without a copy below is evicted for a transfer that will not
    start. (With staging, the load evicts nothing: tests/unit/test_region_staging.py.)"""
    broker, chain, tier = await rig(pool=4 * CHUNK, staging_bytes=0)
    for i in range(4):  # RAM full of dirty chunks: the promotion waits for a write-down
        await store(chain, NS, key(10 + i), i)
    tier.data[("ns", key(1))] = b"DATA" * (CHUNK // 4)  # below RAM only
    tier.close_gate("write")
    session = broker.open("c")
    region = broker.attach_region(session, "r", region_fd)
    start_by = asyncio.get_running_loop().time() + 0.05
    error = await deadline_outcome(broker.load_to_region(session, NS, region, [key(1)], [0], start_by=start_by))
    assert isinstance(error, TransferNotStarted), error
    assert tier.waiting["write"] >= 1  # the write-downs making room go on
    assert chain.ram.counters.dropped_dirty == 0 and ("ns", key(1)) not in chain.ram.chunks_of("ns")
    assert bytes(region.array[:CHUNK]) == bytes(CHUNK) and broker.counts().leases == 0
    tier.open_gate("write")
    assert await broker.load_to_region(session, NS, region, [key(1)], [0]) == 1
    assert bytes(region.array[:8]) == b"DATADATA"
    assert chain.ram.counters.dropped_dirty == 0


async def test_handle_batches_are_all_or_nothing(rig):
    broker, chain, _ = await rig()
    session, other = broker.open("a"), broker.open("b")
    slots = await broker.reserve(session, NS, [key(1), key(2)])
    handles = [s.handle for s in slots]
    foreign = (await broker.reserve(other, NS, [key(3)]))[0].handle
    with pytest.raises(HandleNotHeld, match=str(foreign)):
        broker.commit(session, [handles[0], foreign])
    with pytest.raises(InvalidRequest, match="twice"):
        broker.commit(session, [handles[0], handles[0]])
    assert broker.counts().reservations == 3  # the failed batches took nothing
    assert broker.commit(session, handles) == 2
    leases = await broker.acquire(session, NS, [key(1), key(2)])
    with pytest.raises(HandleNotHeld):  # a committed reservation is not a lease any more
        broker.release(session, [leases[0].handle, handles[1]])
    assert broker.counts().leases == 2
    assert broker.release(session, [lease.handle for lease in leases]) == 2
    assert broker.counts().leases == 0


async def test_closing_a_session_gives_back_everything_it_held(rig, region_fd):
    broker, chain, _ = await rig()
    session = broker.open("c")
    await store(chain, NS, key(1), 1)
    await broker.acquire(session, NS, [key(1)])
    await broker.reserve(session, NS, [key(2)])
    region = broker.attach_region(session, "r", region_fd)
    assert broker.counts().sessions == 1 and broker.counts().regions == 1
    broker.close_session(session)
    assert broker.counts().sessions == broker.counts().leases == broker.counts().reservations == 0
    assert broker.counts().regions == 0
    with pytest.raises(UnknownSession):
        broker.get(session.session_id)
    with pytest.raises(UnknownRegion):
        session.region(region.region_id)
    assert chain.ram.chunks_of("ns") == [("ns", key(1))]  # the reservation is gone, the chunk unleased
    assert chain.ram.delete(("ns", key(1))) and chain.ram.used_bytes == 0


def test_handle_ids_start_at_random_so_a_restarted_daemon_names_none_of_the_old_ones():
    first, second = SessionRegistry(), SessionRegistry()
    a = [first.new_id() for _ in range(1000)]
    b = [second.new_id() for _ in range(1000)]
    assert len(set(a)) == len(a) and not set(a) & set(b)


async def test_a_failing_background_populate_is_logged_and_close_waits_for_it(rig, region_fd, monkeypatch, caplog):
    broker, _, _ = await rig()
    started, finish = threading.Event(), threading.Event()

    def populate(region: Region) -> None:
        started.set()
        finish.wait(30)
        raise OSError("populate refused")

    monkeypatch.setattr(Region, "populate", populate)
    session = broker.open("c")
    broker.attach_region(session, "r", region_fd)
    assert await asyncio.to_thread(started.wait, 30)
    closing = asyncio.create_task(broker.close())
    await asyncio.sleep(0)
    assert not closing.done()  # the populate still runs
    with caplog.at_level(logging.WARNING, logger="kvstored.server.broker"):
        finish.set()
        await closing
    assert "background populate failed" in caplog.text and "populate refused" in caplog.text


async def test_region_stores_woken_by_the_same_write_down_do_not_both_take_its_room(rig, region_fd):
    """Two region stores with a start deadline wait for room in RAM full of chunks with no copy
    below. One write-down's room wakes both; the first takes it and the second waits for the
    next write-down instead of evicting a chunk that has no copy below (data lost)."""
    broker, chain, tier = await rig(pool=4 * CHUNK)
    for i in range(4):
        await store(chain, NS, key(10 + i), i)
    tier.close_gate("write")
    session = broker.open("c")
    region = broker.attach_region(session, "r", region_fd)
    start_by = asyncio.get_running_loop().time() + HANG_S
    storing = [
        asyncio.create_task(broker.store_from_region(session, NS, region, [key(1 + k)], [k * CHUNK], start_by=start_by))
        for k in range(2)
    ]
    await tier.until_waiting("write", 2)  # the first store's write-down, and one ahead of it
    tier.let_through("write")  # room for one store: both wake
    done, _ = await asyncio.wait(storing, timeout=HANG_S, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1 and chain.ram.counters.dropped_dirty == 0  # the other waits for its own room
    tier.open_gate("write")
    outcomes = await asyncio.gather(*storing)
    assert [o.per_key for o in outcomes] == [[ReserveOutcome.RESERVED]] * 2
    await settle(lambda: chain.writeback.in_flight_bytes == 0, "the write-downs ended")
    assert chain.ram.counters.dropped_dirty == 0
    for i in range(4):  # every chunk pushed out of RAM is below, byte-exact
        assert ("ns", key(10 + i)) in chain.ram.chunks_of("ns") or tier.data[("ns", key(10 + i))] == bytes([i]) * CHUNK


def test_a_handle_named_in_the_wrong_request_says_what_it_is_and_stays_held():
    from kvstored.errors import HandleNotHeld
    from kvstored.server.sessions import Handle, HandleKind, SessionRegistry

    session = SessionRegistry().open("c")
    session.handles[7] = Handle(HandleKind.AHEAD, None)
    session.handles[8] = Handle(HandleKind.RESERVATION, None)
    with pytest.raises(HandleNotHeld, match=r"handle 7 is a slot reserved ahead: Commit it with its key"):
        session.take_all([8, 7], (HandleKind.RESERVATION,))
    with pytest.raises(HandleNotHeld, match=r"handle 8 is a reservation of a named key: Commit it without keys"):
        session.take_all([8], (HandleKind.AHEAD,))
    with pytest.raises(HandleNotHeld, match=r"handle 9 is not held by session"):
        session.take_all([9], (HandleKind.AHEAD,))
    assert sorted(session.handles) == [7, 8]
