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

from bench.multiturn.kvroute import KvIndex, choose, token_ids
from bench.multiturn.model import Config, Model, Workload
from bench.multiturn.offload import Offload
from bench.multiturn.sim import Lane, Segments, Simulation, TurnRecord, run_clock

NODE_TIERS = ("gpu", "ram", "fs", "peer", "s3")  # where a reusable chunk was found
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
        "--nodes N: N real daemons, one per modelled GPU node, each turn on the next node round-robin (no KV "
        "awareness). Compared: no offload, islands (each node RAM + fs, no peers), RAM + fs + peers, RAM + fs + "
        "one shared S3 bucket; hit rates per tier, PEER included",
    )
    directory = (
        "the fleet directory instead: a real Redis Cluster on loopback, daemons with no static peers; compared: "
    )
    directory += (
        f"no offload, islands, RAM + fs + directory, one node with the fleet's RAM + fs ({', '.join(DIRECTORY_KEYS)})"
    )
    g.add_argument("--directory", action="store_true", help=directory)
    g.add_argument("--nodes", type=int, default=1, help="modelled GPU nodes, each with its own daemon (1: one node)")
    transport = "the peer tier's data plane on loopback (tcp: the faster one here)"
    g.add_argument("--peer-transport", default="tcp", choices=("tcp", "ucx", "auto"), help=transport)
    route = (
        "kv: also route each turn by Dynamo's KV indexer (tests/vllm/install_dynamo.sh) and compare with round robin"
    )
    g.add_argument("--route", default="rr", choices=("rr", "kv"), help=route)
    settle = "wall seconds a turn's stores get to reach the other nodes before the next turn looks them up"
    g.add_argument("--settle-s", type=float, default=0.2, help=settle)


PEER_COUNTERS = (
    "fetches received_chunks received_bytes sent_bytes missing_chunks failed_chunks timed_out_chunks corrupt_chunks "
    "refused_by_breaker events resyncs"
).split()


def peer_counters(status: Any) -> dict[str, int]:
    """One node's view of its peers, summed over them, and what it served them."""
    out = {k: sum(int(getattr(p, k)) for p in status.peers) for k in PEER_COUNTERS}
    return out | {k: int(getattr(status, k)) for k in ("served_chunks", "served_bytes", "refused_chunks")}


PREFETCHED_BY_LOOKUP = ("fs", "peer")  # tiers whose lookup asks only an in-memory index, then starts the reads


class NodeSim(Simulation):
    """One node (multiturn's Simulation), storing what it computes when it computes it, not what its GPU
    evicts. A lookup starts reading fs and peer hits at once, so its time beyond `lookup_floor_s` (measured
    at the start) is moved to those tiers' load calls, charged x the byte scale; not with S3 under them
    (there a lookup is mostly HEAD requests). See docs/benchmarks.md (several nodes)."""

    lookup_floor_s = 0.0
    move_lookup_excess = True
    moved_s = 0.0  # lookup time charged to fs/peer load calls instead
    hit_tiers = NODE_TIERS

    def _segments(self, lookup_s: float, segments: Segments) -> tuple[float, Segments]:
        lower = sum(n for tier, _, n in segments if tier in PREFETCHED_BY_LOOKUP)
        excess = lookup_s - self.lookup_floor_s
        if not self.move_lookup_excess or not lower or excess <= 0:
            return lookup_s, list(segments)
        self.moved_s += excess
        return self.lookup_floor_s, [
            (t, s + excess * n / lower if t in PREFETCHED_BY_LOOKUP else s, n) for t, s, n in segments
        ]

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


class ClusterSim:
    """N NodeSims on one model clock; arrivals routed round robin, or with `kv` by that index (kvroute.py).
    s3_written: node -> its S3 tier's writes done or given up (with a shared bucket), `s3_target` before."""

    def __init__(self, w: Workload, m: Model, n: int, offloads: Sequence[Offload | None], settle_s: float) -> None:
        self.w, self.m, self.n, self.settle_s = w, m, n, settle_s
        self.nodes = [NodeSim(w, m, n, o) for o in offloads]
        self.lanes = [Lane() for _ in self.nodes]
        self.starts, self.thinks = self.nodes[0].starts, self.nodes[0].thinks
        self.kv: KvIndex | None = None
        self.kv_routed = 0  # turns the index sent elsewhere than round robin would
        self.s3_written: Callable[[int], int] | None = None
        self.s3_target: dict[int, int] = {}  # per node: writes its stores so far asked of S3
        self.marks: dict[int, StoreMark] = {}
        self.settling = {"waits": 0, "seconds": 0.0, "s3_timeouts": 0}
        self.records: list[TurnRecord] = []
        self.makespan = 0.0

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
        time.sleep(max(0.0, mark.wall + self.settle_s - t0))
        deadline = time.perf_counter() + S3_SETTLE_BOUND_S
        while self.s3_written is not None and self.s3_written(mark.node) < mark.s3_written:
            if time.perf_counter() > deadline:  # e.g. a write-down found the object there: not counted
                self.settling["s3_timeouts"] += 1
                break
            time.sleep(0.005)
        if (waited := time.perf_counter() - t0) > 1e-4:
            self.settling["waits"] += 1
            self.settling["seconds"] += waited

    def serve(self, rec: TurnRecord) -> float:
        """The turn reaches its node's loader (NodeSim.serve_load) once the previous turn's stores have
        settled; then this turn's stores are marked."""
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
