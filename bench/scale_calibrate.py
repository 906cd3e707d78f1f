"""Per-operation costs of the peer tier, measured on real daemons: the calibration bench/scale_out.py
models 1 to 1000 nodes with (issue #11 part 9; not a test).

Method, baselines, targets and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.lib.daemons import REPO, process_cpu_seconds
from bench.lib.report import machine_info, write_json
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

DEFAULT_OUT = REPO / "docs" / "scale-out-calibration.json"
README_BYTES_PER_ENTRY = 171  # README "A cluster of nodes": tracemalloc over 1,000,000 entries, 5 peers
SMALL = 4096  # bytes of the chunks whose count matters, not their size
LIFE_CHUNK = 256 << 10  # chunks of the lifecycle phase: RAM and fs fill with few of them
FS_BYTES = 16 << 20  # each node's fs tier: small, so the lifecycle phase reaches fs evictions
SINGLE_EVENTS = 1500  # stores of one key (single-key events)
BIG_BATCH = 1000  # keys per store in the batched phases
WAIT_S = 60.0  # a bound on every wait for the daemons' state, never a measurement


# -- the machine's own counters -----------------------------------------------------------------


def rss_anon(pid: int) -> int:
    """Anonymous resident memory of `pid` (bytes): the heap, not the shared-memory pool."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon in /proc/{pid}/status")


@dataclass(frozen=True)
class TcpCount:
    bytes_received: int = 0
    segs_in: int = 0


def tcp_received(pid: int, dport: int) -> TcpCount:
    """What the TCP sockets of `pid` connected to port `dport` have received (tcp_info via ss)."""
    out = subprocess.run(["ss", "-tinpH", "state", "established", f"( dport = :{dport} )"], capture_output=True,
                         text=True, timeout=10).stdout
    total, segs, mine = 0, 0, False
    for line in out.splitlines():
        if "users:" in line:
            mine = f"pid={pid}," in line
            continue
        if mine:
            got = re.search(r"\bbytes_received:(\d+)", line)
            seg = re.search(r"\bsegs_in:(\d+)", line)
            total += int(got[1]) if got else 0
            segs += int(seg[1]) if seg else 0
            mine = False
    return TcpCount(total, segs)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- the daemons --------------------------------------------------------------------------------


