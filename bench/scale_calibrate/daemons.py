# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The two daemons A and B with peer tiers on loopback, and their snapshots."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.lib.daemons import process_cpu_seconds
from bench.scale_calibrate.common import FS_BYTES, WAIT_S, cpu_rates, loadavg, tcp_received
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from tests.support.wait import wait_for


class EventWatcher:
    """A WatchEvents stream on A's unix socket, counting events and keys by (type, tier), and
    their protobuf size: what B receives, told apart by kind (a thread: the stream blocks)."""

    def __init__(self, socket: Path) -> None:
        # A cleared namespace is one event of every key: allow what the peers allow.
        self._channel = grpc.insecure_channel(f"unix:{socket}", options=[("grpc.max_receive_message_length", 64 << 20)])
        self.failure: grpc.RpcError | None = None
        self._stream = pb_grpc.KVStoreStub(self._channel).WatchEvents(pb.WatchEventsRequest(from_seq=0))
        self.keys = self.last_seq = self.payload_bytes = 0
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
                self.last_seq = event.seq
                self.last_at = time.monotonic()
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.CANCELLED:  # (cancelled: closed by us)
                self.failure = exc

    def wait_quiet(self, quiet_s: float = 0.4) -> None:
        """Until no event came for quiet_s (write-downs run after the stores return)."""
        quiet = wait_for(lambda: self.failure is not None or time.monotonic() - self.last_at >= quiet_s, WAIT_S, 0.05)
        if self.failure is not None:
            raise RuntimeError(f"the event watcher on A failed: {self.failure}")
        if not quiet:
            raise TimeoutError("A never stopped publishing events")

    def close(self) -> None:
        self._stream.cancel()
        self._channel.close()
        self._thread.join(5)


@dataclass
class Snapshot:
    at: float
    b_cpu: float
    a_cpu: float
    counts: tuple[int, ...]  # B's events, the watcher's keys, B's TCP bytes and segments in, the watcher's bytes
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
        totals = {"bytes": self.payload_bytes, "segments": self.segments, "b_cpu_us": self.b_cpu_s * 1e6}
        return {k: v / n for k, v in (totals | {"events": self.events, "keys": self.keys}).items()} if n else {}


class Pair:
    """Daemons A and B (tests/support/cluster.py), the watcher on A, and B's costs per phase."""

    def __init__(self, a_ram: str) -> None:
        from tests.support.cluster import Cluster

        # Both list both; A keeps enough events that B never resyncs. B follows every event as it
        # happens (the per-event and per-key costs; follow() switches it to the coalesced stream).
        self.cluster = Cluster(
            2,
            "tcp",
            peer_options={"coalesce_events": "false"},
            cpu_bytes=a_ram,
            fs_bytes=f"{FS_BYTES >> 20}MiB",
            extra_args=["--page-bytes", "4096", "--events-buffer", "2000000"],
        )
        self.a, self.b = self.cluster[0], self.cluster[1]
        self.a_port = int(self.a.address.rpartition(":")[2])
        self.watcher: EventWatcher | None = None
        self.b_idle_cpu_per_s = self.a_idle_cpu_per_s = self.b_cpu_per_poll = 0.0
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

    def follow(self, coalesce: bool) -> None:
        """Restart B following A's events coalesced or each as it happens (B stores nothing of its
        own; it reads A whole again), until it has caught up."""
        b = self.b
        b.stop()
        b.args = [
            a.replace(f"coalesce_events={str(not coalesce).lower()}", f"coalesce_events={str(coalesce).lower()}")
            for a in b.args
        ]
        self.cluster.restart(1)
        for i in range(2):
            self.cluster.wait_up(i)
        self.caught_up()

    def b_view_of_a(self) -> pb.PeerInfo:
        self.polls += 1
        return self.b.peer(self.a)

    def measure_idle(self, seconds: float = 1.0, polls: int = 20) -> None:
        """B's and A's CPU rate doing nothing, and what one PeerStatus poll costs B."""
        a, b = cpu_rates([self.a.pid, self.b.pid], seconds)
        self.a_idle_cpu_per_s, self.b_idle_cpu_per_s = max(0.0, a), max(0.0, b)
        b0, t0 = process_cpu_seconds(self.b.pid), time.monotonic()
        for _ in range(polls):
            self.b.peer(self.a)
        b1, t1 = process_cpu_seconds(self.b.pid), time.monotonic()
        self.b_cpu_per_poll = max(0.0, (b1 - b0 - self.b_idle_cpu_per_s * (t1 - t0)) / polls)

    def snapshot(self) -> Snapshot:
        assert self.watcher is not None
        info, w = self.b_view_of_a(), self.watcher  # (the poll before the CPU readings: phase() counts its cost)
        b_cpu, a_cpu = process_cpu_seconds(self.b.pid), process_cpu_seconds(self.a.pid)
        counts = (info.events, w.keys, *tcp_received(self.b.pid, self.a_port), w.payload_bytes)
        return Snapshot(time.monotonic(), b_cpu, a_cpu, counts, Counter(w.by_kind))

    def caught_up(self, past_seq: int | None = None) -> None:
        """Until A has stopped publishing and B's index reflects every event A published (by seq).
        `past_seq`: first wait for an event beyond it (the work published some)."""
        watcher = self.watcher
        assert watcher is not None
        if past_seq is not None and not wait_for(lambda: watcher.last_seq > past_seq, WAIT_S, 0.01):
            raise TimeoutError("A published no event of the phase's work")
        watcher.wait_quiet()
        if not wait_for(lambda: self.b_view_of_a().last_seq >= watcher.last_seq, WAIT_S, 0.1):
            raise TimeoutError("B never applied A's events:\n" + self.cluster.describe())

    def phase(self, name: str, work: Callable[[], int | None]) -> Phase:
        """Run `work` (returns the chunks it stored, if that matters) and what it cost B."""
        polls0 = self.polls
        s0 = self.snapshot()
        seq0 = self.watcher.last_seq if self.watcher is not None else 0
        chunks = work() or 0
        self.caught_up(seq0 if chunks else None)
        s1 = self.snapshot()
        dt = s1.at - s0.at
        polls = self.polls - polls0 - 1  # the first snapshot's poll came before s0's CPU reading
        events, keys, payload, segments, protobuf = (after - before for before, after in zip(s0.counts, s1.counts))
        b_cpu = max(0.0, s1.b_cpu - s0.b_cpu - self.b_idle_cpu_per_s * dt - self.b_cpu_per_poll * polls)
        a_cpu = max(0.0, s1.a_cpu - s0.a_cpu - self.a_idle_cpu_per_s * dt)
        kinds = {k: v for k, v in (s1.by_kind - s0.by_kind).items() if v}
        load = loadavg()[0]
        phase = Phase(name, dt, events, keys, payload, segments, protobuf, b_cpu, a_cpu, kinds, chunks, load)
        print(
            f"  {name}: {phase.events} events, {phase.keys} keys, {phase.payload_bytes:,} B received, "
            f"B CPU {phase.b_cpu_s * 1e3:.1f} ms, A CPU {phase.a_cpu_s * 1e3:.1f} ms in {dt:.2f} s "
            f"(load {phase.load_average:.2f})",
            flush=True,
        )
        return phase
