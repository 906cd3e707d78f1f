# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What a store does with chunks the ladder holds already, and why it drops the others: a chunk a
tier below holds by its own index is present (not copied into RAM, no RAM event, its tier named),
only a load brings it up; each dropped chunk carries its reason, and the daemon logs the reasons at
most once per reason per interval with the count since the last line."""

from __future__ import annotations

import logging
import os

import pytest

from kvstored.chain.drops import StoreDrops
from kvstored.chunks.ids import TierKind
from kvstored.events.bus import EventType
from kvstored.namespaces import Namespace
from kvstored.shm.mapping import Region
from kvstored.tiers.base import TierCapabilities
from kvstored.tiers.ram import PUBLIC, Placement, QuotaScope, ReserveOutcome
from kvstored_client.kinds import DropReason
from tests.support.tiers import GatedMemoryTier, first_word, make_chain, store

CHUNK = 64 << 10
NS = Namespace("ns", "m", "uint8", CHUNK, "", 32)
OTHER = Namespace("other", "m", "uint8", CHUNK, "", 32)  # another namespace (another tenant's, say)


def key(i: int) -> bytes:
    return bytes([i]) * 32


@pytest.fixture
async def chain_over():
    made = []

    async def make(tiers, pool: int = 16 * CHUNK):
        chain = make_chain([(t, TierCapabilities()) for t in tiers], pool=pool)
        await chain.start()
        made.append(chain)
        return chain

    yield make
    for chain in made:
        await chain.close()


@pytest.fixture
def region(tmp_path):
    path = tmp_path / "region"
    path.write_bytes(b"".join(bytes([i]) * CHUNK for i in range(8)))
    fd = os.open(path, os.O_RDWR)
    region = Region.from_fd(1, str(path), fd)
    os.close(fd)
    yield region
    region.close()


def ram_stored(chain) -> list[bytes]:
    return [k for e in chain.events.replay(1) if e.type is EventType.STORED and e.tier == "ram" for k in e.keys]


async def test_a_reserve_of_chunks_ram_or_a_tier_below_holds_reserves_only_the_new_ones(chain_over):
    below = GatedMemoryTier("fs", indexed=True)
    chain = await chain_over([below])
    below.data[("ns", key(1))] = b"\x01" * CHUNK  # on disk only (a restart's fs tier)
    await store(chain, NS, key(2), 2)  # in RAM
    grants = await chain.reserve(NS, [key(1), key(2), key(3)])
    assert [g.outcome for g in grants] == [
        ReserveOutcome.ALREADY_PRESENT,
        ReserveOutcome.ALREADY_PRESENT,
        ReserveOutcome.RESERVED,
    ]
    assert [g.present_in for g in grants] == [TierKind.FS, TierKind.RAM, TierKind.NONE]
    assert [g.drop for g in grants] == [DropReason.NONE] * 3
    chain.commit([grants[2].entry])
    assert not chain.ram.is_ready(("ns", key(1)))  # not copied into RAM
    assert ram_stored(chain) == [key(2), key(3)]  # no BlockStored for RAM of the chunk below
    assert below.calls["contains"] == 0  # no I/O asked of the tier: its index answered
    # Only a load brings it up, byte-exact.
    assert await chain.lookup(NS, [key(1)]) == [TierKind.FS]
    assert await first_word(chain, NS, key(1)) == b"\x01" * 4
    assert (await chain.reserve(NS, [key(1)]))[0].present_in is TierKind.RAM


async def test_a_region_store_of_chunks_below_copies_only_the_new_ones(chain_over, region):
    below = GatedMemoryTier("fs", indexed=True)
    chain = await chain_over([below])
    for i in (0, 1):
        below.data[("ns", key(i))] = bytes([i]) * CHUNK
    result = await chain.store_from_region(NS, region, [key(0), key(1), key(2)], [0, CHUNK, 2 * CHUNK])
    assert result.per_key == [ReserveOutcome.ALREADY_PRESENT] * 2 + [ReserveOutcome.RESERVED]
    assert result.present_in == [TierKind.FS, TierKind.FS, TierKind.NONE]
    assert result.drops == [DropReason.NONE] * 3
    assert chain.ram.chunk_count == 1 and chain.ram.counters.stored == 1
    assert ram_stored(chain) == [key(2)]


async def test_presence_is_per_namespace_and_only_where_the_tier_index_is_its_own(chain_over):
    """Another namespace's copy (another tenant's: the salt is in the namespace id) is not this
    namespace's; a tier that cannot answer from an index of its own (peer) never makes a chunk
    present; a chunk being deleted is present nowhere."""
    own, peer_like = GatedMemoryTier("fs", indexed=True), GatedMemoryTier("peer", indexed=False)
    chain = await chain_over([own, peer_like])
    own.data[("other", key(1))] = b"\x01" * CHUNK
    peer_like.data[("ns", key(2))] = b"\x02" * CHUNK
    grants = await chain.reserve(NS, [key(1), key(2)])
    assert [g.outcome for g in grants] == [ReserveOutcome.RESERVED] * 2
    chain.abort([g.entry for g in grants])
    own.data[("ns", key(3))] = b"\x03" * CHUNK
    with chain._deleting.chunks([("ns", key(3))]):
        grant = (await chain.reserve(NS, [key(3)]))[0]
    assert grant.outcome is ReserveOutcome.RESERVED
    chain.abort([grant.entry])
    assert (await chain.reserve(OTHER, [key(1)]))[0].present_in is TierKind.FS


async def test_a_store_held_by_leases_says_ram_full_and_is_an_answer_not_an_error(chain_over):
    chain = await chain_over([], pool=2 * CHUNK)
    for i in range(2):
        await store(chain, NS, key(i), i)
    leases = await chain.acquire(NS, [key(0), key(1)])
    grants = await chain.reserve(NS, [key(5), key(6)])  # (once: PoolExhausted, no reasons)
    assert [(g.outcome, g.drop) for g in grants] == [(ReserveOutcome.NO_SPACE, DropReason.RAM_FULL)] * 2
    chain.release([lease.entry for lease in leases])
    assert chain.drops.totals == {DropReason.RAM_FULL: 2}


async def test_a_store_over_its_quota_says_quota_full_and_a_concurrent_writer_in_progress(chain_over):
    chain = await chain_over([], pool=8 * CHUNK)
    quota = QuotaScope("t", limit_pages=chain.ram.pages_for(CHUNK))
    chain.ram.set_placement(lambda ns: Placement(scopes=(quota,)) if ns == "t" else PUBLIC)
    tenant_ns = Namespace("t", "m", "uint8", CHUNK, "", 32)
    await store(chain, tenant_ns, key(0), 0)
    leases = await chain.acquire(tenant_ns, [key(0)])
    assert [(g.outcome, g.drop) for g in await chain.reserve(tenant_ns, [key(1)])] == [
        (ReserveOutcome.NO_SPACE, DropReason.QUOTA_FULL)
    ]
    chain.release([lease.entry for lease in leases])
    first = (await chain.reserve(NS, [key(9)]))[0]
    second = (await chain.reserve(NS, [key(9)]))[0]
    assert (second.outcome, second.drop) == (ReserveOutcome.IN_PROGRESS, DropReason.IN_PROGRESS)
    chain.abort([first.entry])


def test_drops_log_one_line_per_reason_per_interval_with_the_count_since(caplog):
    now = [100.0]
    drops = StoreDrops(interval_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="kvstored.chain.drops")
    drops.record([DropReason.RAM_FULL] * 16 + [DropReason.NONE] * 4)
    drops.record([DropReason.IN_PROGRESS])
    now[0] = 105.0
    drops.record([DropReason.RAM_FULL] * 3)  # within the interval: counted, not logged
    drops.record([DropReason.RAM_FULL] * 2)
    now[0] = 111.0
    drops.record([DropReason.RAM_FULL])
    drops.record([DropReason.NONE] * 8)  # nothing dropped: nothing at all
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(lines) == 3
    assert lines[0][0] == logging.WARNING and lines[0][1].startswith("stores dropped 16 chunk(s) (ram_full): RAM")
    assert lines[1][0] == logging.INFO and "1 chunk(s) (in_progress)" in lines[1][1]
    assert lines[2][0] == logging.WARNING and "6 chunk(s) in 11 s (ram_full)" in lines[2][1]
    assert drops.totals == {DropReason.RAM_FULL: 22, DropReason.IN_PROGRESS: 1}
