# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Several nodes (`--nodes N`): N real daemons, one per modelled GPU node, turns routed round-robin
(no KV-aware router: every turn lands on another node than the one before; --route kv: one); the set-ups compared
(no offload, islands, peers, one shared S3 bucket), the modelled cluster on one model clock, and one run:
a set-up at a number of conversations, on fresh daemons; its results, summed over them."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.report import GIB
from bench.lib.s3 import S3
from bench.multiturn.model import Config, Model, Plan, Workload
from bench.multiturn.offload import Offload, median_call_s
from bench.multiturn.runs import TurnsResult, gib_s_of_costs, started
from bench.multiturn.sim import Lane, Segments, Simulation, TurnRecord, run_clock
from tests.support.dynamo import DynamoIndexer, DynamoMissing

NODE_TIERS = ("gpu", "ram", "fs", "peer", "s3")  # where a reusable chunk was found
RAM_CONVERSATIONS = 64.0  # per node by default: three nodes' pools and radosgw's memstore fit a 24 GiB machine
S3_SETTLE_BOUND_S = 3.0  # the longest wait for a node's S3 write-throughs before a lookup elsewhere
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
        "the fleet directory instead: a real Redis Cluster on loopback, daemons with no static peers; compared: no "
        f"offload, islands, RAM + fs + directory, one node with the fleet's RAM + fs ({', '.join(DIRECTORY_KEYS)})"
    )
    g.add_argument("--directory", action="store_true", help=directory)
    g.add_argument("--nodes", type=int, default=1, help="modelled GPU nodes, each with its own daemon (1: one node)")
    transport = "the peer tier's data plane on loopback (tcp: the faster one here)"
    g.add_argument("--peer-transport", default="tcp", choices=("tcp", "ucx", "auto"), help=transport)
    route = "kv: also route each turn by Dynamo's KV indexer (tests/vllm/install_dynamo.sh), compared with round robin"
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


# KV-aware routing (--route kv): each turn goes to the node that Dynamo 1.6.1's standalone indexer
# (tests/vllm/install_dynamo.sh), fed by the daemons' ZMQ events, says holds the longest prefix of the
# conversation; ties, and a prompt no node holds, fall back to round robin. Every stored chunk carries
# vLLM's block identity (kvstored_client.blocks), so that the daemons publish what a router indexes.
BLOCK_SIZE = 16  # the modelled engine's tokens per block (vLLM's default)


def token_ids(conv: int, start: int, count: int) -> list[int]:
    """The conversation's tokens at positions [start, start + count): unique to the conversation."""
    return [conv * (1 << 20) + p for p in range(start, start + count)]


def block_id(seed: int, conv: int, block: int) -> int:
    """The engine's id for one block (vLLM's hash, as an int): what parents and removals name."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{conv}:{block}".encode(), digest_size=8).digest(), "big")


def identity_for(chunk_tokens: int, seed: int) -> Callable[[int, int], object]:
    """(conversation, chunk index) -> the chunk's BlockIdentity."""
    from kvstored_client.blocks import BlockIdentity

    per_chunk = chunk_tokens // BLOCK_SIZE

    def identity(conv: int, index: int) -> BlockIdentity:
        first = index * per_chunk
        return BlockIdentity(
            tuple(block_id(seed, conv, b) for b in range(first, first + per_chunk)),
            block_id(seed, conv, first - 1) if first else None,
            tuple(token_ids(conv, first * BLOCK_SIZE, chunk_tokens)),
            BLOCK_SIZE,
        )

    return identity


def kv_index(endpoints: Sequence[str], log: Path) -> DynamoIndexer:
    """Dynamo's standalone indexer subscribed to every node's stream (worker id = node index)."""
    try:
        return DynamoIndexer(dict(enumerate(endpoints)), BLOCK_SIZE, log)
    except DynamoMissing as exc:
        raise RuntimeError(f"--route kv needs {exc}") from None


