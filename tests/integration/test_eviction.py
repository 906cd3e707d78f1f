# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""RAM tier capacity and eviction through the real daemon: LRU order, the capacity bound, and
leases that keep a chunk (and its bytes) in place while the pool churns."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

from kvstored_client import StoreOutcome, StoreResult, Tier
from tests.support.data import make_keys, payloads
from tests.support.rpc import raw

PAGE = 64 << 10
POOL = "1MiB"  # 16 pages
SLOTS = 16


@pytest.fixture
def small(daemon_factory):
    return daemon_factory(cpu_bytes=POOL)


def present(client, ns, keys) -> list[bool]:
    return [t is Tier.RAM for t in client.lookup(ns, keys).tiers]


def test_lru_order_with_lookups_and_loads(small, ns_name):
    with small.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=PAGE)
        keys = make_keys(ns_name, SLOTS + 2)
        data = payloads(keys, PAGE)
        for i in range(SLOTS):  # fill the pool, oldest first: k0 .. k15
            assert c.store(ns, [keys[i]], data[i]).stored == 1
        assert small.stats().tiers[0].evictions == 0

        assert c.lookup(ns, [keys[0]]).prefix_hits == 1  # touch the oldest
        assert c.store(ns, [keys[SLOTS]], data[SLOTS]).stored == 1  # evicts one chunk
        # The touched chunk survived; the oldest untouched one (k1) went.
        got = present(c, ns, keys[: SLOTS + 1])  # (this lookup touches k0, k2..k16 in that order)
        assert got == [True, False] + [True] * (SLOTS - 1)
        assert small.stats().tiers[0].evictions == 1

        # Reading a chunk is a use too: k0 is the oldest now; load it, then store one more.
        out = np.zeros((1, PAGE), np.uint8)
        assert c.load(ns, [keys[0]], out) == 1
        np.testing.assert_array_equal(out[0], data[0])
        assert c.store(ns, [keys[SLOTS + 1]], data[SLOTS + 1]).stored == 1
        got = present(c, ns, keys)
        assert got[0] is True and got[2] is False  # k2 (oldest after k0's read) was evicted
        assert got.count(True) == SLOTS

        # Every survivor still holds its own bytes.
        alive = [k for k, p in zip(keys, got) if p]
        rows = np.zeros((len(alive), PAGE), np.uint8)
        assert c.load(ns, alive, rows) == len(alive)
        np.testing.assert_array_equal(rows, payloads(alive, PAGE))


def test_capacity_bound_one_chunk_at_a_time(small, ns_name):
    chunk = 100 << 10  # two pages each: 8 fit
    fit = SLOTS // 2
    with small.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=chunk)
        keys = make_keys(ns_name, 3 * fit)
        data = payloads(keys, chunk)
        for i, key in enumerate(keys):
            assert c.store(ns, [key], data[i]).stored == 1
            ram = small.stats().tiers[0]
            assert ram.used_bytes <= ram.capacity_bytes == SLOTS * PAGE
            assert ram.chunks == min(i + 1, fit)
        assert present(c, ns, keys) == [False] * (2 * fit) + [True] * fit
        out = np.zeros((fit, chunk), np.uint8)
        assert c.load(ns, keys[-fit:], out) == fit
        np.testing.assert_array_equal(out, data[-fit:])
        ram = small.stats().tiers[0]
        assert ram.evictions == 2 * fit
        assert ram.used_bytes == ram.capacity_bytes


def test_capacity_bound_one_big_batch(small, ns_name):
    """A single store of twice the pool keeps exactly a pool's worth and drops the rest."""
    with small.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=PAGE)
        keys = make_keys(ns_name, 2 * SLOTS)
        data = payloads(keys, PAGE)
        res = c.store(ns, keys, data)
        assert res.stored == SLOTS
        assert res.stored + res.already_present + res.dropped == 2 * SLOTS
        ram = small.stats().tiers[0]
        assert ram.used_bytes == ram.capacity_bytes
        assert ram.chunks == SLOTS
        assert small.stats().reservations == 0
        hits = [k for k, p in zip(keys, present(c, ns, keys)) if p]
        assert len(hits) == SLOTS
        out = np.zeros((SLOTS, PAGE), np.uint8)
        assert c.load(ns, hits, out) == SLOTS
        np.testing.assert_array_equal(out, payloads(hits, PAGE))


