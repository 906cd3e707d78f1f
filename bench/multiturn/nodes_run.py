# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""One run of the nodes: a set-up at a number of conversations, on fresh daemons; its results, summed
over the nodes; the raw TCP limit beside the peer tier."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.lib.report import GIB
from bench.lib.s3 import S3
from bench.multiturn.kvroute import KvIndex, identity_for
from bench.multiturn.model import Model, Sizes, Workload
from bench.multiturn.nodes import NODE_TIERS, RAW_TCP_BYTES, ClusterSim, Nodes, NodesConfig, peer_counters
from bench.multiturn.offload import Offload
from bench.multiturn.runs import TierResources, TurnsResult, gib_s_of_costs, stats_delta, store_summary, timed

# -- one run: a set-up of the nodes at a number of conversations -----------------------------------


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
    # with the prefill rate registered (--register-rates): the hits the daemons' recompute gate
    # answered as misses (slower to load than to recompute), as a share of the reusable tokens per
    # tier, and the share found (hits + those): what the nodes could have loaded
    gate_skipped: dict[str, float] = field(default_factory=dict)
    found_rate: float = 0.0
    daemon_gib_s: dict[str, float] = field(default_factory=dict)  # the daemons' own load rate at the end (mean)


def summarize(
    config: str,
    sim: ClusterSim,
    before: Sequence[dict] | None,
    after: Sequence[dict] | None,
    peers: Sequence[dict[str, int]],
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
        costs: dict[str, list[float]] = {}
        for node in sim.nodes:
            for t, c in node.all_costs.items():
                costs.setdefault(t, []).extend(c)
        r.marginal_gib_s = gib_s_of_costs(costs)
        r.slow_gib_s = gib_s_of_costs(costs, lambda c: np.percentile(c, 90))
        lookups = [s for node in sim.nodes for s in node.lookup_s]
        r.lookups = len(lookups)
        r.lookup_ms_p50 = float(np.percentile(lookups, 50) * 1e3) if lookups else 0.0
        r.load_calls = sum(node.load_calls for node in sim.nodes)
        r.load_shortfall_chunks = sum(node.shortfall for node in sim.nodes)
        r.load_call_floor_ms = float(np.mean([o.call_floor_s for o in offloads]) * 1e3)
        r.lookup_floor_ms = float(np.mean([node.lookup_floor_s for node in sim.nodes]) * 1e3)
        r.lookup_moved_s = sum(node.moved_s for node in sim.nodes)
        counts = {k: sum(o.store_counts[k] for o in offloads) for k in ("stored", "already_present", "dropped")}
        r.store = store_summary(counts, sum(o.store_s for o in offloads), offloads[0].chunk_bytes)
        r.corrupt_chunks = sum(o.corrupt for o in offloads)
    for b, a in zip(before or (), after or ()):
        for name, vals in stats_delta(b, a).items():
            total = r.daemon.setdefault(name, {})
            for k, v in vals.items():
                total[k] = total.get(k, 0) + v
    for tier, d in r.daemon.items():
        if d.get("skipped_slow_hits") and r.reusable_tokens:
            r.gate_skipped[tier] = d["skipped_slow_hits"] * sim.w.chunk_tokens / r.reusable_tokens
        rates = [a[tier]["load_bytes_per_s"] for a in after or () if a.get(tier, {}).get("load_bytes_per_s")]
        if rates:  # (a rate is a state: the nodes' mean, not their sum)
            d["load_bytes_per_s"] = int(np.mean(rates))
            r.daemon_gib_s[tier] = float(np.mean(rates)) / GIB
    r.found_rate = r.hit_rate_overall + sum(r.gate_skipped.values())
    for p in peers:
        for k, v in p.items():
            r.peers[k] = r.peers.get(k, 0) + v
    r.settle = asdict(sim.settling)
    return r


def calibrate_lookup_floor(offload: Offload, keys: int = 10, calls: int = 40, held: bool = True) -> float:
    """A lookup of `keys` keys all in RAM (4 KiB chunks in a namespace of their own): what a
    lookup costs when it starts no reads. held=False: keys nobody holds, so that the floor has
    the fleet directory's round trip, a cost per lookup (charged as measured), not per byte."""
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


@timed
def run_one(
    config: NodesConfig,
    conversations: int,
    n: int,
    w: Workload,
    m: Model,
    sizes: Sizes,
    workdir: Path,
    s3: S3 | None,
    peer_transport: str,
    settle_s: float,
    route: str = "rr",
    directory: str = "",
) -> NodesRunResult:
    """directory: the fleet directory's URL, for set-ups that use it."""
    args = (config, conversations, n, w, m, sizes, workdir, s3, peer_transport, settle_s)
    if not config.offload or route == "rr":
        return _run_one(*args, None, directory)
    events = Path(tempfile.mkdtemp(prefix="kvmt-", dir="/tmp"))  # ipc paths must be short
    try:
        return _run_one(*args, events, directory)
    finally:
        shutil.rmtree(events, ignore_errors=True)


def _run_one(
    config: NodesConfig,
    conversations: int,
    n: int,
    w: Workload,
    m: Model,
    sizes: Sizes,
    workdir: Path,
    s3: S3 | None,
    peer_transport: str,
    settle_s: float,
    events: Path | None,
    directory: str,
) -> NodesRunResult:
    """events: a folder for the nodes' ZMQ endpoints, which Dynamo's index routes by; None: round robin."""
    if not config.offload:
        sim = ClusterSim(w, m, conversations, [None] * n, settle_s)
        sim.run()
        return summarize(config.key, sim, None, None, [])
    res = TierResources(workdir, f"{config.key.replace('+', '-')}-{conversations}", s3)
    try:
        endpoints = [f"ipc://{events}/node-{i}.sock" for i in range(n)] if events else []
        nodes = Nodes(config, n, sizes, res, peer_transport, endpoints, directory)
    except Exception as exc:  # noqa: BLE001 - a tier whose resources cannot be made: say so, go on
        res.close()
        return NodesRunResult(config.key, conversations, nodes=n, skipped=f"tier set-up failed: {exc}")
    try:
        nodes.start()
    except Exception as exc:  # noqa: BLE001 - nodes that did not come up: say so, go on
        res.close()
        why = f"nodes did not start: {exc}: {nodes.failure_log()}"
        return NodesRunResult(config.key, conversations, nodes=n, skipped=why)
    offloads: list[Offload] = []
    kv: KvIndex | None = None
    try:
        if events is not None:
            kv = KvIndex([f"ipc://{events}/node-{i}.sock" for i in range(n)], workdir / f"dynamo-{config.key}.log")
        chunk_bytes = w.chunk_tokens * m.kv_bytes_per_token
        for d in map(nodes.daemon_of, range(n)):
            offloads.append(
                Offload(
                    d.socket,
                    chunk_bytes,
                    w.chunk_tokens,
                    w.final_tokens // w.chunk_tokens,
                    w.seed,
                    m.transfer,
                    m.gate_prefill_tokens_per_s,  # 0 unless --register-rates: no recompute gate
                )
            )
            if kv is not None:
                offloads[-1].identity = identity_for(w.chunk_tokens, w.seed)
        daemons = len(nodes.daemons)  # (pooled: one, whose Stats count once)
        before = [o.stats() for o in offloads[:daemons]]
        written = (lambda i: s3_written(offloads[i].stats())) if config.uses("s3") else None
        sim = ClusterSim(w, m, conversations, offloads, settle_s, written, [s3_written(b) for b in before], kv)
        for node in sim.nodes:
            assert node.offload is not None
            node.lookup_floor_s = calibrate_lookup_floor(node.offload, held=not config.directory)
            node.move_lookup_excess = not config.uses("s3")
        sim.run()
        after = [o.stats() for o in offloads[:daemons]]
        peers = [peer_counters(nodes.peer_status(i)) for i in range(daemons)] if config.uses("peer") else []
        r = summarize(config.key, sim, before, after, peers)
        if kv is not None:
            r.route, r.kv_routed = "kv", sim.kv_routed
        return r
    finally:
        if kv is not None:
            kv.close()
        for o in offloads:
            o.close()
        nodes.close()
        res.close()


# -- physical limits: multiturn's, and a raw TCP socket on loopback --------------------------------


def measure_raw_tcp(chunk_bytes: int) -> tuple[list[float], str]:
    """One raw TCP transfer on loopback (bench/lib/raw_net.py: sendall from a populated mmap,
    recv_into 16 slots), GiB/s; a failure is a note."""
    try:
        from bench.lib.raw_net import Place, measure_raw

        return [measure_raw("tcp", Place("loopback"), RAW_TCP_BYTES, chunk_bytes, 16).gib_s], ""
    except Exception as exc:  # noqa: BLE001 - the tiers' figures stand without it
        return [], f"raw TCP: {type(exc).__name__}: {exc}"