def choose(scores: dict[int, dict[str, int]], fallback: int) -> int:
    """The node whose daemon holds the longest prefix (any tier), per the index's scores; the round-robin
    node on a tie with it or when none holds any."""
    matched = {node: int(row.get("longest_matched", 0)) for node, row in scores.items()}
    best = max(matched.values(), default=0)
    return (
        fallback if best == 0 or matched.get(fallback, 0) == best else min(i for i, v in matched.items() if v == best)
    )


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
    """N NodeSims on one model clock; arrivals routed round robin, or with `kv` by that index.
    s3_written: node -> its S3 tier's writes done or given up (with a shared bucket), `s3_target` before."""

    def __init__(self, w: Workload, m: Model, n: int, offloads: Sequence[Offload | None], settle_s: float) -> None:
        self.w, self.m, self.n, self.settle_s = w, m, n, settle_s
        self.nodes = [NodeSim(w, m, n, o) for o in offloads]
        self.lanes = [Lane() for _ in self.nodes]
        self.starts, self.thinks = self.nodes[0].starts, self.nodes[0].thinks
        self.kv: DynamoIndexer | None = None
        self.kv_routed = 0  # turns the index sent elsewhere than round robin would
        self.s3_written: Callable[[int], int] | None = None
        self.s3_target: dict[int, int] = {}  # per node: writes its stores so far asked of S3
        self.marks: dict[int, StoreMark] = {}
        self.settling = {"waits": 0, "seconds": 0.0, "s3_timeouts": 0}

    def route(self, conv: int, turn: int) -> int:
        rr = (conv + turn - 1) % len(self.nodes)
        reusable = self.w.reusable_chunks(turn) * self.w.chunk_tokens
        if self.kv is None or not reusable:
            return rr
        mark = self.marks.get(conv)
        if mark is not None:  # the previous turn's events get the think time to reach the router
            time.sleep(max(0.0, mark.wall + self.settle_s - time.perf_counter()))
        node = choose(self.kv.scores(token_ids(conv, 0, reusable)), rr)
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

    def run(self) -> None:
        self.records, self.makespan = run_clock(
            self.w, self.m.serial_loads, self.starts, self.thinks, self.lanes, self.route, self.serve
        )


@dataclass
class NodesRunResult(TurnsResult):
    nodes: int = 0
    per_node: list[dict[str, float]] = field(default_factory=list)
    slow_gib_s: dict[str, float] = field(default_factory=dict)  # the same at the slowest decile's edge (p90 cost)
    lookup_floor_ms: float = 0.0  # mean over the nodes: a lookup that starts no reads
    lookup_moved_s: float = 0.0  # lookup time charged to fs/peer load calls instead (see NodeSim)
    peers: dict[str, int] = field(default_factory=dict)  # Peer Status counters, summed over nodes
    settle: dict[str, float] = field(default_factory=dict)
    route: str = "rr"  # rr: round robin; kv: by Dynamo's index of the daemons' events
    kv_routed: int = 0  # turns the index sent elsewhere than round robin would
    # --register-rates: per tier, the hits the recompute gate answered as misses (share of reusable tokens),
    # and the share found (hits + those)
    gate_skipped: dict[str, float] = field(default_factory=dict)
    found_rate: float = 0.0
    daemon_gib_s: dict[str, float] = field(default_factory=dict)  # the daemons' own load rate at the end (mean)

    def progress(self) -> str:
        hit, tokens_s = f"hit {100 * self.hit_rate_overall:.1f}%", f"{self.throughput_tokens_s:,.0f} tokens/s"
        if self.route == "kv":
            return f"KV-routed: {hit}  {tokens_s}"
        skipped = sum(self.gate_skipped.values())
        gated = f"; {100 * skipped:.1f}% skipped as slower than recomputing" if skipped else ""
        return f"{hit} (peer {100 * self.hit_rate['peer']:.1f}%{gated})  {tokens_s}  {super().progress()}"


def summarize(key: str, sim: ClusterSim, before: Sequence[dict], after: Sequence[dict], peers: list) -> NodesRunResult:
    r = NodesRunResult(key, sim.n, nodes=len(sim.nodes))
    offloads = [node.offload for node in sim.nodes if node.offload is not None]
    r.summarize_turns(sim, NODE_TIERS, offloads[0].chunk_bytes if offloads else None)
    for i, lane in enumerate(sim.lanes):
        mine = [x for x in sim.records if x.node == i]
        hit_rate = sum(sum(x.hits.values()) for x in mine) / max(sum(x.reusable_chunks for x in mine), 1)
        busy = {"gpu_busy": lane.gpu_s / sim.makespan, "loader_busy": lane.loader_s / sim.makespan}
        r.per_node.append({"turns": len(mine), **busy, "hit_rate": hit_rate})
    r.gpu_busy = float(np.mean([p["gpu_busy"] for p in r.per_node]))
    r.loader_busy = float(np.mean([p["loader_busy"] for p in r.per_node]))
    if offloads:
        costs = r.summarize_offloads(sim.nodes, offloads, before, after)
        r.slow_gib_s = gib_s_of_costs(costs, lambda c: np.percentile(c, 90))
        r.lookup_floor_ms = float(np.mean([node.lookup_floor_s for node in sim.nodes]) * 1e3)
        r.lookup_moved_s = sum(node.moved_s for node in sim.nodes)
    for tier, d in r.daemon.items():
        if d.get("skipped_slow_hits") and r.reusable_tokens:
            r.gate_skipped[tier] = d["skipped_slow_hits"] * sim.w.chunk_tokens / r.reusable_tokens
        rates = [a[tier]["load_bytes_per_s"] for a in after if a.get(tier, {}).get("load_bytes_per_s")]
        if rates:  # (a rate is a state: the nodes' mean, not their sum)
            d["load_bytes_per_s"] = int(np.mean(rates))
            r.daemon_gib_s[tier] = float(np.mean(rates)) / GIB
    r.found_rate = r.hit_rate_overall + sum(r.gate_skipped.values())
    r.peers = {k: sum(p[k] for p in peers) for k in peers[0]} if peers else {}
    r.settle = dict(sim.settling)
    return r


