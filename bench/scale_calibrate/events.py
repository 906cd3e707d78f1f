# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The event phases: index memory, event bytes and CPU per event and per key."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

import grpc
import numpy as np

from bench.scale_calibrate.common import (
    BIG_BATCH,
    FS_BYTES,
    LIFE_CHUNK,
    README_BYTES_PER_ENTRY,
    SINGLE_EVENTS,
    SMALL,
    WAIT_S,
    cpu_rates,
    new_keys,
    ns_fields,
    rss_anon,
    storing,
)
from bench.scale_calibrate.daemons import Pair, Phase
from bench.scale_calibrate.subscribers import Subscribers
from kvstored.peer.control import KEEPALIVE_MS
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

QUIET_WINDOWS = 4
QUIET_WINDOW_S = KEEPALIVE_MS / 1000  # one keepalive ping per stream per window


def quiet_rates(pid: int) -> list[float]:
    """CPU rates of `pid` over QUIET_WINDOWS back-to-back windows of QUIET_WINDOW_S."""
    return [cpu_rates([pid], QUIET_WINDOW_S)[0] for _ in range(QUIET_WINDOWS)]


def fit_two(p1: Phase, p2: Phase, value: Callable[[Phase], float]) -> tuple[float, float]:
    """(per event, per key) from two phases: value = events x a + keys x b."""
    e1, k1, e2, k2 = p1.events, p1.keys, p2.events, p2.keys
    det = e1 * k2 - e2 * k1
    if not det:
        raise ValueError("phases with the same keys per event cannot separate the two")
    v1, v2 = value(p1), value(p2)
    a = (v1 * k2 - v2 * k1) / det
    b = (e1 * v2 - e2 * v1) / det
    return a, b


@dataclass
class EventRun:
    """The event phases' outcomes, and the memory readings taken between them."""

    single: Phase
    batched: Phase
    batched2: Phase
    single_subs: Phase
    batched_subs: Phase
    removed: Phase
    steady: Phase
    rss: list[tuple[int, int]]  # (B's index entries, B's RssAnon)
    streams: dict[str, Any]
    ram_bytes: int  # A's RAM tier


