# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""In this process: the daemon's index and peer tier with many peers, and rendezvous hashing."""

from __future__ import annotations

import asyncio
import functools
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench.scale_calibrate.common import SMALL


def index_bytes_by_slot(slots: Sequence[int], n: int = 20_000) -> list[dict[str, float]]:
    """tracemalloc per entry of a PeerIndex whose chunks are all held by the peer in `slot`."""
    from kvstored.peer.index import PeerIndex

    rows = []
    for slot in slots:
        index = PeerIndex(n)
        for _ in range(slot + 1):
            index.add_peer()
        keys = [os.urandom(32) for _ in range(n)]
        used = traced_bytes(functools.partial(index.add, slot, 0, "n" * 32, keys))
        rows.append({"slot": slot, "bytes_per_entry": used / n})
    return rows


def traced_bytes(work: Callable[[], object]) -> int:
    """What `work` leaves allocated (tracemalloc)."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def index_bytes_readme_way(n: int) -> float:
    """The README's measurement (tests/unit/test_peer_index.py, 5 peers) at n entries."""
    from kvstored.peer.index import PeerIndex

    raw = [os.urandom(32) for _ in range(n)]
    index = PeerIndex(n)
    slots = [index.add_peer() for _ in range(5)]

    def add_all() -> None:
        for i, slot in enumerate(slots):
            index.add(slot, i % 2, "n" * 32, raw[i::5])

    return traced_bytes(add_all) / n


def index_updates_by_slot(slots: Sequence[int], n: int = 20_000, rounds: int = 3) -> list[dict[str, float]]:
    """Time of one single-key add and remove at `slot` (applying an event), the best of `rounds`."""
    from kvstored.peer.index import PeerIndex

    rows = []
    for slot in slots:
        adds, removes = [], []
        for _ in range(rounds):
            index = PeerIndex(2 * n)
            for _ in range(slot + 1):
                index.add_peer()
            keys = [[os.urandom(32)] for _ in range(n)]
            t0 = time.perf_counter()
            for key in keys:
                index.add(slot, 0, "n" * 32, key)
            t1 = time.perf_counter()
            for key in keys:
                index.remove(slot, 0, "n" * 32, key)
            t2 = time.perf_counter()
            adds.append((t1 - t0) / n * 1e6)
            removes.append((t2 - t1) / n * 1e6)
        rows.append({"slot": slot, "add_us": min(adds), "remove_us": min(removes)})
    return rows


def rendezvous_cost(node_counts: Sequence[int], groups: int = 2000) -> list[dict[str, float]]:
    """Choosing a chunk group's owner among N nodes: the highest xxh3 of its key seeded per node."""
    import xxhash

    rows = []
    for n in node_counts:
        seeds = [xxhash.xxh3_64_intdigest(f"10.0.{i // 250}.{i % 250 + 1}:7070".encode()) for i in range(n)]
        keys = [os.urandom(32) for _ in range(groups)]
        h = xxhash.xxh3_64_intdigest
        t0 = time.perf_counter()
        for key in keys:
            max((h(key, seed), i) for i, seed in enumerate(seeds))  # (the owner: the highest hash)
        per_group = (time.perf_counter() - t0) / groups
        rows.append({"nodes": n, "us_per_group": per_group * 1e6, "us_per_node": per_group / n * 1e6})
    return rows