class EventWatcher:
    """A WatchEvents stream on A's unix socket, counting events and keys by (type, tier), and
    their protobuf size: what B receives, told apart by kind (a thread: the stream blocks)."""

    def __init__(self, socket: Path) -> None:
        # A cleared namespace is one event of every key: allow what the peers allow.
        self._channel = grpc.insecure_channel(f"unix:{socket}", options=[("grpc.max_receive_message_length", 64 << 20)])
        self.failure: grpc.RpcError | None = None
        self._stream = pb_grpc.KVStoreStub(self._channel).WatchEvents(pb.WatchEventsRequest(from_seq=0))
        self.events = 0
        self.keys = 0
        self.payload_bytes = 0
        self.last_at = time.monotonic()
        self.by_kind: Counter[str] = Counter()  # "stored ram" -> events; "stored ram keys" -> keys
        self._thread = threading.Thread(target=self._read, name="scale-calibrate-watch", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self._stream:
                kind = f"{pb.EventType.Name(event.type).removeprefix('EVENT_TYPE_').lower()} {event.tier}"
                self.by_kind[kind] += 1
                self.by_kind[kind + " keys"] += len(event.keys)
                self.keys += len(event.keys)
                self.payload_bytes += event.ByteSize()
                self.events += 1
                self.last_at = time.monotonic()
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.CANCELLED:  # (cancelled: closed by us)
                self.failure = exc

    def wait_quiet(self, quiet_s: float = 0.4) -> None:
        """Until no event came for quiet_s (write-downs run after the stores return)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() - self.last_at < quiet_s or self.failure is not None:
            if self.failure is not None:
                raise RuntimeError(f"the event watcher on A failed: {self.failure}")
            if time.monotonic() > deadline:
                raise TimeoutError("A never stopped publishing events")
            time.sleep(0.05)

    def close(self) -> None:
        self._stream.cancel()
        self._channel.close()
        self._thread.join(5)


@dataclass
class Snapshot:
    at: float
    b_cpu: float
    a_cpu: float
    b_events: int
    b_indexed: int
    tcp: TcpCount
    w_events: int
    w_keys: int
    w_bytes: int
    by_kind: Counter[str]


@dataclass
class Phase:
    """What one phase cost B (and A), from two snapshots."""

    name: str
    seconds: float
    events: int  # applied by B
    keys: int  # in those events (from the watcher on A)
    payload_bytes: int  # received on B's TCP connection to A
    segments: int
    protobuf_bytes: int  # the events' serialized size (the watcher)
    b_cpu_s: float  # B's CPU, idle rate and status polls subtracted
    a_cpu_s: float  # A's CPU, idle rate subtracted
    by_kind: dict[str, int] = field(default_factory=dict)
    chunks: int = 0  # chunks stored during the phase (the lifecycle phase)
    load_average: float = 0.0  # 1-minute, at the phase's end

    def per(self, what: str) -> dict[str, float]:
        n = {"event": self.events, "key": self.keys, "chunk": self.chunks}[what]
        if not n:
            return {}
        return {"bytes": self.payload_bytes / n, "segments": self.segments / n, "b_cpu_us": self.b_cpu_s / n * 1e6,
                "events": self.events / n, "keys": self.keys / n}


class Pair:
    """Daemons A and B (tests/support/cluster.py), the watcher on A, and B's costs per phase."""

    def __init__(self, a_ram: str) -> None:
        from tests.support.cluster import Cluster

        # Both list both (as a cluster's nodes do); A keeps enough events that B never resyncs.
        self.cluster = Cluster(2, "tcp", cpu_bytes=a_ram, fs_bytes=f"{FS_BYTES >> 20}MiB",
                               extra_args=["--page-bytes", "4096", "--events-buffer", "2000000"])
        self.a, self.b = self.cluster[0], self.cluster[1]
        self.a_port = int(self.a.address.rpartition(":")[2])
        self.watcher: EventWatcher | None = None
        self.b_idle_cpu_per_s = 0.0
        self.a_idle_cpu_per_s = 0.0
        self.b_cpu_per_poll = 0.0
        self.polls = 0

    def start(self) -> None:
        self.cluster.start()
        for i in range(2):
            self.cluster.wait_up(i)
        self.watcher = EventWatcher(self.a.socket)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self.cluster.close()

    def b_view_of_a(self) -> pb.PeerInfo:
        self.polls += 1
        return self.b.peer(self.a)

    def measure_idle(self, seconds: float = 1.0, polls: int = 20) -> None:
        """B's and A's CPU rate doing nothing, and what one PeerStatus poll costs B."""
        a0, b0, t0 = process_cpu_seconds(self.a.pid), process_cpu_seconds(self.b.pid), time.monotonic()
        time.sleep(seconds)
        a1, b1, t1 = process_cpu_seconds(self.a.pid), process_cpu_seconds(self.b.pid), time.monotonic()
        self.a_idle_cpu_per_s = max(0.0, (a1 - a0) / (t1 - t0))
        self.b_idle_cpu_per_s = max(0.0, (b1 - b0) / (t1 - t0))
        b0, t0 = process_cpu_seconds(self.b.pid), time.monotonic()
        for _ in range(polls):
            self.b.peer(self.a)
        b1, t1 = process_cpu_seconds(self.b.pid), time.monotonic()
        self.b_cpu_per_poll = max(0.0, (b1 - b0 - self.b_idle_cpu_per_s * (t1 - t0)) / polls)

    def snapshot(self) -> Snapshot:
        assert self.watcher is not None
        info = self.b_view_of_a()
        return Snapshot(time.monotonic(), process_cpu_seconds(self.b.pid), process_cpu_seconds(self.a.pid),
                        info.events, info.indexed_chunks, tcp_received(self.b.pid, self.a_port), self.watcher.events,
                        self.watcher.keys, self.watcher.payload_bytes, Counter(self.watcher.by_kind))

    def caught_up(self, since: Snapshot) -> None:
        """Until A has stopped publishing and B has applied every event A published since `since`."""
        assert self.watcher is not None
        self.watcher.wait_quiet()
        deadline = time.monotonic() + WAIT_S
        while self.b_view_of_a().events - since.b_events < self.watcher.events - since.w_events:
            if time.monotonic() > deadline:
                raise TimeoutError("B never applied A's events:\n" + self.cluster.describe())
            time.sleep(0.1)

    def phase(self, name: str, work: Callable[[], int | None]) -> Phase:
        """Run `work` (returns the chunks it stored, if that matters) and what it cost B."""
        polls0 = self.polls
        s0 = self.snapshot()
        chunks = work() or 0
        self.caught_up(s0)
        s1 = self.snapshot()
        dt = s1.at - s0.at
        polls = self.polls - polls0 - 1  # the first snapshot's poll came before s0's CPU reading
        kinds = {k: v for k, v in (s1.by_kind - s0.by_kind).items() if v}
        phase = Phase(
            name, dt, s1.b_events - s0.b_events, s1.w_keys - s0.w_keys,
            s1.tcp.bytes_received - s0.tcp.bytes_received, s1.tcp.segs_in - s0.tcp.segs_in, s1.w_bytes - s0.w_bytes,
            max(0.0, s1.b_cpu - s0.b_cpu - self.b_idle_cpu_per_s * dt - self.b_cpu_per_poll * polls),
            max(0.0, s1.a_cpu - s0.a_cpu - self.a_idle_cpu_per_s * dt), kinds, chunks, round(os.getloadavg()[0], 2),
        )
        print(f"  {name}: {phase.events} events, {phase.keys} keys, {phase.payload_bytes:,} B received, "
              f"B CPU {phase.b_cpu_s * 1e3:.1f} ms, A CPU {phase.a_cpu_s * 1e3:.1f} ms in {dt:.2f} s "
              f"(load {phase.load_average:.2f})", flush=True)
        return phase


def ns_fields(model: str, chunk_bytes: int) -> dict[str, Any]:
    return {"model": f"scale-calibrate/{model}", "dtype": "u8", "chunk_bytes": chunk_bytes}


def new_keys(n: int, tag: str) -> list[bytes]:
    return [secrets.token_bytes(32) for _ in range(n)] if not tag else [
        int.to_bytes(i, 24, "big") + tag.encode()[:8].ljust(8, b"-") for i in range(n)]


def batches(keys: Sequence[bytes], n: int) -> Iterator[Sequence[bytes]]:
    for i in range(0, len(keys), n):
        yield keys[i:i + n]


# -- the subscribers' child process -------------------------------------------------------------


async def serve_subscribers(address: str, streams: int) -> None:
    """(The child process.) `streams` WatchEvents streams on `address`, each on its own gRPC
    channel as a follower opens them; prints its RSS, "ready" once every stream has had an event,
    then the events received, every 0.1 s, until killed."""
    from kvstored.peer.control import ControlChannel
    from kvstored.peer.membership import parse_address

    print(f"rss {rss_anon(os.getpid())}", flush=True)
    channels = [ControlChannel(parse_address(address), None, 0.5) for _ in range(streams)]
    counts = [0] * streams

    async def follow(i: int) -> None:
        async for _ in channels[i].watch(0):
            counts[i] += 1

    tasks = [asyncio.create_task(follow(i)) for i in range(streams)]
    ready = False
    while not any(t.done() for t in tasks):
        await asyncio.sleep(0.1)
        if not ready and all(counts):
            ready = True
            print(f"ready {rss_anon(os.getpid())}", flush=True)
        print(f"count {sum(counts)}", flush=True)
    for t in tasks:
        if t.done() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]