def calibrate_lookup_floor(offload: Offload, keys: int = 10, held: bool = True) -> float:
    """A lookup of `keys` keys all in RAM (4 KiB chunks, a namespace of their own): one that starts no reads.
    held=False: keys nobody holds, so that the floor has the fleet directory's round trip (per lookup)."""
    from kvstored_client import NamespaceSpec

    client = offload.client
    ns = client.register_namespace(NamespaceSpec(model="bench/multiturn-lookup-floor", dtype="u8", chunk_bytes=4096))
    names = [bytes([2, i]) * 16 for i in range(keys)]
    if held:
        client.store(ns, names, np.ones(keys * 4096, dtype=np.uint8))
    floor = median_call_s(lambda: client.lookup(ns, names).prefix_hits, keys if held else 0, "lookup-floor calibration")
    if held:
        client.delete(ns, names)
    return floor


def s3_written(stats: dict[str, dict[str, int]]) -> int:
    """The S3 tier's writes that are over: written, or dropped, refused or failed (each counted once)."""
    s3 = stats.get("s3", {})
    return sum(s3.get(k, 0) for k in ("stored_chunks", "dropped_backpressure", "errors", "rejected_full"))


def run_one(
    config: Config, count: int, p: Plan, s3: S3 | None, args: Any, route: str, directory: str
) -> NodesRunResult:
    """args.nodes nodes; route kv: each turn to the node Dynamo's index of the nodes' ZMQ events names (rr:
    round robin); directory: the fleet directory's URL, for set-ups that use it."""
    n, w, m = args.nodes, p.w, p.m
    if not config.offload:
        sim = ClusterSim(w, m, count, [None] * n, args.settle_s)
        sim.run()
        return summarize(config.key, sim, [], [], [])
    with contextlib.ExitStack() as stack:
        endpoints: list[str] = []
        kv: DynamoIndexer | None = None
        if route == "kv":
            events = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmt-", dir="/tmp"))  # short ipc paths
            endpoints = [f"ipc://{events}/node-{i}.sock" for i in range(n)]
        nodes = stack.enter_context(started(config, count, n, p, s3, args.peer_transport, endpoints, directory))
        if endpoints:
            kv = kv_index(endpoints, p.workdir / f"dynamo-{config.key}.log")
            stack.callback(kv.stop)
        offloads = [stack.enter_context(contextlib.closing(Offload(nodes.daemon_of(i).socket, w, m))) for i in range(n)]
        if kv is not None:  # the stores carry vLLM's block identity, which the router indexes
            for o in offloads:
                o.identity = identity_for(w.chunk_tokens, w.seed)
        daemons = len(nodes.daemons)  # (pooled: one, whose Stats count once)
        before = [o.stats() for o in offloads[:daemons]]
        sim = ClusterSim(w, m, count, offloads, args.settle_s)
        sim.kv, sim.s3_target = kv, dict(enumerate(s3_written(b) for b in before))
        if config.uses("s3"):
            sim.s3_written = lambda i: s3_written(offloads[i].stats())
        for node in sim.nodes:
            assert node.offload is not None
            node.lookup_floor_s = calibrate_lookup_floor(node.offload, held=not config.directory)
            node.move_lookup_excess = not config.uses("s3")
        sim.run()
        after = [o.stats() for o in offloads[:daemons]]
        peers = [peer_counters(nodes.daemons[i].peer_status()) for i in range(daemons)] if config.uses("peer") else []
        r = summarize(config.key, sim, before, after, peers)
        if kv is not None:
            r.route, r.kv_routed = "kv", sim.kv_routed
        return r
