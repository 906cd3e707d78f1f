# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""One run of the nodes: a set-up at a number of conversations, on fresh daemons; its results, summed over them."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.lib.report import GIB
from bench.lib.s3 import S3
from bench.multiturn.kvroute import KvIndex, identity_for
from bench.multiturn.model import Config, Plan
from bench.multiturn.nodes import NODE_TIERS, ClusterSim, peer_counters
from bench.multiturn.offload import Offload
from bench.multiturn.runs import TurnsResult, gib_s_of_costs, started


@dataclass
class NodesRunResult(TurnsResult):
    nodes: int = 0
    per_node: list[dict[str, float]] = field(default_factory=list)
    slow_gib_s: dict[str, float] = field(default_factory=dict)  # the same at the slowest decile's edge (p90 cost)
    lookup_floor_ms: float = 0.0  # mean over the nodes: a lookup that starts no reads
    lookup_moved_s: float = 0.0  # lookup time charged to fs/peer load calls instead (see NodeSim)
    peers: dict[str, int] = field(default_factory=dict)  # Peer Status counters, summed over nodes
    settle: dict[str, float] = field(default_factory=dict)
    route: str = "rr"  # rr: round robin; kv: by Dynamo's index of the daemons' events (kvroute.py)
    kv_routed: int = 0  # turns the index sent elsewhere than round robin would
    # --register-rates: per tier, the hits the recompute gate answered as misses (share of reusable tokens),
    # and the share found (hits + those)
    gate_skipped: dict[str, float] = field(default_factory=dict)
    found_rate: float = 0.0
    daemon_gib_s: dict[str, float] = field(default_factory=dict)  # the daemons' own load rate at the end (mean)


def summarize(
    config: str, sim: ClusterSim, before: Sequence[dict], after: Sequence[dict], peers: list
) -> NodesRunResult:
    recs = sim.records
    r = NodesRunResult(config, sim.n, nodes=len(sim.nodes))
    offloads = [node.offload for node in sim.nodes if node.offload is not None]
    r.summarize_turns(sim.w, recs, sim, NODE_TIERS, offloads[0].chunk_bytes if offloads else None)
    for i, lane in enumerate(sim.lanes):
        mine = [x for x in recs if x.node == i]
        reusable = sum(x.reusable_chunks for x in mine)
        r.per_node.append(
            {
                "turns": len(mine),
                "gpu_busy": lane.gpu_s / sim.makespan,
                "loader_busy": lane.loader_s / sim.makespan,
                "hit_rate": sum(sum(x.hits.values()) for x in mine) / reusable if reusable else 0.0,
            }
        )
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
    for p in peers:
        for k, v in p.items():
            r.peers[k] = r.peers.get(k, 0) + v
    r.settle = dict(sim.settling)
    return r


def calibrate_lookup_floor(offload: Offload, keys: int = 10, calls: int = 40, held: bool = True) -> float:
    """A lookup of `keys` keys all in RAM (4 KiB chunks, a namespace of their own): one that starts no reads.
    held=False: keys nobody holds, so that the floor has the fleet directory's round trip (per lookup)."""
    from kvstored_client import NamespaceSpec

    client = offload.client
    ns = client.register_namespace(NamespaceSpec(model="bench/multiturn-lookup-floor", dtype="u8", chunk_bytes=4096))
    names = [bytes([2, i]) * 16 for i in range(keys)]
    if held:
        client.store(ns, names, np.ones(keys * 4096, dtype=np.uint8))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        if client.lookup(ns, names).prefix_hits != (keys if held else 0):
            raise RuntimeError("lookup-floor calibration: the chunks are not where they were put")
        times.append(time.perf_counter() - t0)
    if held:
        client.delete(ns, names)
    return float(np.median(times[calls // 4 :]))


def s3_written(stats: dict[str, dict[str, int]]) -> int:
    """The S3 tier's writes that are over: written, or dropped, refused or failed (each counted once)."""
    s3 = stats.get("s3", {})
    return sum(s3.get(k, 0) for k in ("stored_chunks", "dropped_backpressure", "errors", "rejected_full"))


def run_one(
    config: Config, count: int, p: Plan, s3: S3 | None, args: Any, route: str, directory: str
) -> NodesRunResult:
    """args.nodes nodes; route kv: each turn to the node Dynamo's index of the nodes' ZMQ events names (rr:
    round robin); directory: the fleet directory's URL, for set-ups that use it."""
    n, settle_s = args.nodes, args.settle_s
    w, m = p.w, p.m
    if not config.offload:
        sim = ClusterSim(w, m, count, [None] * n, settle_s)
        sim.run()
        return summarize(config.key, sim, [], [], [])
    with contextlib.ExitStack() as stack:
        endpoints: list[str] = []
        kv: KvIndex | None = None
        if route == "kv":
            events = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmt-", dir="/tmp"))  # short ipc paths
            endpoints = [f"ipc://{events}/node-{i}.sock" for i in range(n)]
        nodes = stack.enter_context(started(config, count, n, p, s3, args.peer_transport, endpoints, directory))
        if endpoints:
            kv = KvIndex(endpoints, p.workdir / f"dynamo-{config.key}.log")
            stack.callback(kv.close)
        offloads = [stack.enter_context(contextlib.closing(Offload(nodes.daemon_of(i).socket, w, m))) for i in range(n)]
        if kv is not None:  # the stores carry vLLM's block identity, which the router indexes
            for o in offloads:
                o.identity = identity_for(w.chunk_tokens, w.seed)
        daemons = len(nodes.daemons)  # (pooled: one, whose Stats count once)
        before = [o.stats() for o in offloads[:daemons]]
        sim = ClusterSim(w, m, count, offloads, settle_s)
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
