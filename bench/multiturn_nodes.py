"""Multi-node mode of bench/multiturn.py (`--nodes N`, N >= 2; not a test): the same multi-turn
agent workload, on N real daemons (one per modelled GPU node) whose engines share no KV-aware
router. Turn t of conversation c goes to node (c + t - 1) mod N: every turn lands on another node
than the one before (round robin, the worst a router can do for reuse).

Set-ups compared on the same N nodes (one fresh set of daemons, fs directories and bucket per
set-up and conversation count):
- no offload: each node's modelled GPU prefix cache only;
- islands (ram+fs): each node RAM + fs, no peers: a node finds only what it computed or loaded
  itself, N turns ago;
- peers (ram+fs+peer): each node RAM + fs + the peer tier, the peers being the other nodes'
  daemons on loopback (TCP data plane by default, `--peer-transport`): a node fetches what the
  previous turn's node holds in its RAM or on its fs;
- shared S3 (ram+fs+s3): each node RAM + fs + S3, every node on one bucket of a real radosgw
  (bench/multiturn.py's S3Server), with `write_policy = "write-through"` so a chunk reaches the
  bucket when it is stored, not only when RAM evicts it.

Measured (real daemons, real bytes, as in the single-node bench): every lookup and its tier per
key (the hit rates per tier, PEER included), every load call's time, the stores, each daemon's
Stats and Peer Status counters, and the physical limits (memcpy, raw O_DIRECT, raw GET, a raw TCP
socket on loopback through bench/peer_raw.py). Modelled: each node's GPU (prefix cache, prefill
rate) and its loader, hence the throughput and the time to first token; the cost per byte each
tier is charged is the running median of that node's own load calls (multiturn's Simulation).

Stores: each node stores the chunks it computes, when it computes them (vLLM's offloading
connector offloads every new full block; the single-node bench stores on GPU eviction, which
here would keep a conversation's newest chunks off the other nodes until evicted). The model
clock runs far ahead of the wall clock, so before a node looks up a conversation's chunks, the
background work the previous turn started is given time a 20 s think time would give it: at
least `--settle-s` of wall time since that turn's store, and (shared S3) until the previous node's
S3 tier has written what it stored. The waits are counted and printed; they are not charged.
A lookup starts reading its hits below RAM at once; for fs and peer hits, the lookup's time beyond
a calibrated lookup of RAM-resident keys is charged with those reads, x the byte scale (NodeSim).

Sizes are per node: RAM 64 conversations by default (three nodes' pools and radosgw's memstore
fit a 24 GiB machine), fs 512 (128 under S3), the GPU as modelled.
"""

from __future__ import annotations

import argparse
import heapq
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import multiturn as mt
import numpy as np
from _common import GIB, MIB, Row, load_average, machine_info, print_aligned, write_json

NODE_TIERS = ("gpu", "ram", "fs", "peer", "s3")  # where a reusable chunk was found
LOADED_TIERS = NODE_TIERS[1:]
TARGET_VS_ISLANDS = 1.3  # peers vs the same nodes without peers, at the largest count
TARGET_HIT = mt.TARGET_HIT  # peers: overall hit rate of reusable tokens, at the largest count
RAM_CONVERSATIONS = 64.0  # per node by default: three nodes' pools and radosgw's memstore fit a 24 GiB machine
S3_SETTLE_BOUND_S = 3.0  # the longest wait for a node's S3 write-throughs before a lookup elsewhere
PEERS_UP_S = 60.0  # a bound for the nodes to see each other, never a measurement
RAW_TCP_BYTES = 256 * MIB
ROUTING = "round robin: turn t of conversation c on node (c + t - 1) mod N (no KV awareness)"


@dataclass(frozen=True)
class NodesConfig(mt.Config):
    """A set-up of every node. `lower`: the tiers under each node's RAM, in chain order, with the
    Sizes field that bounds each ("" for the peer tier, which holds nothing itself)."""

    write_through: bool = False  # copy every stored chunk down at once (a shared bucket sees it)


CONFIGS = (
    NodesConfig("none", "no offload", offload=False),
    NodesConfig("ram+fs", "islands: RAM + fs", (("fs", "fs_bytes"),)),
    NodesConfig("ram+fs+peer", "RAM + fs + peers", (("fs", "fs_bytes"), ("peer", ""))),
    NodesConfig("ram+fs+s3", "RAM + fs + shared S3", (("fs", "s3_fs_bytes"), ("s3", "s3_bytes")), write_through=True),
)
CONFIG_BY_KEY = {c.key: c for c in CONFIGS}
CONFIG_KEYS = tuple(CONFIG_BY_KEY)
LABELS = {c.key: c.label for c in CONFIGS}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group(
        "several nodes (bench/multiturn_nodes.py)",
        "--nodes N runs N real daemons, one per modelled GPU node; each turn of a conversation goes to the next node "
        "round-robin (no KV awareness). Compared: no offload, islands (each node RAM + fs, no peers), RAM + fs + "
        "peers (the other nodes' daemons), RAM + fs + one shared S3 bucket; hit rates per tier, PEER included")
    g.add_argument("--nodes", type=int, default=1, help="modelled GPU nodes, each with its own daemon (1: one node)")
    g.add_argument("--peer-transport", default="tcp", choices=("tcp", "ucx", "auto"),
                   help="the peer tier's data plane on loopback (tcp: the faster one on these machines)")
    g.add_argument("--settle-s", type=float, default=0.2,
                   help="wall seconds a turn's stores get to reach the other nodes (peer index, shared bucket) "
                        "before the conversation's next turn looks them up: the model clock's think time")