def test_lease_blocks_eviction_and_keeps_bytes_in_place(small, ns_name):
    with small.client() as c, raw(small.socket) as r:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=PAGE)
        leased_key = make_keys(ns_name + "/leased", 1)
        leased_data = payloads(leased_key, PAGE)
        assert c.store(ns, leased_key, leased_data).stored == 1

        r.register(ns_name, PAGE)
        leases = r.acquire(ns.namespace_id, leased_key)
        assert len(leases) == 1
        assert r.read_extents(leases[0].extents) == leased_data[0].tobytes()
        assert small.stats().leases == 1

        # Store two pools' worth, one chunk at a time: everything else churns.
        others = make_keys(ns_name + "/others", 2 * SLOTS)
        other_data = payloads(others, PAGE)
        for key, row in zip(others, other_data):
            assert c.store(ns, [key], row).stored == 1
            assert small.stats().tiers[0].used_bytes <= SLOTS * PAGE
        assert small.stats().tiers[0].evictions >= SLOTS
        # The leased chunk was neither evicted nor overwritten.
        assert r.read_extents(leases[0].extents) == leased_data[0].tobytes()
        assert c.lookup(ns, leased_key).prefix_hits == 1
        assert present(c, ns, others).count(True) == SLOTS - 1  # one slot is pinned

        assert r.release([leases[0].handle]) == 1
        assert small.stats().leases == 0
        out = np.zeros_like(leased_data)
        assert c.load(ns, leased_key, out) == 1
        np.testing.assert_array_equal(out, leased_data)

        # Unleased, it is an ordinary chunk again: a pool's worth of new data evicts it.
        more = make_keys(ns_name + "/more", SLOTS)
        for key, row in zip(more, payloads(more, PAGE)):
            c.store(ns, [key], row)
        assert c.lookup(ns, leased_key).prefix_hits == 0


def test_delete_while_leased_over_grpc(small, ns_name):
    with small.client() as c, raw(small.socket) as r:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=PAGE)
        keys = make_keys(ns_name, 1)
        data = payloads(keys, PAGE)
        c.store(ns, keys, data)
        r.register(ns_name, PAGE)
        lease = r.acquire(ns.namespace_id, keys)[0]
        assert c.delete(ns, keys) == 1
        assert c.lookup(ns, keys).prefix_hits == 0
        # The reader's bytes stay valid until it releases, even while the pool fills up.
        fill = make_keys(ns_name + "/fill", 2 * SLOTS)
        for key, row in zip(fill, payloads(fill, PAGE)):
            c.store(ns, [key], row)
        assert r.read_extents(lease.extents) == data[0].tobytes()
        assert small.stats().tiers[0].used_bytes == SLOTS * PAGE
        assert r.release([lease.handle]) == 1
        # Its page went back to the pool: one free page now.
        assert small.stats().tiers[0].used_bytes == (SLOTS - 1) * PAGE
        assert c.store(ns, keys, data) == StoreResult(stored=1)


def test_store_into_a_fully_leased_pool_reports_dropped(small, ns_name):
    """When every page is leased nothing can be evicted: stores are dropped (SLOT_STATE_NO_SPACE,
    StoreResult.dropped: "no space, another writer, or the daemon unavailable"). Both store paths
    of the client must say so the same way, without raising into the inference engine."""
    region_dir = tempfile.mkdtemp(prefix="kvfull", dir="/dev/shm")
    region_path = os.path.join(region_dir, "region")
    with open(region_path, "wb") as fh:
        fh.truncate(2 * PAGE)
    try:
        with small.client() as c, raw(small.socket) as r:
            ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=PAGE)
            held = make_keys(ns_name + "/held", SLOTS)
            assert c.store(ns, held, payloads(held, PAGE)).stored == SLOTS
            r.register(ns_name, PAGE)
            leases = r.acquire(ns.namespace_id, held)
            assert len(leases) == SLOTS  # the whole pool is pinned

            new = make_keys(ns_name + "/new", 2)
            region = c.register_region(region_path)
            dropped = c.store_from_region(ns, region, new, [0, PAGE])
            assert dropped == StoreResult(dropped=2) and dropped.outcomes == (StoreOutcome.DROPPED,) * 2
            assert c.store(ns, new, payloads(new, PAGE)) == StoreResult(dropped=2)
            assert c.lookup(ns, held).prefix_hits == SLOTS  # nothing was evicted

            assert r.release([lease.handle for lease in leases[:2]]) == 2
            assert c.store(ns, new, payloads(new, PAGE)) == StoreResult(stored=2)
    finally:
        os.unlink(region_path)
        os.rmdir(region_dir)
