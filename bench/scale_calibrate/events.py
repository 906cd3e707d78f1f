# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The event phases (index memory, event bytes, CPU per event and per key) and the coalescing phase
(B following A each event as it happens, then coalesced, at the model's turn rate)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict
from statistics import median
from typing import Any

import grpc
import numpy as np

from bench.lib.daemons import rss_anon
from bench.scale_calibrate import common
from bench.scale_calibrate.common import BIG_BATCH, FS_BYTES, LIFE_CHUNK, SINGLE_EVENTS, SMALL, new_keys, storing
from bench.scale_calibrate.daemons import Pair, Phase
from bench.scale_calibrate.subscribers import Subscribers
from kvstored.peer.control import KEEPALIVE_MS
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

QUIET_WINDOWS = 4
QUIET_WINDOW_S = KEEPALIVE_MS / 1000  # one keepalive ping per stream per window
EVENTS_INTERVAL_S = 0.1  # A's events_interval (the daemon's default)


def quiet_rates(pid: int) -> list[float]:
    """CPU rates of `pid` over QUIET_WINDOWS back-to-back windows of QUIET_WINDOW_S."""
    return [common.cpu_rates([pid], QUIET_WINDOW_S)[0] for _ in range(QUIET_WINDOWS)]


def fit_two(p1: Phase, p2: Phase, value: Callable[[Phase], float]) -> tuple[float, float]:
    """(per event, per key) from two phases: value = events x a + keys x b."""
    e1, k1, e2, k2 = p1.events, p1.keys, p2.events, p2.keys
    det = e1 * k2 - e2 * k1
    if not det:
        raise ValueError("phases with the same keys per event cannot separate the two")
    v1, v2 = value(p1), value(p2)
    return (v1 * k2 - v2 * k1) / det, (e1 * v2 - e2 * v1) / det


def measure_events(pair: Pair, entries: int, subscribers: int, batch: int) -> dict[str, Any]:
    """The event phases, then per event, per key and per chunk from them."""
    a, b = pair.a, pair.b
    zeros = np.zeros((BIG_BATCH, SMALL), np.uint8)
    with a.client() as kv_a:
        ns = kv_a.register_namespace(**common.ns_fields("4k", SMALL))
        print("events and the index's memory (B follows A)", flush=True)
        pair.measure_idle()
        single = pair.phase("single-key stores", storing(kv_a, ns, new_keys(SINGLE_EVENTS, "single"), 1, zeros))
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
        received = subs.received
        singles2 = storing(kv_a, ns, new_keys(SINGLE_EVENTS, "single2"), 1, zeros)
        single_subs = pair.phase(f"single-key stores, {subscribers} more subscribers", singles2)
        subs.wait_received(received + subscribers * single_subs.events)
        received = subs.received
        bulk2 = storing(kv_a, ns, new_keys(half // 2 // BIG_BATCH * BIG_BATCH or BIG_BATCH, "bulk2"), BIG_BATCH, zeros)
        batched_subs = pair.phase(f"{BIG_BATCH}-key stores, {subscribers} more subscribers", bulk2)
        subs.wait_received(received + subscribers * batched_subs.events)
        subs.stop()

        def clear_all() -> int:
            with grpc.insecure_channel(f"unix:{a.socket}") as channel:
                request = pb.ClearNamespaceRequest(namespace_id=ns.namespace_id)
                pb_grpc.KVStoreStub(channel).ClearNamespace(request, timeout=common.WAIT_S)
            return 0

        removed = pair.phase("namespace cleared (one event of every key)", clear_all)

        # A chunk's whole life at steady state: RAM and fs full, every store evicts.
        life_ns = fill_lifecycle(pair, kv_a, batch, "lifecycle: filling RAM and fs")
        data = np.zeros((batch, LIFE_CHUNK), np.uint8)
        steady_keys = new_keys(max(batch, min(ram_bytes(pair) // LIFE_CHUNK, 2000)), "life")
        steady = pair.phase("lifecycle: steady state", storing(kv_a, life_ns, steady_keys, batch, data))
    per_event, per_key = fit_two(single, batched2, lambda p: p.payload_bytes)
    cpu_event, cpu_key = fit_two(single, batched2, lambda p: p.b_cpu_s)
    pub_event = max(0.0, (single_subs.a_cpu_s / single_subs.events - single.a_cpu_s / single.events) / subscribers)
    pub_key_measured = (batched_subs.a_cpu_s / batched_subs.keys - batched2.a_cpu_s / batched2.keys) / subscribers
    (n0, r0), (n1, r1), (n2, r2) = rss
    chunks = max(1, steady.chunks)
    out: dict[str, Any] = {}
    out["phases"] = {
        p.name: {**asdict(p), "per_event": p.per("event"), "per_key": p.per("key"), "per_chunk": p.per("chunk")}
        for p in (single, batched, batched2, single_subs, batched_subs, removed, steady)
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
        "publisher_basis": f"per event: A's CPU with {subscribers} more streams minus without, per stream; per key: "
        "serializing a KvEvent's keys here (the daemon's difference, _daemon, drowns in its store work)",
    }
    out["lifecycle"] = {
        "basis": f"{steady.chunks} chunks of {LIFE_CHUNK >> 10} KiB stored on A in batches of {batch}, its RAM "
        f"({ram_bytes(pair) >> 20} MiB) and fs ({FS_BYTES >> 20} MiB) full: each store evicts",
        "store_batch": batch,
        "chunks": steady.chunks,
        "events_per_chunk": steady.events / chunks,
        "keys_per_chunk": steady.keys / chunks,
        "payload_bytes_per_chunk": steady.payload_bytes / chunks,
        "segments_per_chunk": steady.segments / chunks,
        "follower_cpu_s_per_chunk": steady.b_cpu_s / chunks,
        "per_chunk_by_kind": {k: v / chunks for k, v in steady.by_kind.items()},
    }
    out["index_memory"] = {
        "basis": "B's RssAnon growth while its index of A grew (4 KiB chunks stored on A in batches of 1,000)",
        "points": [{"entries": n, "rss_anon_bytes": r} for n, r in rss],
        "rss_bytes_per_entry": (r2 - r0) / max(1, n2 - n0),
        "rss_bytes_per_entry_second_half": (r2 - r1) / max(1, n2 - n1),
        "readme_bytes_per_entry": common.README_BYTES_PER_ENTRY,
    }
    out["streams"] = {
        "basis": f"{subscribers} WatchEvents streams on A's TCP listener, a channel each, in a child process: "
        "RssAnon growth of A (server) and of the child (client) per stream",
        "subscribers": subscribers,
        **streams,
        "idle_basis": f"A's CPU with the streams open and quiet minus without, per stream: medians of {QUIET_WINDOWS} "
        f"windows of {QUIET_WINDOW_S:g} s (a keepalive period) each way, just before and after they open",
    }
    return out


def serialize_cost_per_key(keys: int = 1000, reps: int = 300) -> float:
    """CPU seconds per key of serializing a KvEvent for one subscriber: 1,000-key events minus 1-key ones, best of 3."""
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


def ram_bytes(pair: Pair) -> int:
    return int(pair.a.stats().tiers[0].capacity_bytes)


def fill_lifecycle(pair: Pair, kv: Any, batch: int, name: str) -> Any:
    """A's RAM and fs full of the lifecycle namespace's chunks (every later store writes down and evicts)."""
    ns = kv.register_namespace(**common.ns_fields("life", LIFE_CHUNK))
    fill = new_keys(ram_bytes(pair) // LIFE_CHUNK + FS_BYTES // LIFE_CHUNK + 2 * batch, "fill")
    pair.phase(name, storing(kv, ns, fill, batch, np.zeros((batch, LIFE_CHUNK), np.uint8)))
    return ns


def open_streams(pair: Pair, streams: int, nudge: Callable[[], object]) -> tuple[Subscribers, dict[str, Any]]:
    """`streams` more WatchEvents streams on A (a child process; `nudge` publishes an event), their heap
    per stream and their quiet CPU (medians of keepalive periods just before and just after they open)."""
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
        ns = kv_a.register_namespace(**common.ns_fields("quiet", SMALL))
        nudges = iter(new_keys(200, "quiet"))
        subs, figures = open_streams(
            pair, streams, lambda: kv_a.store(ns, [next(nudges)], np.zeros((1, SMALL), np.uint8))
        )
        subs.stop()
    return figures


# -- the coalescing phase ------------------------------------------------------------------------


def measure_coalescing(
    pair: Pair, batch: int, turns: int, turn_rate: float, subscribers: int, coalesced_subscribers: int
) -> dict[str, Any]:
    """A turn's store of `batch` chunks, `turn_rate` a second, A's RAM and fs full; B following each event,
    then coalesced; and A's CPU with more followers of each mode (`subscribers`, `coalesced_subscribers`)."""
    data = np.zeros((batch, LIFE_CHUNK), np.uint8)
    modes: list[dict[str, Any]] = []
    print(f"coalescing: {turns} turns of {batch} chunks at {turn_rate:g}/s, RAM and fs full", flush=True)
    with pair.a.client() as kv:
        ns = kv.register_namespace(**common.ns_fields("life", LIFE_CHUNK))  # the lifecycle phase's: full

        def paced(tag: str) -> Callable[[], int]:  # a mode's turns
            return storing(kv, ns, new_keys(turns * batch, tag), batch, data, turn_rate)

        for coalesce, crowd_size in ((False, subscribers), (True, coalesced_subscribers)):
            name, tag = "coalesced" if coalesce else "each event", f"c{coalesce:d}"
            pair.follow(coalesce)
            pair.measure_idle()
            alone = pair.phase(f"turns, B following {name}", paced(f"{tag}-1"))
            subs = Subscribers(pair.a.address, crowd_size, coalesce)
            try:
                nudges = iter(new_keys(200, f"{tag}-n"))
                subs.wait_ready(lambda: kv.store(ns, [next(nudges)], data[:1]))  # noqa: B023 (called here)
                crowd = pair.phase(f"turns, {crowd_size} more followers {name}", paced(f"{tag}-2"))
            finally:
                subs.stop()
            mode = {
                "coalesced": coalesce,
                "turns": turns,
                "seconds": alone.seconds,  # the paced stores, B catching up included
                # what A published (its bus: the uncoalesced watcher's count)
                "bus_events": sum(v for k, v in alone.by_kind.items() if not k.endswith(" keys")),
                "bus_keys": alone.keys,
                "messages": alone.events,  # what B applied
                "follower_cpu_s": alone.b_cpu_s,
                "publisher_cpu_s_per_subscriber": max(0.0, crowd.a_cpu_s - alone.a_cpu_s) / crowd_size,  # A's
                "subscribers": crowd_size,  # the extra streams
                "follower_s_per_turn": alone.b_cpu_s / turns,
            }
            modes.append(mode)
    each, coalesced = modes
    return {
        "basis": f"{turns} stores of {batch} chunks of {LIFE_CHUNK >> 10} KiB at {turn_rate:g}/s on A (RAM and fs "
        f"full), B following each event, then coalesced (events_interval {EVENTS_INTERVAL_S:g} s); A's CPU with "
        f"{subscribers} more followers each event, {coalesced_subscribers} coalesced, minus without, per follower",
        "turn_rate": turn_rate,
        "modes": modes,
        "follower_ratio": ratio(each["follower_s_per_turn"], coalesced["follower_s_per_turn"]),
        "publisher_ratio": ratio(each["publisher_cpu_s_per_subscriber"], coalesced["publisher_cpu_s_per_subscriber"]),
        "messages_ratio": ratio(each["messages"], coalesced["messages"]),
        "coalesced_messages_per_interval": coalesced["messages"] / max(1.0, coalesced["seconds"] / EVENTS_INTERVAL_S),
    }


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def coalescing_lines(doc: dict[str, Any]) -> list[tuple[str, str]]:
    each, coalesced = doc["modes"]
    rate = doc["turn_rate"]

    def times(r: float | None) -> str:
        return f"{r:.0f}x" if r is not None else "(coalesced below the noise)"

    def publishing(mode: dict[str, Any]) -> float:
        return mode["publisher_cpu_s_per_subscriber"] / mode["turns"] * rate

    lines = [
        (
            "following A at the model's turn rate",
            f"each event {each['follower_s_per_turn'] * rate:.1%} of a core ({each['messages']} messages), "
            f"coalesced {coalesced['follower_s_per_turn'] * rate:.2%} ({coalesced['messages']}): "
            f"{times(doc['follower_ratio'])} less",
        ),
        (
            "publishing to one more follower",
            f"each event {publishing(each):.1%} of a core, coalesced {publishing(coalesced):.2%}: "
            f"{times(doc['publisher_ratio'])} less",
        ),
    ]
    if floor := doc.get("grpc_floor"):
        per_message = coalesced["follower_cpu_s"] / max(1, coalesced["messages"])
        lines.append(
            (
                "gRPC's floor per message (no daemon)",
                f"receiving {floor['receiver_s_per_message'] * 1e6:.0f} us, sending "
                f"{floor['sender_s_per_message'] * 1e6:.0f} us per {floor['payload_bytes']:,} B message after a "
                f"quiet interval: {floor['receiver_s_per_message'] * rate:.2%} of a core at {rate:g}/s; the "
                f"coalesced follower's {per_message * 1e6:.0f} us per message",
            )
        )
    return lines
