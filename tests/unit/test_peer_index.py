# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The remote-location index: bits per peer and tier, LRU bound, retiring a peer incarnation in
O(1) and sweeping it later, and its memory per entry (measured, as the module docstring says)."""

from __future__ import annotations

import os
import tracemalloc

from kvstored.peer.index import BYTES_PER_ENTRY, PeerIndex

NS, OTHER = "a" * 32, "b" * 32


def keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(31, "big") for i in range(n)]


def drain(index: PeerIndex) -> None:
    for _ in index.sweep():
        pass


def test_holders_are_live_peers_ram_first():
    index = PeerIndex(100)
    a, b = index.add_peer(), index.add_peer()
    k = keys(3)
    index.add(a, 1, NS, k[:2])  # a holds them on disk
    index.add(b, 0, NS, k[1:])  # b in RAM
    assert [(h.slot, h.tier_bit) for h in index.holders((NS, k[0]))] == [(a, 1)]
    assert [(h.slot, h.tier_bit) for h in index.holders((NS, k[1]))] == [(b, 0), (a, 1)]
    assert index.holders((OTHER, k[1])) == []
    assert [bool(m) for m in index.contains(NS, k + keys(1, b"x"))] == [True, True, True, False]
    assert index.count(a) == 2 and index.count(b) == 2

    index.remove(a, 1, NS, k[:2])
    assert index.holders((NS, k[0])) == [] and len(index) == 2  # k0 is gone with its last holder
    assert index.count(a) == 0
    index.drop(b, NS, k[2])
    assert index.contains(NS, [k[2]]) == [0] and index.count(b) == 1


def test_a_chunk_in_two_tiers_of_one_peer_counts_once():
    index = PeerIndex(10)
    a = index.add_peer()
    k = keys(1)
    index.add(a, 0, NS, k)
    index.add(a, 1, NS, k)
    assert index.count(a) == 1
    index.remove(a, 0, NS, k)  # written down, then evicted from RAM: still on its disk
    assert [(h.slot, h.tier_bit) for h in index.holders((NS, k[0]))] == [(a, 1)] and index.count(a) == 1


def test_bound_evicts_least_recently_updated():
    index = PeerIndex(4)
    a = index.add_peer()
    k = keys(6)
    index.add(a, 0, NS, k[:4])
    index.add(a, 0, NS, k[:1])  # refreshed: now the most recent
    index.add(a, 0, NS, k[4:])
    assert len(index) == 4 and index.evictions == 2
    assert [bool(m) for m in index.contains(NS, k)] == [True, False, False, True, True, True]
    assert index.count(a) == 4


def test_a_retired_peer_stops_counting_at_once_and_its_slot_is_reused_after_the_sweep():
    index = PeerIndex(100)
    a, b = index.add_peer(), index.add_peer()
    k = keys(10)
    index.add(a, 0, NS, k)
    index.add(b, 2, NS, k[:5])
    index.retire(a)  # a restarted: a new incarnation
    assert index.contains(NS, k[5:]) == [0] * 5  # a's bits no longer count
    assert all(index.contains(NS, k[:5]))
    a2 = index.add_peer()
    assert a2 not in (a, b)  # a's slot is not reused before the sweep
    assert index.sweeping
    drain(index)
    assert not index.sweeping and len(index) == 5  # chunks only a held are gone
    assert index.add_peer() == a  # swept: free again, and its bits are all clear
    assert index.holders((NS, k[0]))[0].slot == b


def test_memory_per_entry_is_what_the_docstring_says():
    """~BYTES_PER_ENTRY per chunk at 1M entries spread over 5 peers (the scale-out model uses it)."""
    n = 1_000_000
    raw = [os.urandom(32) for _ in range(n)]
    index = PeerIndex(n)
    slots = [index.add_peer() for _ in range(5)]
    tracemalloc.start()
    try:
        for i, slot in enumerate(slots):
            index.add(slot, i % 2, NS, raw[i::5])
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_entry = used / n
    print(f"peer index: {per_entry:.0f} bytes per entry over {n} entries")
    assert len(index) == n
    assert 0.8 * BYTES_PER_ENTRY <= per_entry <= 1.2 * BYTES_PER_ENTRY
