# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The chain honours what each lower tier accepts: a tier that takes no write-downs is never
written to, one that takes no deletes is never asked to remove, and both still serve reads."""

from __future__ import annotations

import pytest

from kvstored.chain.chain import ChainPolicy
from kvstored.chain.writeback import WritePolicy
from kvstored.chunks.ids import TierKind
from kvstored.namespaces import Namespace
from kvstored.tiers.base import TierCapabilities
from tests.support.tiers import GatedMemoryTier, first_word, make_chain, settle, store

CHUNK = 64 << 10
NS = Namespace("ns", "m", "uint8", CHUNK, "", 32)
READ_ONLY = TierCapabilities(accepts_writedowns=False, accepts_deletes=False)


def key(i: int) -> bytes:
    return bytes([i]) * 32


@pytest.fixture
async def chain_over():
    made = []

    async def make(tiers, pool: int = 1 << 20, policy: ChainPolicy | None = None):
        chain = make_chain(tiers, pool=pool, policy=policy)
        await chain.start()
        made.append(chain)
        return chain

    yield make
    for chain in made:
        await chain.close()


async def test_a_read_only_tier_serves_loads_but_is_never_written_down_to_nor_deleted_from(chain_over):
    shared, own = GatedMemoryTier("shared"), GatedMemoryTier("own")
    chain = await chain_over(
        [(shared, READ_ONLY), (own, TierCapabilities())], policy=ChainPolicy(write_policy=WritePolicy.WRITE_THROUGH)
    )
    shared.data[("ns", key(9))] = b"PEER" * (CHUNK // 4)  # someone else's chunk
    await store(chain, NS, key(1), ord("A"))
    await settle(lambda: chain.writeback.in_flight_bytes == 0, "the write-through")
    assert own.calls["write"] == 1 and ("ns", key(1)) in own.data
    assert shared.calls["write"] == 0 and ("ns", key(1)) not in shared.data

    assert await chain.lookup(NS, [key(9)]) == [TierKind.FS]
    assert await first_word(chain, NS, key(9)) == b"PEER"  # promoted from the read-only tier

    assert await chain.delete(NS, [key(1), key(9)]) == 2
    assert own.calls["remove"] == 2 and ("ns", key(1)) not in own.data
    assert shared.calls["remove"] == 0 and ("ns", key(9)) in shared.data
    assert await chain.clear_namespace(NS) == 0
    assert shared.calls["remove"] == 0


async def test_with_only_read_only_tiers_ram_evicts_without_waiting_for_write_downs(chain_over):
    shared = GatedMemoryTier("shared")
    shared.close_gate("write")  # a write-down would wait here forever
    chain = await chain_over([(shared, READ_ONLY)], pool=2 * CHUNK)
    for i in range(4):  # twice what RAM holds: older chunks are evicted, nothing goes down
        await store(chain, NS, key(i), i)
    assert shared.calls["write"] == 0 and not shared.data
    assert await chain.lookup(NS, [key(2), key(3)]) == [TierKind.RAM, TierKind.RAM]
