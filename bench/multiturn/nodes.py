# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Several nodes (`--nodes N`): N real daemons, one per modelled GPU node, turns routed round-robin
(no KV-aware router: every turn lands on another node than the one before); the set-ups compared
(no offload, islands, peers, one shared S3 bucket) and the modelled cluster on one model clock."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.multiturn.kvroute import KvIndex, choose, token_ids
from bench.multiturn.model import Config, Model, Workload
from bench.multiturn.offload import Offload
from bench.multiturn.sim import Lane, Simulation, TurnRecord, run_clock

NODE_TIERS = ("gpu", "ram", "fs", "peer", "s3")  # where a reusable chunk was found
LOADED_TIERS = NODE_TIERS[1:]
TARGET_HIT_POINTS = 5.0  # the directory's hit rate at most this far below one node with the fleet's RAM + fs
TARGET_VS_ISLANDS = 1.3  # peers vs the same nodes without peers, at the largest count
RAM_CONVERSATIONS = 64.0  # per node by default: three nodes' pools and radosgw's memstore fit a 24 GiB machine
S3_SETTLE_BOUND_S = 3.0  # the longest wait for a node's S3 write-throughs before a lookup elsewhere
ROUTING = "round robin: turn t of conversation c on node (c + t - 1) mod N (no KV awareness)"


CONFIGS = (
    Config("none", "no offload", offload=False),
    Config("ram+fs", "islands: RAM + fs", (("fs", "fs_bytes"),)),
    Config("ram+fs+peer", "RAM + fs + peers", (("fs", "fs_bytes"), ("peer", ""))),
    Config("ram+fs+s3", "RAM + fs + shared S3", (("fs", "s3_fs_bytes"), ("s3", "s3_bytes")), write_through=True),
)
# --directory: the directory's fleet against islands and against one store as large as the fleet's
DIRECTORY_CONFIGS = (
    Config("ram+fs+dir", "RAM + fs + directory", (("fs", "fs_bytes"), ("peer", "")), directory=True),
    Config("pooled", "one node, fleet's RAM + fs", (("fs", "fs_bytes"),), pooled=True),
)
CONFIG_BY_KEY = {c.key: c for c in (*CONFIGS, *DIRECTORY_CONFIGS)}
CONFIG_KEYS = tuple(c.key for c in CONFIGS)
DIRECTORY_KEYS = ("none", "ram+fs", "ram+fs+dir", "pooled")
LABELS = {c.key: c.label for c in CONFIG_BY_KEY.values()}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group(
        "several nodes (bench/multiturn/nodes.py)",
        "--nodes N runs N real daemons, one per modelled GPU node; each turn of a conversation goes to the next node "
        "round-robin (no KV awareness). Compared: no offload, islands (each node RAM + fs, no peers), RAM + fs + "
        "peers (the other nodes' daemons), RAM + fs + one shared S3 bucket; hit rates per tier, PEER included",
    )
    g.add_argument(
        "--directory",
        action="store_true",
        help="the fleet directory instead: a real Redis Cluster (3 masters, 3 replicas on loopback, "
        "tests/support/redis_cluster.py), daemons with no static peers; compared: no offload, islands, "
        f"RAM + fs + directory, and one node with the fleet's total RAM + fs (set-ups {', '.join(DIRECTORY_KEYS)})",
    )
    g.add_argument("--nodes", type=int, default=1, help="modelled GPU nodes, each with its own daemon (1: one node)")
    transport_text = "the peer tier's data plane on loopback (tcp: the faster one on these machines)"
    g.add_argument("--peer-transport", default="tcp", choices=("tcp", "ucx", "auto"), help=transport_text)
    g.add_argument(
        "--route",
        default="rr",
        choices=("rr", "kv"),
        help="kv: also run every set-up with each turn routed by Dynamo's KV indexer (fed by the daemons' ZMQ "
        "events; its venv: tests/vllm/install_dynamo.sh) and compare it with round robin",
    )
    settle_text = (
        "wall seconds a turn's stores get to reach the other nodes (peer index, shared bucket) "
        "before the conversation's next turn looks them up: the model clock's think time"
    )
    g.add_argument("--settle-s", type=float, default=0.2, help=settle_text)


PEER_COUNTERS = (
    "fetches received_chunks received_bytes sent_bytes missing_chunks failed_chunks timed_out_chunks corrupt_chunks "
    "refused_by_breaker events resyncs"
).split()


def peer_counters(status: Any) -> dict[str, int]:
    """One node's view of its peers, summed over them, and what it served them."""
    out = {k: sum(int(getattr(p, k)) for p in status.peers) for k in PEER_COUNTERS}
    out.update(
        served_chunks=int(status.served_chunks),
        served_bytes=int(status.served_bytes),
        refused_chunks=int(status.refused_chunks),
    )
    return out


# -- the modelled cluster -------------------------------------------------------------------------


PREFETCHED_BY_LOOKUP = ("fs", "peer")  # tiers whose lookup asks only an in-memory index, then starts the reads