# -- the nodes: real daemons, each with its tiers -------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """N daemons of one set-up: their tiers, listeners and a client each. close() stops them all."""

    def __init__(self, config: NodesConfig, n: int, sizes: mt.Sizes, res: mt.TierResources, peer_transport: str
                 ) -> None:
        self.config = config
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)] if config.uses("peer") else []
        shared_s3 = mt.TIER_SPECS["s3"](res, sizes.s3_bytes) if config.uses("s3") else ""  # one bucket for all
        self.daemons: list[mt.BenchDaemon] = []
        for i in range(n):
            args = ["--metrics-addr", "off"]
            if config.write_through:
                args += ["--write-policy", "write-through"]
            if self.addresses:
                args += ["--tcp-listen", self.addresses[i]]
            for kind, size_field in config.lower:
                if kind == "s3":
                    args += ["--tiers", shared_s3]
                elif kind == "peer":
                    # reconnect_s: the nodes start one after another and find each other sooner
                    args += ["--tiers", f"kind=peer,transport={peer_transport},peers={' '.join(self.addresses)},"
                                        "tcp_port=0,ucx_port=0,ucx_net_devices=lo,reconnect_s=1"]
                else:
                    args += ["--tiers", mt.TIER_SPECS[kind](res, getattr(sizes, size_field))]
            self.daemons.append(mt.BenchDaemon(sizes.ram_bytes, extra_args=args))

    def start(self) -> None:
        try:
            for d in self.daemons:
                d.start()
            if self.addresses:
                self._wait_peers_up()
        except BaseException:
            self.close()
            raise

    def _wait_peers_up(self) -> None:
        deadline = time.monotonic() + PEERS_UP_S
        pending = list(range(len(self.daemons)))
        while pending:
            pending = [i for i in pending if not self._sees_all_up(i)]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"nodes {pending} did not see every peer up within {PEERS_UP_S:.0f} s: "
                                   + "; ".join(str(self.peer_status(i)).replace("\n", " ") for i in pending))
            time.sleep(0.05)

    def _sees_all_up(self, i: int) -> bool:
        from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

        others = set(self.addresses) - {self.addresses[i]}
        return others <= {p.address for p in self.peer_status(i).peers if p.state == pb.PEER_STATE_UP}

    def peer_status(self, i: int) -> Any:
        import grpc

        from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
        from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

        with grpc.insecure_channel(f"unix:{self.daemons[i].socket}") as channel:
            return pb_grpc.PeerStub(channel).Status(pb.PeerStatusRequest(), timeout=10)

    def failure_log(self) -> str:
        return " | ".join(f"node {i}: {d.failure_log or d.log_tail(4)}" for i, d in enumerate(self.daemons))

    def close(self) -> None:
        for d in self.daemons:
            d.stop()


PEER_COUNTERS = ("fetches", "received_chunks", "received_bytes", "sent_bytes", "missing_chunks", "failed_chunks",
                 "timed_out_chunks", "corrupt_chunks", "refused_by_breaker", "events", "resyncs")


def peer_counters(status: Any) -> dict[str, int]:
    """One node's view of its peers, summed over them, and what it served them."""
    out = {k: sum(int(getattr(p, k)) for p in status.peers) for k in PEER_COUNTERS}
    out.update(served_chunks=int(status.served_chunks), served_bytes=int(status.served_bytes),
               refused_chunks=int(status.refused_chunks))
    return out


# -- the modelled cluster -------------------------------------------------------------------------


@dataclass
class NodeTurn(mt.TurnRecord):
    node: int = 0


PREFETCHED_BY_LOOKUP = ("fs", "peer")  # tiers whose lookup asks only an in-memory index, then starts the reads


class NodeSim(mt.Simulation):
    """One node: its GPU cache, its daemon, its loader's cost windows (multiturn's Simulation),
    storing what it computes when it computes it instead of what its GPU evicts.

    A lookup starts reading the hits below RAM at once (the daemon's prefetch), so part of their
    transfer happens while the lookup is measured, which the model would charge once instead of
    x the byte scale. For the fs and peer tiers, whose lookup itself is an index look-up, a
    lookup's time beyond `lookup_floor_s` (a lookup of RAM-resident keys, measured at the start)
    is therefore moved to those tiers' load calls (by chunks) before they are charged. Not with an
    S3 tier under them: there a lookup's own time is mostly its HEAD requests, charged as measured
    (so the shared-bucket set-up keeps that bias, in its favour)."""

    lookup_floor_s = 0.0
    move_lookup_excess = True
    moved_s = 0.0  # lookup time charged to fs/peer load calls instead

    def _segments(self, lookup_s: float, segments: Sequence[tuple[str, float, int]]
                  ) -> tuple[float, list[tuple[str, float, int]]]:
        lower = sum(n for tier, _, n in segments if tier in PREFETCHED_BY_LOOKUP)
        excess = lookup_s - self.lookup_floor_s
        if not self.move_lookup_excess or not lower or excess <= 0:
            return lookup_s, list(segments)
        self.moved_s += excess
        return self.lookup_floor_s, [(t, s + excess * n / lower if t in PREFETCHED_BY_LOOKUP else s, n)
                                     for t, s, n in segments]

    hit_tiers = NODE_TIERS

    def store_after(self, keys: Sequence[bytes], conv: int, cached: int) -> None:
        self.gpu.admit(keys, conv)  # what it evicts was stored when it was computed
        if self.offload is not None and cached < len(keys):
            self.offload.store([(key, conv, i) for i, key in enumerate(keys[cached:], cached)])