class Subscribers:
    """The child process of serve_subscribers, and what it reports."""

    def __init__(self, address: str, streams: int) -> None:
        self.streams = streams
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.scale_calibrate", "--serve-subscribers", address,
                                      str(streams)], stdout=subprocess.PIPE, text=True, env=_child_env(), cwd=REPO)
        self.rss_before = self.rss_ready = 0
        self.received = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._read, name="scale-calibrate-subs", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            word, _, value = line.strip().partition(" ")
            if word == "rss":
                self.rss_before = int(value)
            elif word == "ready":
                self.rss_ready = int(value)
                self._ready.set()
            elif word == "count":
                self.received = int(value)

    def wait_ready(self, nudge: Callable[[], None]) -> None:
        """Until every stream has received an event (`nudge` publishes one)."""
        deadline = time.monotonic() + WAIT_S
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the subscribers' process never got its streams going")
            nudge()

    def wait_received(self, total: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.received < total and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)
        self._thread.join(5)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "client"), env.get("PYTHONPATH", "")])
    return env


# -- the phases -----------------------------------------------------------------------------------


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
    streams: dict[str, float]
    ram_bytes: int  # A's RAM tier


def run_event_phases(pair: Pair, entries: int, subscribers: int, batch: int) -> EventRun:
    a, b = pair.a, pair.b
    small = ns_fields("4k", SMALL)
    zeros = np.zeros((BIG_BATCH, SMALL), np.uint8)
    with a.client() as kv_a:
        ns = kv_a.register_namespace(**small)
        singles = new_keys(SINGLE_EVENTS, "single")

        def store_singles(keys: Sequence[bytes]) -> Callable[[], int]:
            def work() -> int:
                for key in keys:
                    kv_a.store(ns, [key], zeros[:1])
                return len(keys)
            return work

        def store_batches(keys: Sequence[bytes]) -> Callable[[], int]:
            def work() -> int:
                for part in batches(keys, BIG_BATCH):
                    kv_a.store(ns, part, zeros[:len(part)])
                return len(keys)
            return work

        print("events and the index's memory (B follows A)", flush=True)
        pair.measure_idle()
        single = pair.phase("single-key stores", store_singles(singles))
        half = entries // 2
        bulk = new_keys(2 * half, "bulk")
        rss = [(pair.b_view_of_a().indexed_chunks, rss_anon(b.pid))]
        batched = pair.phase(f"{BIG_BATCH}-key stores (1)", store_batches(bulk[:half]))
        rss.append((pair.b_view_of_a().indexed_chunks, rss_anon(b.pid)))
        batched2 = pair.phase(f"{BIG_BATCH}-key stores (2)", store_batches(bulk[half:]))
        rss.append((pair.b_view_of_a().indexed_chunks, rss_anon(b.pid)))

        # More followers of A: what publishing costs per subscriber, and a stream's memory.
        a_rss0 = rss_anon(a.pid)
        subs = Subscribers(a.address, subscribers)
        nudges = new_keys(200, "nudge")
        nudge_iter = iter(nudges)
        subs.wait_ready(lambda: kv_a.store(ns, [next(nudge_iter)], zeros[:1]))
        a_rss1 = rss_anon(a.pid)
        a_idle0 = process_cpu_seconds(a.pid)
        time.sleep(2.0)
        a_idle_with_streams = (process_cpu_seconds(a.pid) - a_idle0) / 2.0
        received0 = subs.received
        singles2 = new_keys(SINGLE_EVENTS, "single2")
        single_subs = pair.phase(f"single-key stores, {subscribers} more subscribers", store_singles(singles2))
        subs.wait_received(received0 + subscribers * single_subs.events)
        received1 = subs.received
        bulk2 = new_keys(half // 2 // BIG_BATCH * BIG_BATCH or BIG_BATCH, "bulk2")
        batched_subs = pair.phase(f"{BIG_BATCH}-key stores, {subscribers} more subscribers", store_batches(bulk2))
        subs.wait_received(received1 + subscribers * batched_subs.events)
        subs.stop()

        def clear_all() -> int:
            with grpc.insecure_channel(f"unix:{a.socket}") as channel:
                pb_grpc.KVStoreStub(channel).ClearNamespace(pb.ClearNamespaceRequest(namespace_id=ns.namespace_id),
                                                            timeout=WAIT_S)
            return 0

        removed = pair.phase("namespace cleared (one event of every key)", clear_all)

        # A chunk's whole life at steady state: RAM and fs full, every store evicts.
        life = ns_fields("life", LIFE_CHUNK)
        life_ns = kv_a.register_namespace(**life)
        ram_chunks = pair_ram_bytes(pair) // LIFE_CHUNK
        fill = new_keys(ram_chunks + FS_BYTES // LIFE_CHUNK + 2 * batch, "fill")
        data = np.zeros((batch, LIFE_CHUNK), np.uint8)

        def store_life(keys: Sequence[bytes]) -> Callable[[], int]:
            def work() -> int:
                for part in batches(keys, batch):
                    kv_a.store(life_ns, part, data[:len(part)])
                return len(keys)
            return work

        pair.phase("lifecycle: filling RAM and fs", store_life(fill))
        steady = pair.phase("lifecycle: steady state", store_life(new_keys(max(batch, min(ram_chunks, 2000)), "life")))
    streams = {
        "server_bytes_per_stream": (a_rss1 - a_rss0) / subscribers,
        "client_bytes_per_stream": (subs.rss_ready - subs.rss_before) / subscribers,
        "server_idle_cpu_s_per_s_per_stream": max(0.0, a_idle_with_streams - pair.a_idle_cpu_per_s) / subscribers,
    }
    return EventRun(single, batched, batched2, single_subs, batched_subs, removed, steady, rss, streams,
                    pair_ram_bytes(pair))


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
    out["phases"] = {p.name: {**asdict(p), "per_event": p.per("event"), "per_key": p.per("key"),
                              "per_chunk": p.per("chunk")}
                     for p in (single, run.batched, batched2, single_subs, batched_subs, removed, steady)}
    out["fit"] = {
        "basis": "two-point fit (single-key stores; 1,000-key stores) of what B's socket received and B's CPU",
        "payload_bytes_per_event": per_event, "payload_bytes_per_key": per_key,
        "segments_per_single_key_event": single.segments / max(1, single.events),
        "follower_cpu_s_per_event": cpu_event, "follower_cpu_s_per_key": cpu_key,
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
        "store_batch": batch, "chunks": steady.chunks,
        "events_per_chunk": steady.events / chunks, "keys_per_chunk": steady.keys / chunks,
        "payload_bytes_per_chunk": steady.payload_bytes / chunks, "segments_per_chunk": steady.segments / chunks,
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
        "idle_basis": "A's CPU rate over 2 s with the streams open and quiet (keepalive pings every 5 s) minus "
                      "without, per stream",
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
                pb.KvEvent(seq=seq, ts=1.0, type=1, cause=1, tier="ram", tier_kind=1, namespace_id="n" * 32,
                           keys=k).SerializeToString()
            best = min(best, (time.perf_counter() - t0) / reps)
        return best

    return max(0.0, (cost(many) - cost(many[:1])) / (keys - 1))


def pair_ram_bytes(pair: Pair) -> int:
    return int(pair.a.stats().tiers[0].capacity_bytes)


def measure_lookups_and_fetch(pair: Pair, reps: int) -> dict[str, Any]:
    a, b = pair.a, pair.b
    small = ns_fields("4k", SMALL)
    out: dict[str, Any] = {}
    print("lookups and a peer fetch", flush=True)
    with b.client() as kv_b, a.client() as kv_a:
        ns_b = kv_b.register_namespace(**small)
        ns_a = kv_a.register_namespace(**small)
        misses = new_keys(256, "")
        one = misses[:1]
        for _ in range(5):
            kv_b.lookup(ns_b, misses)
        t1 = timed(lambda: kv_b.lookup(ns_b, one), reps)
        t256 = timed(lambda: kv_b.lookup(ns_b, misses), reps)
        out["local"] = {
            "basis": f"B's Lookup (unix socket, client library) of keys nobody holds: RAM, fs and the peer index "
                     f"asked; median of {reps}",
            "one_key_ms": t1 * 1e3, "keys_256_ms": t256 * 1e3, "per_key_us": (t256 - t1) / 255 * 1e6,
        }

        # What asking a remote directory costs: a Lookup over A's TCP listener, keys in A's RAM.
        held = new_keys(64, "held")
        kv_a.store(ns_a, held, np.zeros((len(held), SMALL), np.uint8))
        with grpc.insecure_channel(a.address) as channel:
            stub = pb_grpc.KVStoreStub(channel)
            for _ in range(5):
                stub.Lookup(pb.LookupRequest(namespace_id=ns_a.namespace_id, keys=held), timeout=10)
            r1 = timed(lambda: stub.Lookup(pb.LookupRequest(namespace_id=ns_a.namespace_id, keys=held[:1]),
                                           timeout=10), reps)
            cpu0, w0 = process_cpu_seconds(a.pid), time.monotonic()
            r64 = timed(lambda: stub.Lookup(pb.LookupRequest(namespace_id=ns_a.namespace_id, keys=held),
                                            timeout=10), reps)
            cpu1, w1 = process_cpu_seconds(a.pid), time.monotonic()
        server_cpu = max(0.0, cpu1 - cpu0 - pair.a_idle_cpu_per_s * (w1 - w0)) / reps
        out["remote"] = {
            "basis": f"Lookup over A's TCP listener (plaintext gRPC on loopback; a directory would be asked so), "
                     f"keys in A's RAM; median of {reps}; A's CPU per 64-key call",
            "one_key_ms": r1 * 1e3, "keys_64_ms": r64 * 1e3, "server_cpu_ms_per_call": server_cpu * 1e3,
        }

        # A peer fetch: one 4 KiB chunk only B holds, loaded through A (lookup, order, bytes, promotion).
        remote = new_keys(reps, "fetch")
        kv_b.store(ns_b, remote, np.zeros((len(remote), SMALL), np.uint8))
        pair.cluster.wait_indexed(0, 1, len(remote))
        buf = np.empty((1, SMALL), np.uint8)
        peer_times, local_times = [], []
        for key in remote:
            t0 = time.perf_counter()
            got = kv_a.load(ns_a, [key], buf)
            peer_times.append(time.perf_counter() - t0)
            if got != 1:
                raise RuntimeError("A could not load a chunk B holds")
        for key in remote:
            t0 = time.perf_counter()
            kv_a.load(ns_a, [key], buf)
            local_times.append(time.perf_counter() - t0)
        peer, local = statistics.median(peer_times), statistics.median(local_times)
        out["fetch"] = {
            "basis": f"A's client loads one 4 KiB chunk only B holds (A's peer index names B: fetch order over gRPC, "
                     f"bytes over the TCP data plane, checksum, promotion into A's RAM), minus loading it again "
                     f"from A's RAM; medians of {reps}",
            "peer_load_ms": peer * 1e3, "local_load_ms": local * 1e3, "round_trip_ms": (peer - local) * 1e3,
        }
    return out


def timed(call: Callable[[], object], reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# -- in this process: the daemon's classes with many peers ----------------------------------------


def index_bytes_by_slot(slots: Sequence[int], n: int = 20_000) -> list[dict[str, float]]:
    """tracemalloc per entry of a PeerIndex whose chunks are all held by the peer in `slot`."""
    from kvstored.tiers.peer_index import PeerIndex

    rows = []
    for slot in slots:
        index = PeerIndex(n)
        for _ in range(slot + 1):
            index.add_peer()
        keys = [os.urandom(32) for _ in range(n)]
        tracemalloc.start()
        try:
            index.add(slot, 0, "n" * 32, keys)
            used, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        rows.append({"slot": slot, "bytes_per_entry": used / n})
    return rows


def index_bytes_readme_way(n: int) -> float:
    """The README's measurement (tests/unit/test_peer_index.py), at n entries: 5 peers."""
    from kvstored.tiers.peer_index import PeerIndex

    raw = [os.urandom(32) for _ in range(n)]
    index = PeerIndex(n)
    slots = [index.add_peer() for _ in range(5)]
    tracemalloc.start()
    try:
        for i, slot in enumerate(slots):
            index.add(slot, i % 2, "n" * 32, raw[i::5])
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return used / n


def index_updates_by_slot(slots: Sequence[int], n: int = 20_000, rounds: int = 3) -> list[dict[str, float]]:
    """Time of one single-key add and remove at `slot` (what applying an event does to the index);
    the best of `rounds` (the machine is shared)."""
    from kvstored.tiers.peer_index import PeerIndex

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
    """Choosing a chunk group's owner by rendezvous hashing among N nodes (the highest xxh3 of the
    group's key seeded per node): what a directory design would pay per group changed or asked."""
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
    from kvstored.peer.transport import TransportKind
    from kvstored.tiers.peer import PeerTier
    from kvstored.tiers.registry import PeerTierConfig, TierContext, TransportPreference

    registry = NamespaceRegistry(1 << 30)
    ns = registry.register("scale-calibrate/contains", "u8", SMALL, "", b"", 32)
    addresses = tuple(f"10.0.{i // 250}.{i % 250 + 1}:7070" for i in range(peers))
    tier = PeerTier(PeerTierConfig(peers=addresses, transport=TransportPreference.TCP),
                    TierContext(namespaces=registry))
    from kvstored.peer.membership import PeerState

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


def contains_by_peers(peer_counts: Sequence[int], keys: int = 1024, budget_s: float = 0.15,
                      rounds: int = 2) -> list[dict[str, float]]:
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


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) by least squares."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def measure_in_process() -> dict[str, Any]:
    print("the daemon's index and peer tier in this process, 1 to 1000 peers", flush=True)
    slots = (0, 1, 2, 7, 99, 499, 999)
    by_slot = index_bytes_by_slot(slots)
    big = [r for r in by_slot if r["slot"] >= 7]
    base, per_slot = linear_fit([r["slot"] for r in big], [r["bytes_per_entry"] for r in big])
    updates = index_updates_by_slot((0, 99, 499, 999))
    add0, add_slope = linear_fit([r["slot"] for r in updates], [r["add_us"] for r in updates])
    contains = contains_by_peers((1, 10, 100, 1000))
    call0, call_slope = linear_fit([r["peers"] for r in contains], [r["per_call_us"] for r in contains])
    key0, key_slope = linear_fit([r["peers"] for r in contains], [r["per_key_us"] for r in contains])
    readme_way = index_bytes_readme_way(200_000)
    rendezvous = rendezvous_cost((10, 100, 1000))
    return {
        "index_tracemalloc": {
            "basis": "tracemalloc of kvstored.tiers.peer_index.PeerIndex in this process, 32-byte keys: the README's "
                     "way (5 peers, 200,000 entries), and 20,000 entries all held by the peer in one slot",
            "bytes_per_entry_5_peers": readme_way,
            "by_slot": by_slot,
            "fit_slot_ge_7": {"bytes_per_entry_at_slot_0": base, "bytes_per_slot": per_slot},
        },
        "index_updates": {
            "basis": "PeerIndex.add then .remove of one key (one event's index work) at a slot, in this process",
            "by_slot": updates, "fit": {"add_us_at_slot_0": add0, "add_us_per_slot": add_slope},
        },
        "contains": {
            "basis": "PeerTier.contains (the peer tier's part of a Lookup) in this process, N peers up, keys held "
                     "by random peers; per call and per key from 1- and 1024-key calls, best of 2",
            "by_peers": contains,
            "fit": {"per_call_us": call0, "per_call_us_per_peer": call_slope, "per_key_us": key0,
                    "per_key_us_per_peer": key_slope},
        },
        "rendezvous": {
            "basis": "choosing a chunk group's owner among N nodes by rendezvous hashing (max of xxh3_64 seeded per "
                     "node), in Python, in this process",
            "by_nodes": rendezvous,
            "us_per_node": statistics.median(r["us_per_node"] for r in rendezvous),
        },
    }


# -- S3 ---------------------------------------------------------------------------------------------


def measure_s3(kind: str, chunk_bytes: int, reps: int) -> dict[str, Any]:
    if kind == "none":
        return {"server": None, "note": "--s3 none: not measured"}
    import boto3

    from tests.support.s3 import MotoServer, RadosGW

    print("S3 PUT/GET latency", flush=True)
    errors, server, endpoint, which = [], None, None, ""
    for which in (["radosgw", "moto"] if kind == "auto" else [kind]):
        server = RadosGW(memstore_bytes=max(256 << 20, 4 * reps * chunk_bytes)) if which == "radosgw" else MotoServer()
        try:
            endpoint = server.start()
            break
        except Exception as exc:  # noqa: BLE001 - try the next kind, report every reason
            errors.append(f"{which}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}")
            with contextlib.suppress(Exception):
                server.stop()
            server = None
    if server is None or endpoint is None:
        return {"server": None, "note": "no S3 server started: " + "; ".join(errors)}
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint.url, aws_access_key_id=endpoint.access_key,
                          aws_secret_access_key=endpoint.secret_key, region_name=endpoint.region)
        bucket = f"scale-calibrate-{os.getpid()}"
        s3.create_bucket(Bucket=bucket)
        s3.put_object(Bucket=bucket, Key="warm", Body=b"x")  # the first PUT creates radosgw's pools (~2 s)
        out: dict[str, Any] = {"server": which, "chunk_bytes": chunk_bytes, "reps": reps}
        for label, size in (("chunk", chunk_bytes), ("small", SMALL)):
            body = os.urandom(size)
            puts, gets = [], []
            for i in range(reps):
                t0 = time.perf_counter()
                s3.put_object(Bucket=bucket, Key=f"{label}/{i}", Body=body)
                puts.append(time.perf_counter() - t0)
            for i in range(reps):
                t0 = time.perf_counter()
                s3.get_object(Bucket=bucket, Key=f"{label}/{i}")["Body"].read()
                gets.append(time.perf_counter() - t0)
            out[f"put_{label}_ms"] = statistics.median(puts) * 1e3
            out[f"get_{label}_ms"] = statistics.median(gets) * 1e3
        out["basis"] = (f"boto3 PUT then GET of {reps} objects of {chunk_bytes >> 20} MiB and of 4 KiB, one at a time, "
                        f"medians, against {which} on loopback"
                        + (" (moto_server keeps objects in RAM: not an object store's latency)" if which == "moto"
                           else " (a memstore OSD: no disks, no network: latencies are a floor)"))
        if errors:
            out["note"] = "; ".join(errors)
        return out
    finally:
        server.stop()


# -- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Measure, on two real kvstored daemons with peer tiers on loopback, the per-operation costs "
                    "bench/scale_out.py models a fleet with: index memory per remote entry (RSS growth, and "
                    "tracemalloc beside the README's 171 B/entry), event bytes and follower CPU per event and per key "
                    "on the WatchEvents stream, publisher CPU per subscriber, local Lookup cost per key, a remote "
                    "Lookup over TCP, the peer fetch round trip, and S3 PUT/GET latency per chunk (radosgw, else "
                    "moto). Writes a calibration JSON with the machine and the load average.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the calibration JSON to write")
    parser.add_argument("--entries", type=int, default=100_000,
                        help="remote entries B's index grows by for the memory measurement (4 KiB chunks on A)")
    parser.add_argument("--subscribers", type=int, default=16, help="extra WatchEvents streams on A (publisher cost)")
    parser.add_argument("--batch", type=int, default=50,
                        help="chunks per store in the lifecycle phase (a turn's new chunks, as scale_out.py assumes)")
    parser.add_argument("--reps", type=int, default=60, help="samples per latency")
    parser.add_argument("--s3", choices=("auto", "radosgw", "moto", "none"), default="auto",
                        help="the S3 server for PUT/GET latency (auto: radosgw if Ceph starts here, else moto)")
    parser.add_argument("--s3-chunk-mib", type=int, default=2, help="object size for S3 PUT/GET latency")
    parser.add_argument("--serve-subscribers", nargs=2, metavar=("ADDRESS", "STREAMS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_subscribers:
        asyncio.run(serve_subscribers(args.serve_subscribers[0], int(args.serve_subscribers[1])))
        return 0
    if shutil.which("ss") is None:
        print("scale_calibrate: needs `ss` (iproute2) to read what B's TCP socket received", file=sys.stderr)
        return 2

    started = time.monotonic()
    load = {"start": loadavg()}
    doc: dict[str, Any] = {"schema": 1, "created": datetime.now(UTC).isoformat(timespec="seconds"),
                           "machine": machine_info(), "parameters": {k: v for k, v in vars(args).items()
                                                                     if k != "serve_subscribers"}}
    # Every 4 KiB chunk of the event phases stays in A's RAM, below its write-back headroom (5%).
    small_chunks = 2 * SINGLE_EVENTS + args.entries + args.entries // 4 + 200
    a_ram = f"{(small_chunks * SMALL * 10 // 9 + (32 << 20)) >> 20}MiB"
    pair = Pair(a_ram)
    try:
        pair.start()
        doc["events"] = events_report(run_event_phases(pair, args.entries, args.subscribers, args.batch),
                                      args.subscribers, args.batch)
        load["after_events"] = loadavg()
        doc["lookup"] = measure_lookups_and_fetch(pair, args.reps)
        load["after_lookups"] = loadavg()
    finally:
        pair.close()
    doc["in_process"] = measure_in_process()
    doc["s3"] = measure_s3(args.s3, args.s3_chunk_mib << 20, max(8, args.reps // 4))
    load["end"] = loadavg()
    doc["load_average"] = load
    doc["duration_s"] = round(time.monotonic() - started, 1)
    write_json(args.out, doc)
    summarize(doc)
    print(f"wrote {args.out} ({doc['duration_s']} s; load average {load['start'][0]} at the start, "
          f"{load['end'][0]} at the end)")
    return 0


def summarize(doc: dict[str, Any]) -> None:
    ev, fit, life = doc["events"], doc["events"]["fit"], doc["events"]["lifecycle"]
    mem, ip = ev["index_memory"], doc["in_process"]
    look = doc["lookup"]
    lines = [
        ("index memory per entry, B's RSS", f"{mem['rss_bytes_per_entry']:.0f} B "
                                             f"(second half {mem['rss_bytes_per_entry_second_half']:.0f} B; "
                                             f"README {README_BYTES_PER_ENTRY} B)"),
        ("index memory per entry, tracemalloc", f"{ip['index_tracemalloc']['bytes_per_entry_5_peers']:.0f} B "
                                                f"(+{ip['index_tracemalloc']['fit_slot_ge_7']['bytes_per_slot']:.3f} "
                                                "B per slot of the holder)"),
        ("event payload bytes", f"{fit['payload_bytes_per_event']:.0f} B/event + "
                                f"{fit['payload_bytes_per_key']:.1f} B/key"),
        ("follower CPU", f"{fit['follower_cpu_s_per_event'] * 1e6:.1f} us/event + "
                         f"{fit['follower_cpu_s_per_key'] * 1e6:.2f} us/key"),
        ("publisher CPU per subscriber", f"{fit['publisher_cpu_s_per_event_per_subscriber'] * 1e6:.1f} us/event, "
                                         f"{fit['publisher_cpu_s_per_key_per_subscriber'] * 1e6:.2f} us/key"),
        ("a chunk's life (RAM -> fs, full)", f"{life['events_per_chunk']:.2f} events, "
                                             f"{life['keys_per_chunk']:.2f} keys, "
                                            f"{life['payload_bytes_per_chunk']:.0f} B, "
                                            f"{life['follower_cpu_s_per_chunk'] * 1e6:.0f} us of B's CPU"),
        ("stream memory", f"server {ev['streams']['server_bytes_per_stream'] / 1024:.0f} KiB, "
                          f"client {ev['streams']['client_bytes_per_stream'] / 1024:.0f} KiB"),
        ("local Lookup", f"{look['local']['one_key_ms']:.3f} ms + {look['local']['per_key_us']:.2f} us/key"),
        ("remote Lookup over TCP", f"{look['remote']['one_key_ms']:.3f} ms (64 keys {look['remote']['keys_64_ms']:.3f} "
                                   f"ms, server CPU {look['remote']['server_cpu_ms_per_call']:.3f} ms)"),
        ("peer fetch round trip", f"{look['fetch']['round_trip_ms']:.3f} ms"),
        ("peer tier contains, 1 -> 1000 peers", f"{ip['contains']['by_peers'][0]['per_call_us']:.1f} -> "
                                               f"{ip['contains']['by_peers'][-1]['per_call_us']:.1f} us per call, "
                                               f"{ip['contains']['by_peers'][0]['per_key_us']:.2f} -> "
                                               f"{ip['contains']['by_peers'][-1]['per_key_us']:.2f} us per key"),
        ("rendezvous owner choice", f"{ip['rendezvous']['us_per_node']:.3f} us per node per group"),
    ]
    s3 = doc["s3"]
    if s3.get("server"):
        lines.append((f"S3 ({s3['server']})", f"PUT {s3['put_chunk_ms']:.1f} ms, GET {s3['get_chunk_ms']:.1f} ms per "
                                              f"{s3['chunk_bytes'] >> 20} MiB; 4 KiB: PUT {s3['put_small_ms']:.1f}, "
                                              f"GET {s3['get_small_ms']:.1f} ms"))
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"  {k.ljust(width)}  {v}")


if __name__ == "__main__":
    sys.exit(main())
