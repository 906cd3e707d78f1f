# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""After a hand-over the RAM index is adopted unverified and checked lazily (kvstored/chain/verify.py):
a chunk whose bytes changed after the hand-over is a miss on its first read, never served nor
written down, counted and published; the sweep checks all the rest. A real RAM tier and pool,
taken over by a second chain as a new daemon takes them over (same arenas, the snapshot adopted),
and an in-memory lower tier; no daemon, no sleeps."""

from __future__ import annotations

import dataclasses

import pytest

from kvstored.chain.chain import ChainPolicy, TierChain
from kvstored.events.bus import KvEvent
from kvstored.namespaces import Namespace
from kvstored.server import handover
from kvstored.tiers.base import TierCapabilities
from kvstored.tiers.ram import RamTier
from tests.support.tiers import GatedMemoryTier, first_word, make_chain, settle, store

CHUNK = 64 << 10
PAGE = 4096
NS = Namespace("ns", "m", "uint8", CHUNK, "", 32)
N = 8


def key(i: int) -> bytes:
    return bytes([i]) * 32


@pytest.fixture
async def adopted():
    """(chain, tier, events): a chain that adopted N chunks (chunk i all bytes i + 1, dirty) from
    another one over the same pool, unverified; its sweep not started."""
    tier = GatedMemoryTier()
    old = make_chain([(tier, TierCapabilities())], pool=1 << 20, page=PAGE)
    await old.start()
    for i in range(N):
        await store(old, NS, key(i), i + 1)
    records = handover.with_checksums(old.ram.snapshot().chunks, old.arenas.view, PAGE, 2)
    snapshot = old.ram.snapshot()  # (the old chain is not closed: the new one takes over its tier and queue)
    ram = RamTier(1 << 20, PAGE, has_lower_tiers=True)
    assert ram.adopt(dataclasses.replace(snapshot, chunks=records), verify=True).chunks == N
    chain = TierChain(ram, old.arenas, old.lower, ChainPolicy(writeback_wait_s=60.0))
    events: list[tuple[str, str, tuple[bytes, ...]]] = []

    def listen(e: KvEvent) -> None:
        events.append((e.type.name, e.cause.name, e.keys))

    chain.events.add_listener(listen)
    yield chain, tier, events
    await chain.close()


def alter(chain: TierChain, i: int) -> None:
    """Flip one byte of chunk i in the pool, as a stray writer would after the hand-over."""
    entry = chain.ram._index[("ns", key(i))]
    offset = entry.runs[0].start * PAGE + 100
    chain.arenas.array(entry.arena)[offset] ^= 0xFF


async def test_a_chunk_altered_after_the_handover_is_a_miss_on_its_first_load_and_counted(adopted):
    chain, _tier, events = adopted
    assert chain.ram.unverified_count == N
    alter(chain, 3)
    assert await first_word(chain, NS, key(2)) == bytes([3]) * 4  # verified, then served
    assert await first_word(chain, NS, key(3)) is None  # its bytes changed: a miss, never served
    c = chain.ram.counters
    assert (c.verified_chunks, c.verified_bytes, c.verify_failures) == (1, CHUNK, 1)
    assert chain.ram.unverified_count == N - 2
    assert ("REMOVED", "CORRUPT", (key(3),)) in events
    assert not chain.ram.contains(("ns", key(3)))  # dropped from RAM: its pages are free again
    # A batch load stops at the altered chunk, as at any miss.
    alter(chain, 5)
    leases = await chain.acquire(NS, [key(4), key(5), key(6)])
    assert [lease.entry.chunk for lease in leases] == [("ns", key(4))]
    chain.release([lease.entry for lease in leases])
    assert c.verify_failures == 2


async def test_a_pin_without_an_earlier_check_verifies_the_chunk_itself(adopted):
    chain, _tier, _events = adopted
    alter(chain, 1)
    assert chain.leases.pin(("ns", key(1))) is None
    entry = chain.leases.pin(("ns", key(0)))
    assert entry is not None and entry.verified
    chain.leases.release([entry])
    assert chain.ram.counters.verify_failures == 1


async def test_an_altered_dirty_chunk_is_never_written_down(adopted):
    chain, tier, _events = adopted
    alter(chain, 6)
    assert await chain.writeback.flush(30.0) == N - 1
    assert ("ns", key(6)) not in tier.data
    assert all(tier.data[("ns", key(i))] == bytes([i + 1]) * CHUNK for i in range(N) if i != 6)
    assert chain.ram.counters.verify_failures == 1


async def test_the_sweep_verifies_every_adopted_chunk_and_drops_the_altered(adopted):
    chain, _tier, events = adopted
    alter(chain, 7)
    assert not chain.verifier.status().running
    chain.verifier.start_sweep()
    await settle(lambda: chain.verifier.status().finished, "the sweep's end")
    c = chain.ram.counters
    assert chain.ram.unverified_count == 0
    assert (c.verified_chunks, c.verified_bytes, c.verify_failures) == (N - 1, (N - 1) * CHUNK, 1)
    assert ("REMOVED", "CORRUPT", (key(7),)) in events
    for i in range(N - 1):
        assert await first_word(chain, NS, key(i)) == bytes([i + 1]) * 4
    assert await first_word(chain, NS, key(7)) is None
    # What the sweep verified carries its checksum to the next hand-over: nothing to hash then.
    assert all(r.checksum is not None for r in chain.ram.snapshot().chunks)


async def test_close_stops_a_sweep_under_way(adopted):
    chain, _tier, _events = adopted
    chain.verifier.start_sweep()
    await chain.verifier.close()
    assert not chain.verifier.status().running


async def test_checksums_taken_while_serving_are_those_a_stop_would_take():
    """Before a hand-over's stop the old daemon hashes what RAM holds while it still serves; the
    stop then takes only the rest, and gets the same values."""
    chain = make_chain([], pool=1 << 20, page=PAGE)
    await chain.start()
    try:
        for i in range(N):
            await store(chain, NS, key(i), i + 1)
        assert await chain.verifier.hash_unknown() == N
        await store(chain, NS, key(N), 99)  # stored after: the stop takes its checksum
        records = chain.ram.snapshot().chunks
        assert [r.checksum is None for r in records] == [False] * N + [True]
        expected = handover.chunk_checksums(records, chain.arenas.view, PAGE, 1)
        taken = handover.with_checksums(records, chain.arenas.view, PAGE, 2)
        assert [r.checksum for r in taken] == expected
        assert await chain.verifier.hash_unknown() == 1 and await chain.verifier.hash_unknown() == 0
    finally:
        await chain.close()