@dataclass
class Lane:
    """One node's loader and GPU: first come, first served each."""

    loader_q: list[NodeTurn] = field(default_factory=list)
    gpu_q: list[NodeTurn] = field(default_factory=list)
    loader_busy: bool = False
    gpu_busy: bool = False
    loader_s: float = 0.0
    gpu_s: float = 0.0


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

    def __init__(self, w: mt.Workload, m: mt.Model, conversations: int, offloads: Sequence[mt.Offload | None],
                 settle_s: float, s3_written: Callable[[int], int] | None = None, s3_base: Sequence[int] = ()
                 ) -> None:
        """s3_written: node -> its S3 tier's writes done or given up (with a shared bucket), which
        were `s3_base` before the run."""
        self.w, self.m, self.n = w, m, conversations
        self.nodes = [NodeSim(w, m, conversations, o) for o in offloads]
        self.lanes = [Lane() for _ in self.nodes]
        self.settle_s = settle_s
        self.s3_written = s3_written
        self.s3_target = dict(enumerate(s3_base))  # per node: writes its stores so far asked of S3
        self.marks: dict[int, StoreMark] = {}
        self.settling = Settling()
        self.records: list[NodeTurn] = []
        self.makespan = 0.0

    @property
    def starts(self) -> np.ndarray:
        return self.nodes[0].starts

    @property
    def thinks(self) -> np.ndarray:
        return self.nodes[0].thinks

    def route(self, conv: int, turn: int) -> int:
        return (conv + turn - 1) % len(self.nodes)

    def settle(self, rec: NodeTurn) -> None:
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

    def serve(self, rec: NodeTurn) -> float:
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

    def run(self) -> list[NodeTurn]:
        events: list[tuple[float, int, str, Any]] = []
        seq = 0
        now = 0.0

        def push(t: float, kind: str, payload: Any) -> None:
            nonlocal seq
            heapq.heappush(events, (t, seq, kind, payload))
            seq += 1

        def start_loader(lane: Lane) -> None:
            if lane.loader_busy or not lane.loader_q:
                return
            rec = lane.loader_q.pop(0)
            load_s = self.serve(rec)
            lane.loader_busy = True
            lane.loader_s += load_s
            push(now + load_s, "loaded", rec)

        def start_gpu(lane: Lane) -> None:
            if lane.gpu_busy or not lane.gpu_q:
                return
            rec = lane.gpu_q.pop(0)
            service = rec.prefill_s
            if self.m.serial_loads:
                service = self.serve(rec) + rec.prefill_s
            lane.gpu_busy = True
            lane.gpu_s += service
            push(now + service, "computed", rec)

        for conv in range(self.n):
            push(float(self.starts[conv]), "arrive", (conv, 1))
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if kind == "arrive":
                conv, turn = payload
                rec = NodeTurn(conv, turn, now, self.w.prompt_tokens(turn), self.w.reusable_chunks(turn), {},
                               node=self.route(conv, turn))
                lane = self.lanes[rec.node]
                if self.m.serial_loads:
                    lane.gpu_q.append(rec)
                    start_gpu(lane)
                else:
                    lane.loader_q.append(rec)
                    start_loader(lane)
            elif kind == "loaded":
                lane = self.lanes[payload.node]
                lane.loader_busy = False
                lane.gpu_q.append(payload)
                start_loader(lane)
                start_gpu(lane)
            else:  # computed
                rec = payload
                lane = self.lanes[rec.node]
                lane.gpu_busy = False
                rec.done = now
                self.records.append(rec)
                if rec.turn < self.w.turns:
                    push(now + float(self.thinks[rec.conv, rec.turn]), "arrive", (rec.conv, rec.turn + 1))
                start_gpu(lane)
                start_loader(lane)
        self.makespan = now
        return self.records


# -- one run: a set-up of the nodes at a number of conversations -----------------------------------


@dataclass
class NodesRunResult:
    config: str
    conversations: int
    nodes: int
    turns: int = 0
    prompt_tokens: int = 0
    reusable_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    hit_rate: dict[str, float] = field(default_factory=dict)  # share of reusable tokens, per tier (measured)
    hit_rate_overall: float = 0.0
    throughput_tokens_s: float = 0.0  # modelled: all nodes' prompt tokens / the makespan
    makespan_s: float = 0.0
    think_floor_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    gpu_busy: float = 0.0  # mean over the nodes, share of the makespan (modelled)
    loader_busy: float = 0.0
    per_node: list[dict[str, float]] = field(default_factory=list)
    loaded_bytes: dict[str, int] = field(default_factory=dict)  # scaled bytes really loaded, per tier
    load_seconds: dict[str, float] = field(default_factory=dict)  # measured
    load_gib_s: dict[str, float] = field(default_factory=dict)  # measured, all-in
    marginal_gib_s: dict[str, float] = field(default_factory=dict)  # median per-byte cost, call floor removed
    slow_gib_s: dict[str, float] = field(default_factory=dict)  # the same at the slowest decile's edge (p90 cost)
    lookup_ms_p50: float = 0.0
    lookups: int = 0
    load_calls: int = 0
    load_call_floor_ms: float = 0.0  # mean over the nodes
    lookup_floor_ms: float = 0.0  # mean over the nodes: a lookup that starts no reads
    lookup_moved_s: float = 0.0  # lookup time charged to fs/peer load calls instead (see NodeSim)
    load_shortfall_chunks: int = 0
    store: dict[str, Any] = field(default_factory=dict)
    daemon: dict[str, dict[str, int]] = field(default_factory=dict)  # Stats deltas per tier, summed over nodes
    peers: dict[str, int] = field(default_factory=dict)  # Peer Status counters, summed over nodes
    settle: dict[str, float] = field(default_factory=dict)
    corrupt_chunks: int = 0
    wall_s: float = 0.0
    load_average: tuple[float, float] = (0.0, 0.0)
    skipped: str = ""


