# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The chain's one leasing primitive (chain/leases.py), on a real chain: the leading chunks a load
names are leased, what RAM lacks is promoted from below and leased once it lands, and the first
chunk found nowhere ends a load's run; a peer's fetch gets each chunk this node holds itself."""

from __future__ import annotations

import asyncio

import pytest

from kvstored.chain.leases import LeaseRequest, Reach
from kvstored.chunks.ids import TierKind
from kvstored.errors import TransferNotStarted
from kvstored.namespaces import Namespace
from kvstored.tiers.base import TierCapabilities
from tests.support.tiers import GatedMemoryTier, make_chain, settle, store

CHUNK = 64 << 10
NS = Namespace("ns", "m", "uint8", CHUNK, "", 32)
A, B, C, D, E = (bytes([i]) * 32 for i in range(1, 6))  # A, E in RAM; B, D below; C nowhere


def below(tier: GatedMemoryTier, key: bytes, byte: int) -> None:
    tier.data[(NS.namespace_id, key)] = bytes([byte]) * CHUNK


def first_byte(chain, entry) -> int:
    extent = chain.leases.extents(entry)[0]
    return int(chain.arenas.array(extent.arena)[extent.offset])


@pytest.fixture
async def rig():
    fs, remote = GatedMemoryTier("fs"), GatedMemoryTier("remote")
    remote.kind = TierKind.PEER  # (a tier whose chunks are not on this node)
    chain = make_chain([(fs, TierCapabilities()), (remote, TierCapabilities(local=False))])
    await chain.start()
    await store(chain, NS, A, ord("a"))
    await store(chain, NS, E, ord("e"))
    below(fs, B, ord("b"))
    below(fs, D, ord("d"))
    yield chain, fs, remote
    await chain.close()


def leased_now(chain, key: bytes) -> int:
    entry = chain.leases.pin((NS.namespace_id, key))
    assert entry is not None
    chain.leases.release([entry])
    return entry.leases


async def test_a_load_leases_the_leading_run_and_promotes_what_ram_lacks_up_to_the_first_miss(rig):
    chain, fs, _ = rig
    leased = await chain.leases.lease(NS, [A, B, C, D, E])
    entries = leased.entries
    assert [e is not None for e in entries] == [True, True, False, False, False]
    assert [first_byte(chain, e) for e in leased.held] == [ord("a"), ord("b")]
    assert fs.calls["read"] == 1  # B promoted; D, past the miss, is not read
    assert leased_now(chain, E) == 0  # nor is E, in RAM past the miss, leased
    chain.release(leased.held)
    assert leased_now(chain, A) == 0 and leased_now(chain, B) == 0


async def test_a_peers_fetch_gets_every_chunk_this_node_holds_each_on_its_own(rig):
    chain, fs, remote = rig
    F = bytes([6]) * 32
    below(remote, F, ord("f"))  # only on a tier whose chunks are not this node's
    leased = await chain.leases.lease(NS, [A, B, C, D, E, F], LeaseRequest(Reach.EACH, local_only=True))
    assert [first_byte(chain, e) if e is not None else None for e in leased.entries] == [
        ord("a"),
        ord("b"),
        None,
        ord("d"),
        ord("e"),
        None,
    ]
    assert fs.calls["read"] == 2 and remote.calls["read"] == 0
    chain.release(leased.held)


async def test_a_load_past_its_start_deadline_fails_and_holds_nothing(rig):
    chain, fs, _ = rig
    fs.close_gate("contains")
    start_by = asyncio.get_running_loop().time() + 0.05
    with pytest.raises(TransferNotStarted):
        await chain.leases.lease(NS, [A, B], LeaseRequest(start_by=start_by))
    assert leased_now(chain, A) == 0  # the leading hit it had leased is given back
    fs.open_gate("contains")


async def test_a_peers_fetch_past_its_deadline_gets_what_landed_and_the_rest_lands_later(rig):
    chain, fs, _ = rig
    fs.close_gate("read")
    start_by = asyncio.get_running_loop().time() + 0.05
    leased = await chain.leases.lease(NS, [A, B], LeaseRequest(Reach.EACH, start_by=start_by, local_only=True))
    assert [e is not None for e in leased.entries] == [True, False]  # B's promotion had not landed
    chain.release(leased.held)
    fs.open_gate("read")
    await settle(lambda: chain.ram.contains((NS.namespace_id, B), touch=False), "B's promotion")