class NodeSim(Simulation):
    """One node: its GPU cache, its daemon, its loader's cost windows (multiturn's Simulation),
    storing what it computes when it computes it instead of what its GPU evicts.

    A lookup starts reading the hits below RAM at once (the daemon's prefetch), so part of their
    transfer happens while the lookup is measured, which the model would charge once instead of
    x the byte scale. For the fs and peer tiers, whose lookup itself is an index look-up, a
    lookup's time beyond `lookup_floor_s` (a lookup of RAM-resident keys, measured at the start;
    with the directory, of keys nobody holds: its round trip is per lookup, not per byte)
    is therefore moved to those tiers' load calls (by chunks) before they are charged. Not with an
    S3 tier under them: there a lookup's own time is mostly its HEAD requests, charged as measured
    (so the shared-bucket set-up keeps that bias, in its favour)."""

    lookup_floor_s = 0.0
    move_lookup_excess = True
    moved_s = 0.0  # lookup time charged to fs/peer load calls instead

    def _segments(
        self, lookup_s: float, segments: Sequence[tuple[str, float, int]]
    ) -> tuple[float, list[tuple[str, float, int]]]:
        lower = sum(n for tier, _, n in segments if tier in PREFETCHED_BY_LOOKUP)
        excess = lookup_s - self.lookup_floor_s
        if not self.move_lookup_excess or not lower or excess <= 0:
            return lookup_s, list(segments)
        self.moved_s += excess
        return self.lookup_floor_s, [
            (t, s + excess * n / lower if t in PREFETCHED_BY_LOOKUP else s, n) for t, s, n in segments
        ]

    hit_tiers = NODE_TIERS

    def store_after(self, keys: Sequence[bytes], conv: int, cached: int) -> None:
        self.gpu.admit(keys, conv)  # what it evicts was stored when it was computed
        if self.offload is not None and cached < len(keys):
            self.offload.store([(key, conv, i) for i, key in enumerate(keys[cached:], cached)])


@dataclass
class StoreMark:
    """Where and when a conversation's last turn stored its chunks."""

    node: int
    wall: float
    s3_written: int  # the node's S3 write-throughs (done or given up) that cover them


@dataclass
class Settling:
    waits: int = 0
    seconds: float = 0.0
    s3_timeouts: int = 0


class ClusterSim:
    """N NodeSims on one model clock; arrivals routed round robin."""

    def __init__(
        self,
        w: Workload,
        m: Model,
        conversations: int,
        offloads: Sequence[Offload | None],
        settle_s: float,
        s3_written: Callable[[int], int] | None = None,
        s3_base: Sequence[int] = (),
        kv: KvIndex | None = None,
    ) -> None:
        """s3_written: node -> its S3 tier's writes done or given up (with a shared bucket), which
        were `s3_base` before the run. kv: route each turn by that index (kvroute.py), not round robin."""
        self.kv = kv
        self.kv_routed = 0  # turns the index sent elsewhere than round robin would
        self.w, self.m, self.n = w, m, conversations
        self.nodes = [NodeSim(w, m, conversations, o) for o in offloads]
        self.lanes = [Lane() for _ in self.nodes]
        self.settle_s = settle_s
        self.s3_written = s3_written
        self.s3_target = dict(enumerate(s3_base))  # per node: writes its stores so far asked of S3
        self.marks: dict[int, StoreMark] = {}
        self.settling = Settling()
        self.records: list[TurnRecord] = []
        self.makespan = 0.0

    @property
    def starts(self) -> np.ndarray:
        return self.nodes[0].starts

    @property
    def thinks(self) -> np.ndarray:
        return self.nodes[0].thinks

    def route(self, conv: int, turn: int) -> int:
        rr = (conv + turn - 1) % len(self.nodes)
        reusable = self.w.reusable_chunks(turn) * self.w.chunk_tokens
        if self.kv is None or not reusable:
            return rr
        mark = self.marks.get(conv)
        if mark is not None:  # the previous turn's events get the think time to reach the router
            time.sleep(max(0.0, mark.wall + self.settle_s - time.perf_counter()))
        node = choose(self.kv.matched(token_ids(conv, 0, reusable)), rr)
        self.kv_routed += node != rr
        return node

    def settle(self, rec: TurnRecord) -> None:
        """Give the previous turn's stores what the think time gives them (see the module's doc)."""
        mark = self.marks.get(rec.conv)
        if mark is None or mark.node == rec.node:
            return
        t0 = time.perf_counter()
        if mark.wall + self.settle_s > t0:
            time.sleep(mark.wall + self.settle_s - t0)
        if self.s3_written is not None:
            deadline = time.perf_counter() + S3_SETTLE_BOUND_S
            while True:
                if self.s3_written(mark.node) >= mark.s3_written:
                    break
                if time.perf_counter() > deadline:  # e.g. a write-down found the object there: not counted
                    self.settling.s3_timeouts += 1
                    break
                time.sleep(0.005)
        waited = time.perf_counter() - t0
        if waited > 1e-4:
            self.settling.waits += 1
            self.settling.seconds += waited

    def serve(self, rec: TurnRecord) -> float:
        """The turn reaches its node's loader (NodeSim.serve_load), once the previous turn's
        stores have settled; then this turn's stores are marked."""
        node = self.nodes[rec.node]
        self.settle(rec)
        offload = node.offload
        stored = offload.store_counts["stored"] if offload is not None else 0
        load_s = node.serve_load(rec)
        if offload is not None:  # with write-through, each new chunk is one S3 write
            target = self.s3_target.get(rec.node, 0) + offload.store_counts["stored"] - stored
            self.s3_target[rec.node] = target
            self.marks[rec.conv] = StoreMark(rec.node, time.perf_counter(), target)
        return load_s

    def run(self) -> list[TurnRecord]:
        self.records, self.makespan = run_clock(
            self.w, self.m.serial_loads, self.starts, self.thinks, self.lanes, self.route, self.serve
        )
        return self.records