def summarize(config: str, sim: ClusterSim, before: Sequence[dict] | None, after: Sequence[dict] | None,
              peers: Sequence[dict[str, int]]) -> NodesRunResult:
    w, recs = sim.w, sim.records
    r = NodesRunResult(config, sim.n, len(sim.nodes))
    r.turns = len(recs)
    r.prompt_tokens = sum(x.prompt_tokens for x in recs)
    r.reusable_tokens = sum(x.reusable_chunks for x in recs) * w.chunk_tokens
    r.hit_tokens = {t: sum(x.hits.get(t, 0) for x in recs) * w.chunk_tokens for t in NODE_TIERS}
    r.hit_rate = {t: v / r.reusable_tokens if r.reusable_tokens else 0.0 for t, v in r.hit_tokens.items()}
    r.hit_rate_overall = sum(r.hit_rate.values())
    r.makespan_s = sim.makespan
    r.throughput_tokens_s = r.prompt_tokens / sim.makespan
    r.think_floor_s = float(np.max(sim.starts + sim.thinks[:, 1:].sum(axis=1)))
    ttft = np.array([x.done - x.arrive for x in recs])
    r.ttft_p50_s, r.ttft_p99_s = float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99))
    for i, lane in enumerate(sim.lanes):
        mine = [x for x in recs if x.node == i]
        reusable = sum(x.reusable_chunks for x in mine)
        r.per_node.append({"turns": len(mine), "gpu_busy": lane.gpu_s / sim.makespan,
                           "loader_busy": lane.loader_s / sim.makespan,
                           "hit_rate": sum(sum(x.hits.values()) for x in mine) / reusable if reusable else 0.0})
    r.gpu_busy = float(np.mean([p["gpu_busy"] for p in r.per_node]))
    r.loader_busy = float(np.mean([p["loader_busy"] for p in r.per_node]))
    offloads = [node.offload for node in sim.nodes if node.offload is not None]
    if offloads:
        cb = offloads[0].chunk_bytes
        secs: dict[str, float] = {}
        for x in recs:
            for t, s in x.load_seconds.items():
                secs[t] = secs.get(t, 0.0) + s
        r.loaded_bytes = {t: r.hit_tokens[t] // w.chunk_tokens * cb for t in LOADED_TIERS}
        r.load_seconds = {t: secs.get(t, 0.0) for t in LOADED_TIERS}
        r.load_gib_s = {t: r.loaded_bytes[t] / GIB / r.load_seconds[t] for t in LOADED_TIERS
                        if r.load_seconds[t] > 0 and r.loaded_bytes[t] > 0}
        costs: dict[str, list[float]] = {}
        for node in sim.nodes:
            for t, c in node.all_costs.items():
                costs.setdefault(t, []).extend(c)
        r.marginal_gib_s = {t: 1 / float(np.median(c)) / GIB for t, c in costs.items() if c and np.median(c) > 0}
        r.slow_gib_s = {t: 1 / float(np.percentile(c, 90)) / GIB for t, c in costs.items()
                        if c and np.percentile(c, 90) > 0}
        lookups = [s for node in sim.nodes for s in node.lookup_s]
        r.lookups = len(lookups)
        r.lookup_ms_p50 = float(np.percentile(lookups, 50) * 1e3) if lookups else 0.0
        r.load_calls = sum(node.load_calls for node in sim.nodes)
        r.load_shortfall_chunks = sum(node.shortfall for node in sim.nodes)
        r.load_call_floor_ms = float(np.mean([o.call_floor_s for o in offloads]) * 1e3)
        r.lookup_floor_ms = float(np.mean([node.lookup_floor_s for node in sim.nodes]) * 1e3)
        r.lookup_moved_s = sum(node.moved_s for node in sim.nodes)
        counts = {k: sum(o.store_counts[k] for o in offloads) for k in ("stored", "already_present", "dropped")}
        seconds = sum(o.store_s for o in offloads)
        r.store = {**counts, "seconds": seconds, "gib_s": counts["stored"] * cb / GIB / seconds if seconds else 0.0}
        r.corrupt_chunks = sum(o.corrupt for o in offloads)
    if before is not None and after is not None:
        for b, a in zip(before, after):
            for name, vals in a.items():
                mine = r.daemon.setdefault(name, {})
                for k, v in vals.items():
                    delta = v if k in ("used_bytes", "chunks") else v - b.get(name, {}).get(k, 0)
                    mine[k] = mine.get(k, 0) + delta
    for p in peers:
        for k, v in p.items():
            r.peers[k] = r.peers.get(k, 0) + v
    r.settle = asdict(sim.settling)
    return r


def calibrate_lookup_floor(offload: mt.Offload, keys: int = 10, calls: int = 40) -> float:
    """A lookup of `keys` keys all in RAM (4 KiB chunks in a namespace of their own): what a
    lookup costs when it starts no reads."""
    from kvstored_client import NamespaceSpec

    client = offload.client
    ns = client.register_namespace(NamespaceSpec(model="bench/multiturn-lookup-floor", dtype="u8", chunk_bytes=4096))
    names = [bytes([2, i]) * 16 for i in range(keys)]
    client.store(ns, names, np.ones(keys * 4096, dtype=np.uint8))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        if client.lookup(ns, names).prefix_hits != keys:
            raise RuntimeError("lookup-floor calibration: the chunks are not all in RAM")
        times.append(time.perf_counter() - t0)
    client.delete(ns, names)
    return float(np.median(times[calls // 4:]))


def s3_written(stats: dict[str, dict[str, int]]) -> int:
    """The S3 tier's writes that are over: written, or dropped, refused or failed (each counted once)."""
    s3 = stats.get("s3", {})
    return sum(s3.get(k, 0) for k in ("stored_chunks", "dropped_backpressure", "errors", "rejected_full"))


def run_one(config: NodesConfig, conversations: int, n: int, w: mt.Workload, m: mt.Model, sizes: mt.Sizes,
            workdir: Path, s3: mt.S3Server | None, peer_transport: str, settle_s: float) -> NodesRunResult:
    t0 = time.perf_counter()
    load0 = load_average()
    r = _run_one(config, conversations, n, w, m, sizes, workdir, s3, peer_transport, settle_s)
    r.wall_s = time.perf_counter() - t0
    r.load_average = (load0, load_average())
    return r


def _run_one(config: NodesConfig, conversations: int, n: int, w: mt.Workload, m: mt.Model, sizes: mt.Sizes,
             workdir: Path, s3: mt.S3Server | None, peer_transport: str, settle_s: float) -> NodesRunResult:
    if not config.offload:
        sim = ClusterSim(w, m, conversations, [None] * n, settle_s)
        sim.run()
        return summarize(config.key, sim, None, None, [])
    res = mt.TierResources(workdir, f"{config.key.replace('+', '-')}-{conversations}", s3)
    try:
        nodes = Nodes(config, n, sizes, res, peer_transport)
    except Exception as exc:  # noqa: BLE001 - a tier whose resources cannot be made: say so, go on
        res.close()
        return NodesRunResult(config.key, conversations, n, skipped=f"tier set-up failed: {exc}")
    try:
        nodes.start()
    except Exception as exc:  # noqa: BLE001 - nodes that did not come up: say so, go on
        res.close()
        why = f"nodes did not start: {exc}: {nodes.failure_log()}"
        return NodesRunResult(config.key, conversations, n, skipped=why)
    offloads: list[mt.Offload] = []
    try:
        chunk_bytes = w.chunk_tokens * m.kv_bytes_per_token
        for d in nodes.daemons:
            offloads.append(mt.Offload(d.socket, chunk_bytes, w.chunk_tokens, w.final_tokens // w.chunk_tokens,
                                       w.seed, m.transfer))
        before = [o.stats() for o in offloads]
        written = (lambda i: s3_written(offloads[i].stats())) if config.uses("s3") else None
        sim = ClusterSim(w, m, conversations, offloads, settle_s, written, [s3_written(b) for b in before])
        for node in sim.nodes:
            assert node.offload is not None
            node.lookup_floor_s = calibrate_lookup_floor(node.offload)
            node.move_lookup_excess = not config.uses("s3")
        sim.run()
        after = [o.stats() for o in offloads]
        peers = [peer_counters(nodes.peer_status(i)) for i in range(n)] if config.uses("peer") else []
        return summarize(config.key, sim, before, after, peers)
    finally:
        for o in offloads:
            o.close()
        nodes.close()
        res.close()


# -- physical limits: multiturn's, and a raw TCP socket on loopback --------------------------------


def measure_raw_tcp(chunk_bytes: int) -> tuple[list[float], str]:
    """One raw TCP transfer on loopback (bench/peer_raw.py: sendall from a populated mmap,
    recv_into 16 slots), GiB/s; a failure is a note."""
    try:
        from peer_raw import Place, measure_raw

        return [measure_raw("tcp", Place("loopback"), RAW_TCP_BYTES, chunk_bytes, 16).gib_s], ""
    except Exception as exc:  # noqa: BLE001 - the tiers' figures stand without it
        return [], f"raw TCP: {type(exc).__name__}: {exc}"


# -- reporting --------------------------------------------------------------------------------------


def print_results(results: Sequence[NodesRunResult], file=None) -> None:
    base = {r.conversations: r.throughput_tokens_s for r in results if r.config == "none" and not r.skipped}
    header = ["set-up", "convs", "hit gpu", "ram", "fs", "peer", "s3", "overall", "tokens/s", "vs none", "TTFT p50",
              "p99", "gpu busy", "loader", "GiB/s ram/fs/peer/s3 (marginal)", "wall"]
    rows = [header]
    for r in results:
        if r.skipped:
            rows.append([LABELS[r.config], str(r.conversations), "skipped: " + r.skipped[:80]]
                        + [""] * (len(header) - 3))
            continue
        ratio = r.throughput_tokens_s / base[r.conversations] if base.get(r.conversations) else None
        gib = "-"
        if r.loaded_bytes:
            gib = "/".join(f"{r.load_gib_s[t]:.2f}" if t in r.load_gib_s else "-" for t in LOADED_TIERS)
            gib += " (" + "/".join(f"{r.marginal_gib_s[t]:.2f}" if t in r.marginal_gib_s else "-"
                                   for t in LOADED_TIERS) + ")"
        rows.append([LABELS[r.config], str(r.conversations), *(f"{100 * r.hit_rate[t]:.1f}%" for t in NODE_TIERS),
                     f"{100 * r.hit_rate_overall:.1f}%", f"{r.throughput_tokens_s:,.0f}",
                     f"{ratio:.2f}x" if ratio else "", f"{r.ttft_p50_s:.2f} s", f"{r.ttft_p99_s:.2f} s",
                     f"{100 * r.gpu_busy:.0f}%", f"{100 * r.loader_busy:.0f}%", gib, f"{r.wall_s:.0f} s"])
    print_aligned(rows, right=set(range(1, 14)) | {15}, file=file)
    print("measured: hit rates (each node's Lookup, tier per key), GiB/s (the load calls; marginal: median per-byte "
          "cost with the fixed call cost removed, what the model charges x the byte scale); modelled: tokens/s, "
          "TTFT, busy (GPU and loader: means over the nodes)", file=file)


def daemon_lines(results: Sequence[NodesRunResult]) -> list[str]:
    lines = []
    for r in results:
        if r.skipped or not r.daemon:
            continue
        parts = []
        for name, d in r.daemon.items():
            extra = [f"{k} {d[k]}" for k in ("dropped_dirty", "dropped_backpressure", "errors", "checksum_failures",
                                               "rejected_full") if d.get(k)]
            if name == "ram":
                parts.append(f"ram: {d['loaded_chunks']} leased, {d['stored_chunks']} stored, promotions "
                             f"{d['promotions']}, write-backs {d['writebacks']}, evictions {d['evictions']}"
                             + "".join(f", {e}" for e in extra))
            elif name == "peer":
                parts.append(f"peer: read {mt.fmt_bytes(d['read_bytes'])}" + "".join(f", {e}" for e in extra))
            else:
                parts.append(f"{name}: read {mt.fmt_bytes(d['read_bytes'])} written {mt.fmt_bytes(d['written_bytes'])}"
                             + "".join(f", {e}" for e in extra))
        if r.peers:
            p = r.peers
            parts.append(f"peers: {p['fetches']} fetches, {p['received_chunks']} chunks in "
                         f"({mt.fmt_bytes(p['received_bytes'])}), served {p['served_chunks']}, missing "
                         f"{p['missing_chunks']}, failed {p['failed_chunks']}, timed out {p['timed_out_chunks']}, "
                         f"breaker refusals {p['refused_by_breaker']}, resyncs {p['resyncs']}")
        if r.slow_gib_s:
            parts.append("load calls' marginal GiB/s median / slowest decile: " + ", ".join(
                f"{t} {r.marginal_gib_s.get(t, 0):.2f} / {r.slow_gib_s[t]:.2f}" for t in LOADED_TIERS
                if t in r.slow_gib_s))
        st, se = r.store, r.settle
        lines.append(f"{LABELS[r.config]:>20} {r.conversations:>4}: " + "; ".join(parts)
                     + f" | client stores {st['stored']} new, {st['already_present']} present, {st['dropped']} dropped"
                     f" | lookup p50 {r.lookup_ms_p50:.2f} ms (floor {r.lookup_floor_ms:.2f}; {r.lookup_moved_s:.1f} s "
                     f"moved to fs/peer loads), call floor {r.load_call_floor_ms:.2f} ms x {r.load_calls}"
                     f" | settled {se['waits']} turns, {se['seconds']:.1f} s"
                     + (f", {se['s3_timeouts']} S3 waits gave up" if se["s3_timeouts"] else "")
                     + (f" | {r.load_shortfall_chunks} chunks gone between lookup and load"
                        if r.load_shortfall_chunks else "")
                     + (f" | CORRUPT {r.corrupt_chunks}" if r.corrupt_chunks else ""))
    return lines


RAW = {"ram": ("memcpy", "memcpy"), "fs": ("raw O_DIRECT, streaming", "odirect_stream"),
       "peer": ("raw TCP on loopback", "raw_tcp"), "s3": ("raw GET", "s3_get")}


def _raw(limits: mt.Limits, raw_tcp: Sequence[float], tier: str) -> tuple[str, float | None]:
    name, key = RAW[tier]
    return name, (float(np.median(raw_tcp)) if raw_tcp else None) if key == "raw_tcp" else limits.median(key)


def cost_lines(results: Sequence[NodesRunResult], m: mt.Model, limits: mt.Limits, raw_tcp: Sequence[float]
               ) -> list[str]:
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    lines = [f"break-even load bandwidth ({m.model_kv_bytes_per_token:,} KV bytes/token x "
             f"{m.prefill_tokens_per_s:,.0f} prefill tokens/s): {breakeven:.2f} GiB/s"]
    for config in CONFIGS:
        rs = [r for r in results if r.config == config.key and not r.skipped and r.marginal_gib_s]
        if not rs:
            continue
        r = max(rs, key=lambda x: x.conversations)
        parts = []
        for t in LOADED_TIERS:
            if t in r.marginal_gib_s:
                name, rate = _raw(limits, raw_tcp, t)
                parts.append(f"{t} {r.marginal_gib_s[t]:.2f} GiB/s = {breakeven / r.marginal_gib_s[t]:.2f}x a "
                             f"recompute" + (f" ({name} {rate:.2f})" if rate else ""))
        lines.append(f"{config.label} at {r.conversations}: " + "; ".join(parts))
    return lines


def _limit(r: NodesRunResult, tier: str, limits: mt.Limits, raw_tcp: Sequence[float], breakeven: float) -> str:
    name, rate = _raw(limits, raw_tcp, tier)
    got = (f"{tier} loads {r.load_gib_s[tier]:.2f} GiB/s all-in, "
           + (f"{r.marginal_gib_s[tier]:.2f} marginal" if tier in r.marginal_gib_s else "fixed cost only")
           if tier in r.load_gib_s else f"no {tier} loads")
    return (got + (f" vs {name} {rate:.2f}" if rate else "") + f"; break-even {breakeven:.2f}; loader busy "
            f"{100 * r.loader_busy:.0f}%, GPU {100 * r.gpu_busy:.0f}%")


def target_rows(results: Sequence[NodesRunResult], m: mt.Model, limits: mt.Limits, raw_tcp: Sequence[float],
                n: int) -> list[dict[str, Any]]:
    """The targets at the largest count and the informational ratios: name, value, baseline, ratio,
    target, status (as the other benchmarks' JSON) and `limit`: what bounds it on this machine."""
    runs = {(r.config, r.conversations): r for r in results if not r.skipped}
    counts = sorted({r.conversations for r in results})
    if not counts:
        return []
    top = counts[-1]
    none, islands, peers, s3 = (runs.get((c, top)) for c in CONFIG_KEYS)
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    rows: list[dict[str, Any]] = []

    def add(name: str, value: float, unit: str, baseline_name: str, baseline: float | None, target: float | None,
            limit: str) -> None:
        rows.append({**Row(name, value, unit, baseline_name, baseline, target).to_json(), "limit": limit})

    where = f"{n} nodes, {top} conversations"
    if peers is not None:
        add(f"peers: hit rate, {where}", peers.hit_rate_overall, "share", "all reusable tokens", 1.0, TARGET_HIT,
            f"peer {100 * peers.hit_rate['peer']:.0f}% of reusable tokens; missing "
            f"{peers.peers.get('missing_chunks', 0)}, failed {peers.peers.get('failed_chunks', 0)}, timed out "
            f"{peers.peers.get('timed_out_chunks', 0)}")
        if islands is not None:
            cap = islands.makespan_s / peers.think_floor_s  # no makespan is shorter than the think floor
            add(f"peers vs islands (no peers), {where}", peers.throughput_tokens_s, "tokens/s", "islands",
                islands.throughput_tokens_s, TARGET_VS_ISLANDS, _limit(peers, "peer", limits, raw_tcp, breakeven)
                + f"; makespan {peers.makespan_s:,.0f} s, the conversations' own start and think times "
                  f"{peers.think_floor_s:,.0f} s: at most {cap:.2f}x")
        if none is not None:
            add(f"peers vs no offload, {where}", peers.throughput_tokens_s, "tokens/s", "no offload",
                none.throughput_tokens_s, None, _limit(peers, "peer", limits, raw_tcp, breakeven))
    if islands is not None and none is not None:
        add(f"islands vs no offload, {where}", islands.throughput_tokens_s, "tokens/s", "no offload",
            none.throughput_tokens_s, None, f"hit rate {100 * islands.hit_rate_overall:.0f}%; "
            + _limit(islands, "fs", limits, raw_tcp, breakeven))
    if s3 is not None and none is not None:
        add(f"shared S3 vs no offload, {where}", s3.throughput_tokens_s, "tokens/s", "no offload",
            none.throughput_tokens_s, None, f"hit rate {100 * s3.hit_rate_overall:.0f}%; "
            + _limit(s3, "s3", limits, raw_tcp, breakeven))
    if peers is not None and s3 is not None:
        add(f"peers vs shared S3, {where}", peers.throughput_tokens_s, "tokens/s", "shared S3",
            s3.throughput_tokens_s, None, "the faster of the two ways to reach another node's chunks")
    for tier, r in (("peer", peers), ("fs", islands), ("s3", s3)):
        if r is not None and tier in r.load_gib_s:
            name, rate = _raw(limits, raw_tcp, tier)
            marginal = r.marginal_gib_s.get(tier)
            add(f"{tier} tier loads, all-in ({LABELS[r.config]}, {top})", r.load_gib_s[tier], "GiB/s", name, rate,
                None, (f"marginal {marginal:.2f} GiB/s (what the model charges)" if marginal
                       else "no per-byte cost above the fixed cost per call") + f"; break-even {breakeven:.2f} GiB/s")
    return rows


def bound_lines(results: Sequence[NodesRunResult], m: mt.Model) -> list[str]:
    """Where the modelled time went at the largest count, per set-up with offload."""
    counts = sorted({r.conversations for r in results})
    lines = []
    for r in results:
        if r.skipped or r.conversations != counts[-1] or r.config == "none":
            continue
        full = {t: r.loaded_bytes.get(t, 0) * m.byte_scale for t in LOADED_TIERS}
        lines.append(f"{LABELS[r.config]}: makespan {r.makespan_s:,.0f} modelled s (think floor "
                     f"{r.think_floor_s:,.0f}); per node GPU busy {100 * r.gpu_busy:.0f}%, loader "
                     f"{100 * r.loader_busy:.0f}%; loaded at full size: "
                     + ", ".join(f"{t} {mt.fmt_bytes(v)}" for t, v in full.items() if v)
                     + f"; recomputed {100 * (1 - r.hit_rate_overall):.0f}% of the reusable tokens")
    return lines


# -- main (called by bench/multiturn.py with --nodes N >= 2) ---------------------------------------


MEASURED = ["hit rates per tier: each node's Lookup, tier per key, and what its loads returned (checked bytes)",
            "load and store times of the real daemons (client side), their Stats and Peer Status counters",
            "physical limits: memcpy, raw O_DIRECT, raw GET, raw TCP on loopback; the load average"]
MODELLED = ["each node's GPU: prefix cache, prefill rate, loader beside it (multiturn's model, printed with its basis)",
            "throughput, time to first token, busy shares: on the model clock, charged the measured load costs x the "
            "byte scale"]


def main(ap: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    keys = [c.strip() for c in (args.configs or ",".join(CONFIG_KEYS)).split(",") if c.strip()]
    bad = [c for c in keys if c not in CONFIG_BY_KEY]
    if bad:
        ap.error(f"unknown set-up(s) {bad} with --nodes; choose among {', '.join(CONFIG_KEYS)}")
    if args.settle_s < 0:
        ap.error("--settle-s must not be negative")
    configs = [CONFIG_BY_KEY[c] for c in keys]
    n = args.nodes
    w, m, basis, derivation, sizes, sizes_conv = mt.setup(ap, args)
    counts = mt.parse_counts(args.conversations)
    workdir = Path(args.workdir)

    info = machine_info()
    load_start = load_average()
    print(f"kvstored multi-turn benchmark, {n} nodes -- {info['cpu_model']}, {info['cpus']} CPUs, "
          f"{info['mem_total_gib']} GiB, kernel {info['kernel']}, git {info['git']}, load average {load_start:.2f}")
    print(f"  routing: {ROUTING}; each node: its own modelled GPU and loader, its own daemon")
    for line in mt.model_lines(m, basis):
        print("  " + line)
    scale = mt.scaling_lines(w, m, sizes, args.ram_conversations, args.fs_conversations, args.s3_fs_conversations)
    scale[-1] = "per node: " + scale[-1]
    scale.append(f"set-ups: {'; '.join(f'{c.label} ({c.key}: ' + ' -> '.join(c.tiers) + ')' for c in configs)}; "
                 f"peers over {args.peer_transport} on loopback; shared S3 with write-through; stores settle "
                 f">= {args.settle_s:g} s of wall time before a conversation's next turn looks them up")
    for line in scale:
        print("  " + line)
    print(f"  measured: {'; '.join(MEASURED)}\n  modelled: {'; '.join(MODELLED)}", flush=True)

    doc: dict[str, Any] = {
        "benchmark": "multiturn-nodes",
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv),
        "machine": info,
        "nodes": n,
        "routing": ROUTING,
        "workload": asdict(w),
        "model": {**asdict(m), "transfer": m.transfer.value, "byte_scale": m.byte_scale,
                  "spec": asdict(mt.MODELS[args.model]),
                  "derivation": derivation, "basis": [asdict(b) for b in basis]},
        "configs": [{"key": c.key, "label": c.label, "tiers": list(c.tiers), "write_through": c.write_through}
                    for c in configs],
        "sizes_per_node": asdict(sizes),
        "sizes_in_conversations": sizes_conv,
        "scaling": scale,
        "measured": MEASURED,
        "modelled": MODELLED,
        "peer_transport": args.peer_transport,
        "settle_s": args.settle_s,
    }
    if args.dry_run:
        if args.json:
            write_json(args.json, doc)
            print(f"JSON written to {args.json}")
        return 0

    workdir.mkdir(parents=True, exist_ok=True)
    s3, s3_note = None, ""
    if any(c.uses("s3") for c in configs):
        # write-through puts every chunk of the largest run in radosgw's memstore (RAM)
        memstore = int(max(counts) * w.final_tokens * m.kv_bytes_per_token * 1.5) + GIB
        try:
            s3 = mt.S3Server(args.s3, memstore).start()
            s3_note = f"S3: {'Ceph radosgw (memstore OSD)' if s3.kind == 'radosgw' else 'moto_server'} on loopback"
        except RuntimeError as exc:
            s3_note = f"shared S3 skipped: {exc}"
        print("  " + s3_note, flush=True)

    limits = mt.Limits()
    raw_tcp: list[float] = []
    chunk_bytes = w.chunk_tokens * m.kv_bytes_per_token
    batch = w.final_tokens // w.chunk_tokens

    def measure() -> None:
        mt.measure_limits(limits, workdir, chunk_bytes, batch, s3)
        got, note = measure_raw_tcp(chunk_bytes)
        raw_tcp.extend(got)
        if note:
            limits.notes.append(note)

    results: list[NodesRunResult] = []
    t_start = time.perf_counter()
    try:
        if not args.no_limits:
            measure()
        for count in counts:
            for config in configs:
                if config.uses("s3") and s3 is None:
                    r = NodesRunResult(config.key, count, n, skipped=s3_note)
                else:
                    r = run_one(config, count, n, w, m, sizes, workdir, s3, args.peer_transport, args.settle_s)
                results.append(r)
                status = r.skipped or (f"hit {100 * r.hit_rate_overall:.1f}% (peer {100 * r.hit_rate['peer']:.1f}%)  "
                                       f"{r.throughput_tokens_s:,.0f} tokens/s  wall {r.wall_s:.1f} s  "
                                       f"load {r.load_average[1]:.1f}")
                print(f"  [{time.perf_counter() - t_start:6.0f} s] {config.label:>20} x {count:>3}: {status}",
                      flush=True)
        if not args.no_limits:
            measure()
    finally:
        if s3 is not None:
            s3.stop()
    total_s = time.perf_counter() - t_start
    samples = [x for r in results if not r.skipped for x in r.load_average]
    load_end = load_average()
    load = {"start": load_start, "end": load_end, "min": min([load_start, load_end, *samples]),
            "max": max([load_start, load_end, *samples]), "mean": float(np.mean([load_start, load_end, *samples]))}

    print()
    print_results(results)
    print()
    print("daemon counters per run (Stats deltas and Peer Status, summed over the nodes; bytes are the scaled bytes):")
    for line in daemon_lines(results):
        print("  " + line)
    print()
    print("physical limits of this machine (measured at the start and at the end of the sweep):")
    for line in mt.limit_lines(limits):
        print("  " + line)
    tcp = (f"{np.median(raw_tcp):.2f} GiB/s (median of {len(raw_tcp)}; {min(raw_tcp):.2f}-{max(raw_tcp):.2f})"
           if raw_tcp else "not measured")
    print(f"  raw TCP on loopback, {mt.fmt_bytes(chunk_bytes)} chunks into 16 slots (bench/peer_raw.py): {tcp}")
    print()
    print("cost of a token loaded from each tier (marginal rate, at the largest count measured):")
    costs = cost_lines(results, m, limits, raw_tcp)
    for line in costs:
        print("  " + line)
    print()
    print("where the modelled time went at the largest count:")
    bounds = bound_lines(results, m)
    for line in bounds:
        print("  " + line)
    print()
    rows = target_rows(results, m, limits, raw_tcp, n)
    print(f"targets and ratios ({m.model_name}, {n} nodes; load average over the sweep {load['min']:.1f}-"
          f"{load['max']:.1f}, mean {load['mean']:.1f}, on {info['cpus']} CPUs):")
    mt.print_rows(rows)
    print(f"sweep took {total_s:.0f} s; load average {load['start']:.2f} at start, {load['end']:.2f} at end")

    doc.update({
        "s3_server": s3_note,
        "results": [asdict(r) for r in results],
        "rows": rows,
        "targets": [{"text": f"{r['name']}: {r['ratio']:.2f}x (target >= {r['target']:g}x)",
                     "met": r["status"] == "PASS"} for r in rows if r["target"] is not None and r["ratio"] is not None],
        "limits": {**limits.to_json(), "raw_tcp": raw_tcp},
        "tier_costs": costs,
        "bounds": bounds,
        "load_average": load,
        "sweep_s": total_s,
    })
    mt.write_outputs(doc, args.json, args.plot)
    return 0