def run_event_phases(pair: Pair, entries: int, subscribers: int, batch: int) -> EventRun:
    a, b = pair.a, pair.b
    small = ns_fields("4k", SMALL)
    zeros = np.zeros((BIG_BATCH, SMALL), np.uint8)
    with a.client() as kv_a:
        ns = kv_a.register_namespace(**small)
        singles = new_keys(SINGLE_EVENTS, "single")
        print("events and the index's memory (B follows A)", flush=True)
        pair.measure_idle()
        single = pair.phase("single-key stores", storing(kv_a, ns, singles, 1, zeros))
        half = entries // 2
        bulk = new_keys(2 * half, "bulk")
        rss = [(pair.b_view_of_a().indexed_chunks, rss_anon(b.pid))]
        batched = pair.phase(f"{BIG_BATCH}-key stores (1)", storing(kv_a, ns, bulk[:half], BIG_BATCH, zeros))
        rss.append((pair.b_view_of_a().indexed_chunks, rss_anon(b.pid)))
        batched2 = pair.phase(f"{BIG_BATCH}-key stores (2)", storing(kv_a, ns, bulk[half:], BIG_BATCH, zeros))
        rss.append((pair.b_view_of_a().indexed_chunks, rss_anon(b.pid)))

        # More followers of A: what publishing costs per subscriber, and a stream's memory.
        nudges = iter(new_keys(200, "nudge"))
        subs, streams = open_streams(pair, subscribers, lambda: kv_a.store(ns, [next(nudges)], zeros[:1]))
        received0 = subs.received
        singles2 = new_keys(SINGLE_EVENTS, "single2")
        single_subs = pair.phase(
            f"single-key stores, {subscribers} more subscribers", storing(kv_a, ns, singles2, 1, zeros)
        )
        subs.wait_received(received0 + subscribers * single_subs.events)
        received1 = subs.received
        bulk2 = new_keys(half // 2 // BIG_BATCH * BIG_BATCH or BIG_BATCH, "bulk2")
        batched_subs = pair.phase(
            f"{BIG_BATCH}-key stores, {subscribers} more subscribers", storing(kv_a, ns, bulk2, BIG_BATCH, zeros)
        )
        subs.wait_received(received1 + subscribers * batched_subs.events)
        subs.stop()

        def clear_all() -> int:
            with grpc.insecure_channel(f"unix:{a.socket}") as channel:
                pb_grpc.KVStoreStub(channel).ClearNamespace(
                    pb.ClearNamespaceRequest(namespace_id=ns.namespace_id), timeout=WAIT_S
                )
            return 0

        removed = pair.phase("namespace cleared (one event of every key)", clear_all)

        # A chunk's whole life at steady state: RAM and fs full, every store evicts.
        life_ns = fill_lifecycle(pair, kv_a, batch, "lifecycle: filling RAM and fs")
        data = np.zeros((batch, LIFE_CHUNK), np.uint8)
        steady_keys = new_keys(max(batch, min(pair_ram_bytes(pair) // LIFE_CHUNK, 2000)), "life")
        steady = pair.phase("lifecycle: steady state", storing(kv_a, life_ns, steady_keys, batch, data))
    return EventRun(
        single, batched, batched2, single_subs, batched_subs, removed, steady, rss, streams, pair_ram_bytes(pair)
    )


def events_report(run: EventRun, subscribers: int, batch: int) -> dict[str, Any]:
    """Per event, per key and per chunk, from the phases."""
    single, batched2, steady, removed = run.single, run.batched2, run.steady, run.removed
    single_subs, batched_subs = run.single_subs, run.batched_subs
    out: dict[str, Any] = {}
    per_event, per_key = fit_two(single, batched2, lambda p: p.payload_bytes)
    cpu_event, cpu_key = fit_two(single, batched2, lambda p: p.b_cpu_s)
    pub_event = max(0.0, (single_subs.a_cpu_s / single_subs.events - single.a_cpu_s / single.events) / subscribers)
    pub_key_measured = (batched_subs.a_cpu_s / batched_subs.keys - batched2.a_cpu_s / batched2.keys) / subscribers
    (n0, r0), (n1, r1), (n2, r2) = run.rss
    out["phases"] = {
        p.name: {**asdict(p), "per_event": p.per("event"), "per_key": p.per("key"), "per_chunk": p.per("chunk")}
        for p in (single, run.batched, batched2, single_subs, batched_subs, removed, steady)
    }
    out["fit"] = {
        "basis": "two-point fit (single-key stores; 1,000-key stores) of what B's socket received and B's CPU",
        "payload_bytes_per_event": per_event,
        "payload_bytes_per_key": per_key,
        "segments_per_single_key_event": single.segments / max(1, single.events),
        "follower_cpu_s_per_event": cpu_event,
        "follower_cpu_s_per_key": cpu_key,
        "follower_cpu_s_per_removed_key": removed.b_cpu_s / max(1, removed.keys),
        "removed_basis": "one REMOVED event of every key A held (ClearNamespace): B's CPU per key removed",
        "publisher_cpu_s_per_event_per_subscriber": pub_event,
        "publisher_cpu_s_per_key_per_subscriber": serialize_cost_per_key(),
        "publisher_cpu_s_per_key_per_subscriber_daemon": pub_key_measured,
        "publisher_basis": f"per event: A's CPU per single-key event with {subscribers} more WatchEvents streams minus "
        "without, divided by the streams; per key: serializing a KvEvent's keys (this process), as "
        "the daemon's difference for 1,000-key events (_daemon) drowns in its store work",
    }
    chunks = max(1, steady.chunks)
    kinds = {k: v / chunks for k, v in steady.by_kind.items()}
    out["lifecycle"] = {
        "basis": f"{steady.chunks} chunks of {LIFE_CHUNK >> 10} KiB stored on A in batches of {batch} with its RAM "
        f"({run.ram_bytes >> 20} MiB) and fs tier ({FS_BYTES >> 20} MiB) full: each store evicts",
        "store_batch": batch,
        "chunks": steady.chunks,
        "events_per_chunk": steady.events / chunks,
        "keys_per_chunk": steady.keys / chunks,
        "payload_bytes_per_chunk": steady.payload_bytes / chunks,
        "segments_per_chunk": steady.segments / chunks,
        "follower_cpu_s_per_chunk": steady.b_cpu_s / chunks,
        "per_chunk_by_kind": kinds,
    }
    out["index_memory"] = {
        "basis": "B's RssAnon growth while its index of A grew (4 KiB chunks stored on A in batches of 1,000)",
        "points": [{"entries": n, "rss_anon_bytes": r} for n, r in run.rss],
        "rss_bytes_per_entry": (r2 - r0) / max(1, n2 - n0),
        "rss_bytes_per_entry_second_half": (r2 - r1) / max(1, n2 - n1),
        "readme_bytes_per_entry": README_BYTES_PER_ENTRY,
    }
    out["streams"] = {
        "basis": f"{subscribers} WatchEvents streams on A's TCP listener, each on its own channel (ControlChannel), "
        "in a child process: RssAnon growth of A (server) and of the child (client) per stream",
        "subscribers": subscribers,
        **run.streams,
        "idle_basis": f"A's CPU rate with the streams open and quiet minus without, per stream: medians of "
        f"{QUIET_WINDOWS} windows of {QUIET_WINDOW_S:g} s each way (a window is one keepalive period: each sees "
        "every stream's ping once), taken just before and just after the streams open",
    }
    return out


def serialize_cost_per_key(keys: int = 1000, reps: int = 300) -> float:
    """CPU seconds per key of building and serializing a KvEvent for one subscriber (the server
    does it per stream), from 1,000-key events minus 1-key ones, best of 3."""
    many = tuple(os.urandom(32) for _ in range(keys))

    def cost(k: tuple[bytes, ...]) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for seq in range(reps):
                pb.KvEvent(
                    seq=seq, ts=1.0, type=1, cause=1, tier="ram", tier_kind=1, namespace_id="n" * 32, keys=k
                ).SerializeToString()
            best = min(best, (time.perf_counter() - t0) / reps)
        return best

    return max(0.0, (cost(many) - cost(many[:1])) / (keys - 1))


def pair_ram_bytes(pair: Pair) -> int:
    return int(pair.a.stats().tiers[0].capacity_bytes)


def fill_lifecycle(pair: Pair, kv: Any, batch: int, name: str) -> Any:
    """A's RAM and fs full of the lifecycle namespace's chunks (so that every later store writes
    down and evicts); returns that namespace."""
    ns = kv.register_namespace(**ns_fields("life", LIFE_CHUNK))
    fill = new_keys(pair_ram_bytes(pair) // LIFE_CHUNK + FS_BYTES // LIFE_CHUNK + 2 * batch, "fill")
    pair.phase(name, storing(kv, ns, fill, batch, np.zeros((batch, LIFE_CHUNK), np.uint8)))
    return ns


def open_streams(pair: Pair, streams: int, nudge: Callable[[], object]) -> tuple[Subscribers, dict[str, Any]]:
    """`streams` more WatchEvents streams on A (a child process; `nudge` publishes an event), and
    what they cost A and the child: heap per stream, and the quiet streams' CPU (medians of whole
    keepalive periods just before and just after they open)."""
    a = pair.a
    rss0, without = rss_anon(a.pid), quiet_rates(a.pid)
    subs = Subscribers(a.address, streams)
    try:
        subs.wait_ready(nudge)
        rss1, with_streams = rss_anon(a.pid), quiet_rates(a.pid)
    except BaseException:
        subs.stop()
        raise
    return subs, {
        "server_bytes_per_stream": (rss1 - rss0) / streams,
        "client_bytes_per_stream": (subs.rss_ready - subs.rss_before) / streams,
        "server_idle_cpu_s_per_s_per_stream": max(0.0, median(with_streams) - median(without)) / streams,
        "quiet_cpu_s_per_s_without": without,
        "quiet_cpu_s_per_s_with": with_streams,
    }


def measure_quiet_streams(pair: Pair, streams: int) -> dict[str, Any]:
    """The quiet streams' CPU alone (the calibration's method), for checking its spread."""
    with pair.a.client() as kv_a:
        ns = kv_a.register_namespace(**ns_fields("quiet", SMALL))
        zeros = np.zeros((1, SMALL), np.uint8)
        nudges = iter(new_keys(200, "quiet"))
        subs, figures = open_streams(pair, streams, lambda: kv_a.store(ns, [next(nudges)], zeros))
        subs.stop()
    return figures