async def _contains_cost(peers: int, keys_per_call: Sequence[int], reps: int) -> dict[str, float]:
    from kvstored.namespaces import NamespaceRegistry
    from kvstored.peer.membership import PeerState
    from kvstored.peer.transport import TransportKind, TransportPreference
    from kvstored.tiers.config import PeerTierConfig, TierContext
    from kvstored.tiers.peer import PeerTier

    registry = NamespaceRegistry(1 << 30)
    ns = registry.register("scale-calibrate/contains", "u8", SMALL, "", b"", 32)
    addresses = tuple(f"10.0.{i // 250}.{i % 250 + 1}:7070" for i in range(peers))
    config = PeerTierConfig(peers=addresses, transport=TransportPreference.TCP)
    tier = PeerTier(config, TierContext(namespaces=registry))
    for record in tier.membership.records():  # up, with a link: what a handshake leaves behind
        record.slot = tier.index.add_peer()
        record.state = PeerState.UP
        record.transport = TransportKind.TCP
        tier.fleet.links[record.address] = None  # type: ignore[assignment]  # only looked up, never used
    rng = np.random.default_rng(0)
    held = [os.urandom(32) for _ in range(max(keys_per_call))]
    for key, slot in zip(held, rng.integers(0, peers, len(held))):
        tier.index.add(int(slot), 0, ns.namespace_id, [key])
    out = {}
    for n in keys_per_call:
        chunks = [(ns.namespace_id, k) for k in held[:n]]
        await tier.contains(chunks)
        t0 = time.perf_counter()
        for _ in range(reps):
            await tier.contains(chunks)
        out[f"keys_{n}_us"] = (time.perf_counter() - t0) / reps * 1e6
    return out


def contains_by_peers(
    peer_counts: Sequence[int], keys: int = 1024, budget_s: float = 0.15, rounds: int = 2
) -> list[dict[str, float]]:
    rows = []
    for peers in peer_counts:
        best: dict[str, float] = {}
        for _ in range(rounds):
            probe = asyncio.run(_contains_cost(peers, (1, keys), 3))
            reps = max(20, int(budget_s / max(1e-6, probe[f"keys_{keys}_us"] * 1e-6)))
            cost = asyncio.run(_contains_cost(peers, (1, keys), reps))
            best = {k: min(v, best.get(k, v)) for k, v in cost.items()}
        per_key = max(0.0, (best[f"keys_{keys}_us"] - best["keys_1_us"]) / (keys - 1))
        rows.append({"peers": peers, **best, "per_call_us": best["keys_1_us"] - per_key, "per_key_us": per_key})
    return rows


def measure_in_process() -> dict[str, Any]:
    print("the daemon's index and peer tier in this process, 1 to 1000 peers", flush=True)
    slots = (0, 1, 2, 7, 99, 499, 999)
    by_slot = index_bytes_by_slot(slots)
    big = [r for r in by_slot if r["slot"] >= 7]
    per_slot, base = statistics.linear_regression([r["slot"] for r in big], [r["bytes_per_entry"] for r in big])
    updates = index_updates_by_slot((0, 99, 499, 999))
    add_slope, add0 = statistics.linear_regression([r["slot"] for r in updates], [r["add_us"] for r in updates])
    contains = contains_by_peers((1, 10, 100, 1000))
    peers = [r["peers"] for r in contains]
    call_slope, call0 = statistics.linear_regression(peers, [r["per_call_us"] for r in contains])
    key_slope, key0 = statistics.linear_regression(peers, [r["per_key_us"] for r in contains])
    readme_way = index_bytes_readme_way(200_000)
    rendezvous = rendezvous_cost((10, 100, 1000))
    return {
        "index_tracemalloc": {
            "basis": "tracemalloc of PeerIndex, 32-byte keys: the README's way (5 peers, 200,000 entries), and "
            "20,000 entries all held by the peer in one slot",
            "bytes_per_entry_5_peers": readme_way,
            "by_slot": by_slot,
            "fit_slot_ge_7": {"bytes_per_entry_at_slot_0": base, "bytes_per_slot": per_slot},
        },
        "index_updates": {
            "basis": "PeerIndex.add then .remove of one key (one event's index work) at a slot, in this process",
            "by_slot": updates,
            "fit": {"add_us_at_slot_0": add0, "add_us_per_slot": add_slope},
        },
        "contains": {
            "basis": "PeerTier.contains (the peer tier's part of a Lookup), N peers up, keys held by random peers; "
            "per call and per key from 1- and 1024-key calls, best of 2",
            "by_peers": contains,
            "fit": {
                "per_call_us": call0,
                "per_call_us_per_peer": call_slope,
                "per_key_us": key0,
                "per_key_us_per_peer": key_slope,
            },
        },
        "rendezvous": {
            "basis": "a chunk group's owner among N nodes by rendezvous hashing (max of xxh3_64 seeded per node)",
            "by_nodes": rendezvous,
            "us_per_node": statistics.median(r["us_per_node"] for r in rendezvous),
        },
    }
