"""Scale-out on paper (issue #11 part 9; not a test): what the peer tier's remote-location index costs
each node from 1 to 1000 nodes (and on to --max-nodes), for a stated fleet workload, with the
daemon's own per-operation costs measured by bench/scale_calibrate.py (default: the committed
docs/scale-out-calibration.json). Compared, per node: index upkeep CPU (following and publishing
KV events), index and stream memory, inbound event traffic, the lookup a turn costs, the share of
peers' chunks the index can hold within the memory budget, and S3 requests and their price, for
four designs:
- mesh: as built. Every node follows every other node's WatchEvents stream, one message per event,
  and every event (all tiers, S3 included) goes to every follower. Write-downs and evictions are
  published one key per event.
- coalesced mesh: still every node indexes every other, but each node sends each follower one
  message per --interval-s with the net changes of the tiers it serves peers from (a write-down's
  "stored fs" and "removed ram" become one change; S3 events are not sent).
- directory: rendezvous-hashed directory shards. A chain's chunks are owned in groups of
  --group-chunks consecutive chunks by the node whose xxh3(group's first key, node) is highest
  (--replicas owners); nodes send owners their net changes once per --interval-s and ask a
  turn's groups' owners in parallel (one Lookup each). Every node owns a share: the index per
  node stays the size of one node's holdings, whatever the fleet.
- router: llm-d-style routing by the KV events it already consumes. Each node publishes its net
  changes to --routers router instances (as the ZMQ publisher does); the router sends a turn to the
  node holding its prefix or names the node to fetch from (as vLLM's p2p tier takes
  remote_kv_source), so no node keeps an index of the others. The router tier's own load is
  shown beside.
The workload (every figure a flag, printed with its basis): the multi-turn workload of
bench/multiturn.py per GPU node (Qwen3.6-35B-A3B on 2x H100: 20,480 KV bytes per token; 12K-token
first prompt, 4K more per turn, 8 turns: 5,120 new tokens and 21,504 reusable ones per turn on
average) at --turns-per-s turns per node, in --chunk-mib chunks; each node holds --ram-gib of RAM
and --fs-tib of disk its peers may fetch from, and writes every chunk down to S3 as well.
A design stops scaling at the first node count where its upkeep CPU exceeds --cpu-budget of one
core or its memory (the index a full view needs, and the streams) exceeds --memory-budget-gib.

Method, baselines, targets and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.lib.report import GIB, MIB, REPO, print_aligned, write_json
from bench.lib.report import fmt_bytes as fmt_size

DEFAULT_CALIBRATION = REPO / "docs" / "scale-out-calibration.json"
SECONDS_PER_MONTH = 30 * 86_400
HEADER_BYTES_PER_SEGMENT = 66  # on a real network: IPv4 20 + TCP 32 (timestamps) + Ethernet 14
MSS = 1448  # payload bytes per segment at a 1500-byte MTU
S3_TIER_CONCURRENCY = 16  # the S3 tier's default max_concurrency
S3_PREFIX_PUTS_PER_S = 3500  # AWS: PUT/COPY/POST/DELETE per second per partitioned prefix
PEER_MAX_BATCH = 16  # the peer tier's default max_batch: chunks per fetch order


# -- what is modelled, and the budget -----------------------------------------------------------------


@dataclass(frozen=True)
class Fleet:
    """The workload of one GPU node and what it holds (defaults: bench/multiturn.py's workload)."""

    turns_per_s: float = 10.0
    first_tokens: int = 12 * 1024
    turn_tokens: int = 4 * 1024
    turns: int = 8
    kv_bytes_per_token: int = 20_480
    chunk_bytes: int = 2 * MIB
    kvstored_read_share: float = 0.5  # of a turn's reusable chunks: loaded from kvstored (the GPU cache has the rest)
    fs_read_share: float = 0.3  # of those: from the node's own fs tier (promoted into RAM: an event each)
    cross_node_share: float = 0.1  # of turns: sent to a node other than the one holding the conversation
    s3_read_share: float = 0.01  # of kvstored reads: only S3 has the chunk
    ram_bytes: int = 100 * GIB  # what each node's peers may fetch from: its RAM tier ...
    fs_bytes: int = 2 << 40  # ... and its fs tier
    s3_tier: bool = True  # RAM -> fs -> peer -> s3: every write-down also goes to S3 (a PUT, and an event)
    interval_s: float = 0.1  # coalesced mesh, directory, router: one message per destination per interval
    group_chunks: int = 32  # directory: consecutive chunks of a chain owned together
    replicas: int = 1  # directory: owners per group
    routers: int = 1  # router: router instances each node publishes to
    put_usd_per_1k: float = 0.005  # S3 Standard, us-east-1 list price (PUT, COPY, POST, LIST)
    get_usd_per_1k: float = 0.0004  # S3 Standard, us-east-1 list price (GET, SELECT)

    @property
    def new_tokens_per_turn(self) -> float:
        return (self.first_tokens + (self.turns - 1) * self.turn_tokens) / self.turns

    @property
    def reusable_tokens_per_turn(self) -> float:
        """The previous turn's whole prompt, averaged over the turns (the first reuses nothing)."""
        previous = sum(self.first_tokens + (t - 1) * self.turn_tokens for t in range(1, self.turns))
        return previous / self.turns

    @property
    def chunk_tokens(self) -> float:
        return self.chunk_bytes / self.kv_bytes_per_token


@dataclass(frozen=True)
class Budget:
    cpu_fraction: float = 0.10  # of one core, for the index's upkeep (events in and out, owner choice, lookups served)
    memory_bytes: float = 1.0 * GIB  # the index a full view needs, and the streams


@dataclass(frozen=True)
class Costs:
    """The calibration's figures, in seconds and bytes."""

    follow_s_per_event: float
    follow_s_per_key: float
    follow_s_per_key_per_slot: float  # the index's masks grow with the holder's slot
    publish_s_per_event: float  # per subscriber
    publish_s_per_key: float  # per subscriber
    bytes_per_event: float  # payload
    bytes_per_key: float
    segments_per_event: float
    index_bytes_per_entry: float  # the holder in one of the first slots
    index_bytes_per_slot: float
    stream_bytes: float  # one follower stream: server side + client side
    stream_idle_s_per_s: float  # CPU of a quiet stream (keepalive pings), server side, both ends counted
    lookup_fixed_s: float
    lookup_s_per_key: float
    contains_s_per_peer: float  # per Lookup call: the peer tier walks its peers
    remote_lookup_s: float
    remote_lookup_server_s: float  # CPU of one Lookup served over TCP
    fetch_round_trip_s: float
    rendezvous_s_per_node: float
    single_events_per_chunk: float  # a chunk's life beyond its (batched) store event
    s3_put_s: float
    s3_get_s: float
    s3_server: str

    @classmethod
    def from_calibration(cls, doc: dict[str, Any]) -> Costs:
        ev, fit, ip, look = doc["events"], doc["events"]["fit"], doc["in_process"], doc["lookup"]
        kinds = ev["lifecycle"]["per_chunk_by_kind"]
        single = sum(v for k, v in kinds.items() if not k.endswith(" keys") and k != "stored ram")
        s3 = doc.get("s3") or {}
        return cls(
            follow_s_per_event=fit["follower_cpu_s_per_event"],
            follow_s_per_key=max(0.0, fit["follower_cpu_s_per_key"]),
            follow_s_per_key_per_slot=max(0.0, ip["index_updates"]["fit"]["add_us_per_slot"]) * 1e-6,
            publish_s_per_event=fit["publisher_cpu_s_per_event_per_subscriber"],
            publish_s_per_key=fit["publisher_cpu_s_per_key_per_subscriber"],
            bytes_per_event=fit["payload_bytes_per_event"],
            bytes_per_key=fit["payload_bytes_per_key"],
            segments_per_event=fit["segments_per_single_key_event"],
            index_bytes_per_entry=ev["index_memory"]["rss_bytes_per_entry"],
            index_bytes_per_slot=ip["index_tracemalloc"]["fit_slot_ge_7"]["bytes_per_slot"],
            stream_bytes=ev["streams"]["server_bytes_per_stream"] + ev["streams"]["client_bytes_per_stream"],
            stream_idle_s_per_s=2 * ev["streams"]["server_idle_cpu_s_per_s_per_stream"],
            lookup_fixed_s=look["local"]["one_key_ms"] * 1e-3,
            lookup_s_per_key=max(0.0, look["local"]["per_key_us"]) * 1e-6,
            contains_s_per_peer=max(0.0, ip["contains"]["fit"]["per_call_us_per_peer"]) * 1e-6,
            remote_lookup_s=look["remote"]["one_key_ms"] * 1e-3,
            remote_lookup_server_s=look["remote"]["server_cpu_ms_per_call"] * 1e-3,
            fetch_round_trip_s=look["fetch"]["round_trip_ms"] * 1e-3,
            rendezvous_s_per_node=ip["rendezvous"]["us_per_node"] * 1e-6,
            single_events_per_chunk=single,
            s3_put_s=s3.get("put_chunk_ms", 0.0) * 1e-3,
            s3_get_s=s3.get("get_chunk_ms", 0.0) * 1e-3,
            s3_server=s3.get("server") or "not measured",
        )


@dataclass(frozen=True)
class Rates:
    """One node's work per second under the Fleet's workload, and what it publishes."""

    stored_chunks_per_turn: float
    looked_up_chunks_per_turn: float
    stores_per_s: float  # chunks into kvstored
    reads_per_s: float  # chunks loaded from kvstored
    fs_promotions_per_s: float
    peer_fetches_per_s: float  # chunks fetched from peers (cross-node turns)
    events_per_s: float  # as built: every event of every tier
    keys_per_s: float
    single_key_events_per_s: float
    net_keys_per_s: float  # net changes of the tiers served to peers
    groups_changed_per_s: float  # directory: chunk groups whose holders changed
    lookup_groups_per_turn: int
    chunks_held: float  # what one node's peers may fetch from it
    s3_puts_per_s: float
    s3_base_gets_per_s: float  # reads only S3 can serve, with every peer's chunks found

    @classmethod
    def of(cls, f: Fleet, c: Costs) -> Rates:
        stored = f.new_tokens_per_turn / f.chunk_tokens
        looked_up = f.reusable_tokens_per_turn / f.chunk_tokens
        stores = f.turns_per_s * stored
        reads = f.turns_per_s * looked_up * f.kvstored_read_share
        promotions = reads * f.fs_read_share
        fetched = reads * f.cross_node_share
        s3_events = 1.0 if f.s3_tier else 0.0
        # A stored (or fetched) chunk: its store (batched per turn), then write-down (stored fs,
        # removed ram: measured one key per event), fs eviction, and the S3 write-down's event.
        # A chunk promoted from fs: one event (stored ram); its later eviction rides in a store's batch.
        lives = stores + fetched
        single = lives * (c.single_events_per_chunk + s3_events) + promotions + fetched
        events = single + 2 * f.turns_per_s  # a store event and an eviction batch per turn
        keys = single + stores + promotions
        # Net, per interval, tiers served to peers only: appears in RAM; moves to fs; leaves.
        net = lives * 3 + promotions * 2
        run = max(1.0, min(f.group_chunks, stored))  # a turn's chunks change together
        return cls(
            stored_chunks_per_turn=stored, looked_up_chunks_per_turn=looked_up, stores_per_s=stores,
            reads_per_s=reads, fs_promotions_per_s=promotions, peer_fetches_per_s=fetched, events_per_s=events,
            keys_per_s=keys, single_key_events_per_s=single, net_keys_per_s=net, groups_changed_per_s=net / run,
            lookup_groups_per_turn=math.ceil(looked_up / f.group_chunks),
            chunks_held=(f.ram_bytes + f.fs_bytes) / f.chunk_bytes,
            s3_puts_per_s=lives if f.s3_tier else 0.0,  # every write-down goes to fs and S3 (a fetched chunk too)
            s3_base_gets_per_s=reads * f.s3_read_share if f.s3_tier else 0.0,
        )


# -- the designs ----------------------------------------------------------------------------------------


@dataclass
class Point:
    """One design at one node count, per node."""

    nodes: int
    cpu_fraction: float  # of one core
    cpu_parts: dict[str, float]
    memory_bytes: float
    memory_parts: dict[str, float]
    inbound_bytes_per_s: float  # event traffic (payload + segment headers)
    inbound_messages_per_s: float
    inbound_keys_per_s: float
    lookup_ms: float  # what a turn's Lookup costs
    index_entries: float  # a full view
    coverage: float  # of the peers' chunks, within the memory budget
    s3_puts_per_s: float
    s3_gets_per_s: float
    s3_usd_per_month: float


@dataclass(frozen=True)
class Model:
    fleet: Fleet
    budget: Budget
    costs: Costs
    rates: Rates = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rates", Rates.of(self.fleet, self.costs))

    # helpers --------------------------------------------------------------------------------------

    def wire_bytes(self, messages: float, keys: float, segments: float | None = None) -> float:
        c = self.costs
        payload = messages * c.bytes_per_event + keys * c.bytes_per_key
        segs = segments if segments is not None else max(messages, payload / MSS)
        return payload + segs * HEADER_BYTES_PER_SEGMENT

    def s3(self, coverage: float) -> tuple[float, float, float]:
        """PUTs/s, GETs/s and $ per month of one node: the cross-node reads its index cannot place
        go to S3 (which has every chunk)."""
        r, f = self.rates, self.fleet
        puts = r.s3_puts_per_s
        gets = r.s3_base_gets_per_s + (r.peer_fetches_per_s * (1 - coverage) if f.s3_tier else 0.0)
        usd = (puts * f.put_usd_per_1k + gets * f.get_usd_per_1k) / 1000 * SECONDS_PER_MONTH
        return puts, gets, usd

    def local_lookup_s(self) -> float:
        return self.costs.lookup_fixed_s + self.rates.looked_up_chunks_per_turn * self.costs.lookup_s_per_key

    def full_view(self, nodes: int, bytes_per_entry: float) -> tuple[float, float, float]:
        """Entries, bytes and coverage within the budget of an index of every peer's chunks."""
        entries = (nodes - 1) * self.rates.chunks_held
        index = entries * bytes_per_entry
        streams = 2 * (nodes - 1) * self.costs.stream_bytes
        room = max(0.0, self.budget.memory_bytes - streams) / bytes_per_entry
        return entries, index, min(1.0, room / entries) if entries else 1.0

    def point(self, nodes: int, cpu: dict[str, float], memory: dict[str, float], inbound_bytes: float,
              inbound_messages: float, inbound_keys: float, lookup_s: float, entries: float,
              coverage: float) -> Point:
        puts, gets, usd = self.s3(coverage)
        return Point(nodes, sum(cpu.values()), cpu, sum(memory.values()), memory, inbound_bytes, inbound_messages,
                     inbound_keys, lookup_s * 1e3, entries, coverage, puts, gets, usd)

    # the four designs --------------------------------------------------------------------------------

    def mesh(self, nodes: int) -> Point:
        c, r = self.costs, self.rates
        peers = nodes - 1
        mean_slot = max(0.0, (nodes - 2) / 2)  # holders' slots spread over the peers
        per_key = c.follow_s_per_key + c.follow_s_per_key_per_slot * mean_slot
        m = c.index_bytes_per_entry + c.index_bytes_per_slot * mean_slot
        entries, index, coverage = self.full_view(nodes, m)
        cpu = {
            "follow": peers * (r.events_per_s * c.follow_s_per_event + r.keys_per_s * per_key),
            "publish": peers * (r.events_per_s * c.publish_s_per_event + r.keys_per_s * c.publish_s_per_key),
            "streams": 2 * peers * c.stream_idle_s_per_s,
        }
        memory = {"index": index, "streams": 2 * peers * c.stream_bytes}
        inbound = peers * self.wire_bytes(r.events_per_s, r.keys_per_s, r.events_per_s * c.segments_per_event)
        lookup = self.local_lookup_s() + peers * c.contains_s_per_peer
        return self.point(nodes, cpu, memory, inbound, peers * r.events_per_s, peers * r.keys_per_s, lookup,
                          entries, coverage)

    def coalesced(self, nodes: int) -> Point:
        c, r, f = self.costs, self.rates, self.fleet
        peers = nodes - 1
        mean_slot = max(0.0, (nodes - 2) / 2)
        per_key = c.follow_s_per_key + c.follow_s_per_key_per_slot * mean_slot
        m = c.index_bytes_per_entry + c.index_bytes_per_slot * mean_slot
        entries, index, coverage = self.full_view(nodes, m)
        messages = 1 / f.interval_s
        cpu = {
            "follow": peers * (messages * c.follow_s_per_event + r.net_keys_per_s * per_key),
            "publish": peers * (messages * c.publish_s_per_event + r.net_keys_per_s * c.publish_s_per_key),
            "streams": 2 * peers * c.stream_idle_s_per_s,
        }
        memory = {"index": index, "streams": 2 * peers * c.stream_bytes}
        inbound = peers * self.wire_bytes(messages, r.net_keys_per_s)
        lookup = self.local_lookup_s() + peers * c.contains_s_per_peer
        return self.point(nodes, cpu, memory, inbound, peers * messages, peers * r.net_keys_per_s, lookup,
                          entries, coverage)

    def directory(self, nodes: int) -> Point:
        c, r, f = self.costs, self.rates, self.fleet
        peers = nodes - 1
        remote = peers / nodes  # the share of groups another node owns
        # Messages: per interval a node has changes in g x T groups, sent to their owners; by
        # symmetry it receives as many. Distinct owners among the peers (occupancy):
        changes = r.groups_changed_per_s * f.interval_s * f.replicas * remote
        owners = peers * (1 - math.exp(-changes / peers)) if peers else 0.0
        messages = owners / f.interval_s
        keys_in = r.net_keys_per_s * f.replicas * remote
        lookups_in = f.turns_per_s * r.lookup_groups_per_turn * remote
        choices = (r.groups_changed_per_s + f.turns_per_s * r.lookup_groups_per_turn) if peers else 0.0
        cpu = {
            "follow": messages * c.follow_s_per_event + keys_in * c.follow_s_per_key,
            "publish": messages * c.publish_s_per_event + keys_in * c.publish_s_per_key,
            "owner choice": choices * nodes * c.rendezvous_s_per_node,
            "lookups served": lookups_in * c.remote_lookup_server_s,
            "streams": 2 * peers * c.stream_idle_s_per_s,
        }
        entries = r.chunks_held * f.replicas if peers else 0.0
        streams = 2 * peers * c.stream_bytes
        memory = {"index": entries * c.index_bytes_per_entry, "streams": streams}
        room = max(0.0, self.budget.memory_bytes - streams) / c.index_bytes_per_entry
        coverage = min(1.0, room / entries) if entries else 1.0
        lookup = self.local_lookup_s() + (
            c.remote_lookup_s + r.lookup_groups_per_turn * nodes * c.rendezvous_s_per_node if peers else 0.0)
        return self.point(nodes, cpu, memory, self.wire_bytes(messages, keys_in), messages, keys_in, lookup,
                          entries, coverage)

    def router(self, nodes: int) -> Point:
        c, r, f = self.costs, self.rates, self.fleet
        messages = 1 / f.interval_s
        cpu = {
            "publish": f.routers * (messages * c.publish_s_per_event + r.net_keys_per_s * c.publish_s_per_key),
            "streams": f.routers * c.stream_idle_s_per_s,
        }
        memory = {"index": 0.0, "streams": f.routers * c.stream_bytes}
        return self.point(nodes, cpu, memory, 0.0, 0.0, 0.0, self.local_lookup_s(), 0.0, 1.0)

    def router_tier(self, nodes: int) -> dict[str, float]:
        """What the router tier takes in for the whole fleet (our per-event and per-key costs and
        bytes per entry as a stand-in for the router's own)."""
        c, r, f = self.costs, self.rates, self.fleet
        messages = nodes / f.interval_s
        keys = nodes * r.net_keys_per_s
        entries = nodes * r.chunks_held
        return {
            "nodes": nodes, "messages_per_s": messages, "keys_per_s": keys,
            "cores": messages * c.follow_s_per_event + keys * c.follow_s_per_key,
            "index_entries": entries, "index_bytes": entries * c.index_bytes_per_entry,
            "inbound_bytes_per_s": self.wire_bytes(messages, keys),
        }


@dataclass(frozen=True)
class Design:
    key: str
    label: str
    how: str
    point: Callable[[int], Point]


def designs(model: Model) -> list[Design]:
    return [
        Design("mesh", "mesh (as built)", "every node follows every other's WatchEvents; one message per event, "
               "write-downs and evictions one key each; every tier's events", model.mesh),
        Design("coalesced", "coalesced mesh", "every node still indexes every other, but gets one message per "
               "interval per peer with the net changes of the tiers served to peers", model.coalesced),
        Design("directory", "rendezvous directory", "chunk groups owned by rendezvous hashing; changes sent to "
               "owners once per interval; a turn asks its groups' owners", model.directory),
        Design("router", "router (llm-d KV events)", "nodes publish net changes to the router tier, which routes "
               "turns or names the node to fetch from; no index on the nodes", model.router),
    ]


def exceeds(p: Point, budget: Budget) -> str:
    if p.cpu_fraction > budget.cpu_fraction:
        return "cpu"
    if p.memory_bytes > budget.memory_bytes:
        return "memory"
    return ""


def break_point(design: Design, budget: Budget, max_nodes: int) -> dict[str, Any] | None:
    """The fewest nodes at which the design exceeds the budget (the costs grow with the node
    count: a binary search), or None up to max_nodes."""
    if not exceeds(design.point(max_nodes), budget):
        return None
    lo, hi = 1, max_nodes  # lo within the budget (one node has no peers), hi over it
    if exceeds(design.point(lo), budget):
        hi = lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if exceeds(design.point(mid), budget):
            hi = mid
        else:
            lo = mid
    p = design.point(hi)
    return {"nodes": hi, "resource": exceeds(p, budget), "cpu_fraction": p.cpu_fraction,
            "memory_bytes": p.memory_bytes}


def plot_nodes(max_nodes: int) -> list[int]:
    out = sorted({max(1, round(10 ** (i / 20))) for i in range(int(20 * math.log10(max_nodes)) + 1)} | {max_nodes})
    return [n for n in out if n <= max_nodes]


# -- the run ------------------------------------------------------------------------------------------


def run(model: Model, nodes: Sequence[int], max_nodes: int) -> dict[str, Any]:
    out_designs = []
    for d in designs(model):
        out_designs.append({
            "key": d.key, "label": d.label, "how": d.how,
            "break": break_point(d, model.budget, max_nodes),
            "rows": [asdict(d.point(n)) for n in nodes],
            "curve": [asdict(d.point(n)) for n in plot_nodes(max_nodes)],
        })
    return {
        "designs": out_designs,
        "router_tier": [model.router_tier(n) for n in nodes],
    }


def sensitivity(fleet: Fleet, budget: Budget, costs: Costs, max_nodes: int) -> list[dict[str, Any]]:
    """Break points when one assumption changes."""
    variants = [
        ("as stated", fleet),
        ("half the turn rate", replace(fleet, turns_per_s=fleet.turns_per_s / 2)),
        ("peers fetch from RAM only (disks not indexed)", replace(fleet, fs_bytes=0)),
        ("1 s batching interval", replace(fleet, interval_s=1.0)),
        ("no S3 tier", replace(fleet, s3_tier=False)),
    ]
    rows = []
    for label, f in variants:
        model = Model(f, budget, costs)
        rows.append({"variant": label, "breaks": {d.key: break_point(d, budget, max_nodes) for d in designs(model)}})
    return rows


def basis(f: Fleet, r: Rates, c: Costs) -> list[tuple[str, str, str]]:
    return [
        ("turns per node", f"{f.turns_per_s:g}/s", "--turns-per-s; ~ the GPU saturated: 50,000 prefill tokens/s "
         f"(bench/multiturn.py's Qwen3.6-35B-A3B on 2x H100) / {f.new_tokens_per_turn:,.0f} new tokens per turn"),
        ("tokens per turn", f"{f.new_tokens_per_turn:,.0f} new, {f.reusable_tokens_per_turn:,.0f} reusable",
         f"{f.first_tokens:,} first + {f.turn_tokens:,} per turn, {f.turns} turns (mean over the turns)"),
        ("chunk", f"{f.chunk_bytes / MIB:g} MiB = {f.chunk_tokens:.1f} tokens",
         f"--chunk-mib at {f.kv_bytes_per_token:,} KV bytes per token (--kv-bytes-per-token)"),
        ("chunks per turn", f"{r.stored_chunks_per_turn:.0f} stored, {r.looked_up_chunks_per_turn:.0f} looked up",
         "the turn's new tokens, its reusable tokens"),
        ("stores", f"{r.stores_per_s:,.0f} chunks/s ({r.stores_per_s * f.chunk_bytes / GIB:.2f} GiB/s)",
         "one store call per turn (the store event carries the turn's keys)"),
        ("reads from kvstored", f"{r.reads_per_s:,.0f} chunks/s",
         f"--kvstored-read-share {f.kvstored_read_share:g} of the reusable chunks"),
        ("promotions from own fs", f"{r.fs_promotions_per_s:,.0f}/s", f"--fs-read-share {f.fs_read_share:g} of reads"),
        ("fetched from peers", f"{r.peer_fetches_per_s:,.0f}/s",
         f"--cross-node-share {f.cross_node_share:g} of turns land on another node; "
         f"{math.ceil(r.looked_up_chunks_per_turn * f.kvstored_read_share / PEER_MAX_BATCH)} fetch orders of "
         f"<= {PEER_MAX_BATCH} chunks per such turn, {c.fetch_round_trip_s * 1e3:.2f} ms each (measured)"),
        ("events published (as built)", f"{r.events_per_s:,.0f}/s, {r.keys_per_s:,.0f} keys/s",
         f"a chunk's life after its store: {c.single_events_per_chunk:.2f} single-key events (measured, RAM -> fs "
         f"full){' + 1 for the S3 write-down (modelled)' if f.s3_tier else ''}; a promotion or fetch: 1"),
        ("net changes (coalesced designs)", f"{r.net_keys_per_s:,.0f} keys/s",
         "per chunk: appears in RAM, moves to fs, leaves (3); promoted from fs: 2; S3 not sent"),
        ("held for peers", f"{r.chunks_held:,.0f} chunks", f"--ram-gib {f.ram_bytes / GIB:g} + --fs-tib "
         f"{f.fs_bytes / (1 << 40):g} of {f.chunk_bytes / MIB:g} MiB chunks"),
        ("directory groups", f"{r.groups_changed_per_s:,.0f} changed/s, {r.lookup_groups_per_turn} asked per turn",
         f"--group-chunks {f.group_chunks}, --replicas {f.replicas}, --interval-s {f.interval_s:g}"),
        ("S3", f"{r.s3_puts_per_s:,.0f} PUT/s, {r.s3_base_gets_per_s:,.1f} GET/s (+ cross-node reads the index "
               "cannot place)", "every chunk leaving RAM is written to fs and S3 (stored and fetched ones); "
         f"${f.put_usd_per_1k:g} per 1k PUT, ${f.get_usd_per_1k:g} per 1k GET (S3 Standard, us-east-1 list prices; "
         "--put-usd-per-1k, --get-usd-per-1k)"),
    ]


# -- printing and plotting ---------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    return fmt_size(n, grouped=True)


def fmt_rate(n: float) -> str:
    return fmt_bytes(n) + "/s"


def print_report(doc: dict[str, Any], model: Model) -> None:
    cal = doc["calibration"]
    print(f"calibration: {cal['path']} ({cal['created']}, {cal['cpu_model']}, {cal['cpus']} CPUs, "
          f"load average {cal['load_average']}; S3: {model.costs.s3_server})")
    print("\nworkload per node (every figure a flag):")
    print_aligned([["figure", "value", "basis"], *[list(b) for b in basis(model.fleet, model.rates, model.costs)]],
                  right=set())
    c = model.costs
    print("\nmeasured costs used:")
    print_aligned([["cost", "value"], *[[k, v] for k, v in [
        ("follower CPU", f"{c.follow_s_per_event * 1e6:.1f} us/event + {c.follow_s_per_key * 1e6:.2f} us/key "
                         f"(+{c.follow_s_per_key_per_slot * 1e9:.2f} ns per slot of the holder)"),
        ("publisher CPU per follower", f"{c.publish_s_per_event * 1e6:.1f} us/event + "
                                       f"{c.publish_s_per_key * 1e6:.3f} us/key"),
        ("event bytes", f"{c.bytes_per_event:.0f} B/event + {c.bytes_per_key:.1f} B/key (+{HEADER_BYTES_PER_SEGMENT} "
                        "B per segment on a network)"),
        ("index memory", f"{c.index_bytes_per_entry:.0f} B/entry (+{c.index_bytes_per_slot:.3f} B per slot "
                         "of the holder)"),
        ("one stream", f"{fmt_bytes(c.stream_bytes)} (both ends)"),
        ("a turn's Lookup", f"{model.local_lookup_s() * 1e3:.2f} ms local, +{c.contains_s_per_peer * 1e6:.2f} us "
                            "per peer (mesh)"),
        ("remote Lookup", f"{c.remote_lookup_s * 1e3:.2f} ms, {c.remote_lookup_server_s * 1e3:.2f} ms of the "
                          "server's CPU"),
        ("owner choice", f"{c.rendezvous_s_per_node * 1e6:.3f} us per node per group"),
        ("S3 per chunk", f"PUT {c.s3_put_s * 1e3:.1f} ms, GET {c.s3_get_s * 1e3:.1f} ms ({c.s3_server})"),
    ]]], right=set())
    budget = model.budget
    print(f"\nper node, budget {budget.cpu_fraction:.0%} of a core and {fmt_bytes(budget.memory_bytes)}:")
    table = [["design", "nodes", "CPU", "memory", "event traffic in", "lookup/turn", "coverage", "S3 $/month"]]
    for d in doc["designs"]:
        for row in d["rows"]:
            table.append([d["label"], f"{row['nodes']:,}", f"{row['cpu_fraction']:.1%}", fmt_bytes(row["memory_bytes"]),
                          fmt_rate(row["inbound_bytes_per_s"]), f"{row['lookup_ms']:.2f} ms", f"{row['coverage']:.1%}",
                          f"{row['s3_usd_per_month']:,.0f}"])
    print_aligned(table, right={1, 2, 3, 4, 5, 6, 7})
    print("\nwhere each design stops scaling:")
    for d in doc["designs"]:
        b = d["break"]
        if b is None:
            print(f"  {d['label']}: within the budget up to {doc['max_nodes']:,} nodes")
        else:
            print(f"  {d['label']}: {b['nodes']:,} nodes ({b['resource']}: CPU {b['cpu_fraction']:.1%}, "
                  f"memory {fmt_bytes(b['memory_bytes'])})")
    print("\nthe router tier takes in, for the fleet:")
    for t in doc["router_tier"]:
        nodes = f"{t['nodes']:,} node{'s' if t['nodes'] != 1 else ''}"
        print(f"  {nodes}: {t['keys_per_s']:,.0f} keys/s in {t['messages_per_s']:,.0f} messages/s "
              f"({fmt_rate(t['inbound_bytes_per_s'])}), {t['cores']:.2f} cores at our per-key cost, "
              f"{t['index_entries']:,.0f} entries ({fmt_bytes(t['index_bytes'])})")
    s3 = doc["s3"]
    print(f"\nS3: {s3['puts_per_s_per_node']:,.0f} PUT/s per node ({s3['in_flight_puts']:.1f} in flight at "
          f"{c.s3_put_s * 1e3:.1f} ms each, the S3 tier keeps {S3_TIER_CONCURRENCY}); at 1,000 nodes "
          f"{s3['puts_per_s_per_node'] * 1000:,.0f} PUT/s need >= {s3['prefixes_at_1000']} partitioned prefixes "
          f"({S3_PREFIX_PUTS_PER_S:,} PUT/s each) and cost ${s3['usd_per_month_at_1000']:,.0f}/month in requests")
    print("\nbreak points when one assumption changes:")
    for v in doc["sensitivity"]:
        parts = [f"{k} {b['nodes']:,} ({b['resource']})" if b else f"{k} > {doc['max_nodes']:,}"
                 for k, b in v["breaks"].items()]
        print(f"  {v['variant']}: " + ", ".join(parts))


STYLE = {"mesh": ("#d62728", "o"), "coalesced": ("#ff7f0e", "s"), "directory": ("#2ca02c", "^"),
         "router": ("#1f77b4", "D")}
WIDTH = {"mesh": 5.0}  # drawn wide underneath: where the coalesced mesh has the same figure, both show


def plot(doc: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("Index upkeep CPU (share of one core)", lambda p: 100 * p["cpu_fraction"], "%", True,
         100 * doc["budget"]["cpu_fraction"]),
        ("Index + streams memory for a full view", lambda p: p["memory_bytes"] / MIB, "MiB", True,
         doc["budget"]["memory_bytes"] / MIB),
        ("Inbound event traffic", lambda p: p["inbound_bytes_per_s"] / 1024, "KiB/s", True, None),
        ("A turn's Lookup", lambda p: p["lookup_ms"], "ms", False, None),
        ("Peers' chunks the index holds within the memory budget", lambda p: 100 * p["coverage"], "%", False, None),
        ("S3 GETs per node (misses the index cannot place)", lambda p: p["s3_gets_per_s"], "GET/s", False, None),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), dpi=110)
    for ax, (title, value, unit, log, budget) in zip(axes.flat, panels):
        for d in doc["designs"]:
            pts = [p for p in d["curve"] if p["nodes"] >= 2]
            colour, marker = STYLE.get(d["key"], ("#000000", "o"))
            xy = [(p["nodes"], value(p)) for p in pts]
            if log:
                xy = [(x, y) for x, y in xy if y > 0]  # (the router receives no events: nothing to draw)
            if not xy:
                continue
            wide = WIDTH.get(d["key"])
            ax.plot([x for x, _ in xy], [y for _, y in xy], color=colour, marker=marker, markevery=10, markersize=5,
                    linewidth=wide or 2, alpha=0.45 if wide else 1.0, label=d["label"])
            b = d["break"]
            if b is not None:
                ax.axvline(b["nodes"], color=colour, linestyle=":", linewidth=1)
        if budget is not None:
            ax.axhline(budget, color="black", linestyle="--", linewidth=1, label="budget")
        ax.set_xscale("log")
        if log:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)
        ax.set_xlabel("nodes")
        ax.grid(True, alpha=0.3, which="both")
    axes.flat[0].legend(fontsize=8, loc="lower right")
    w = doc["fleet"]
    breaks = ", ".join(f"{d['label']}: {d['break']['nodes']:,}" if d["break"] else f"{d['label']}: none"
                       for d in doc["designs"])
    fig.suptitle(f"kvstored peer index, per node, {w['turns_per_s']:g} turns/s per node "
                 f"({w['chunk_bytes'] / MIB:g} MiB chunks); dotted: where a design exceeds the budget ({breaks})",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------------


def parse_nodes(text: str) -> list[int]:
    nodes = sorted({int(x) for x in text.split(",") if x.strip()})
    if not nodes or nodes[0] < 1:
        raise argparse.ArgumentTypeError("node counts are positive integers")
    return nodes


def build_parser() -> argparse.ArgumentParser:
    d = Fleet()
    p = argparse.ArgumentParser(
        description="Model a fleet of 1 to 1000 kvstored nodes (and on to --max-nodes) from the daemon's measured "
                    "per-operation costs (bench/scale_calibrate.py; default the committed calibration): per node "
                    "index memory, inbound event traffic and the CPU to apply it, lookup cost, S3 request rate and "
                    "cost, for the mesh as built (every node follows every other), a node-level coalesced mesh, "
                    "directory shards placed by rendezvous hashing and router-based (llm-d consuming KV events); "
                    "prints where "
                    "each design exceeds the budget, writes the table as JSON (--json) and a plot (--plot).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--calibration", default=str(DEFAULT_CALIBRATION.relative_to(REPO)),
                   help="calibration JSON written by scale_calibrate.py (relative paths: to the working directory, "
                        "else to the repository)")
    p.add_argument("--json", help="write the table, the break points and every assumption here")
    p.add_argument("--plot", help="write the plot here (PNG; needs matplotlib)")
    p.add_argument("--nodes", type=parse_nodes, default=[1, 10, 100, 1000], help="node counts of the table")
    p.add_argument("--max-nodes", type=int, default=10_000, help="how far to look for break points (and to plot)")
    p.add_argument("--cpu-budget", type=float, default=0.10, help="index upkeep CPU per node, share of one core")
    p.add_argument("--memory-budget-gib", type=float, default=1.0, help="index and stream memory per node")
    p.add_argument("--turns-per-s", type=float, default=d.turns_per_s, help="turns per GPU node per second")
    p.add_argument("--first-tokens", type=int, default=d.first_tokens, help="tokens of a conversation's first prompt")
    p.add_argument("--turn-tokens", type=int, default=d.turn_tokens, help="tokens each later turn adds")
    p.add_argument("--turns", type=int, default=d.turns, help="turns per conversation")
    p.add_argument("--kv-bytes-per-token", type=int, default=d.kv_bytes_per_token,
                   help="KV bytes per token (Qwen3.6-35B-A3B: 20,480; Llama-3.1-8B: 131,072)")
    p.add_argument("--chunk-mib", type=float, default=d.chunk_bytes / MIB, help="chunk size")
    p.add_argument("--kvstored-read-share", type=float, default=d.kvstored_read_share,
                   help="share of a turn's reusable chunks loaded from kvstored (the GPU cache has the rest)")
    p.add_argument("--fs-read-share", type=float, default=d.fs_read_share,
                   help="share of kvstored reads served by the node's own fs tier (each promotion is an event)")
    p.add_argument("--cross-node-share", type=float, default=d.cross_node_share,
                   help="share of turns sent to a node other than the one holding the conversation")
    p.add_argument("--s3-read-share", type=float, default=d.s3_read_share,
                   help="share of kvstored reads only S3 can serve")
    p.add_argument("--ram-gib", type=float, default=d.ram_bytes / GIB, help="each node's RAM tier")
    p.add_argument("--fs-tib", type=float, default=d.fs_bytes / (1 << 40), help="each node's fs tier (0: not indexed)")
    p.add_argument("--no-s3", action="store_true", help="no S3 tier below the peers")
    p.add_argument("--interval-s", type=float, default=d.interval_s,
                   help="coalesced mesh, directory, router: one message per destination per interval")
    p.add_argument("--group-chunks", type=int, default=d.group_chunks,
                   help="directory: consecutive chunks of a chain owned together")
    p.add_argument("--replicas", type=int, default=d.replicas, help="directory: owners per chunk group")
    p.add_argument("--routers", type=int, default=d.routers, help="router: instances each node publishes to")
    p.add_argument("--put-usd-per-1k", type=float, default=d.put_usd_per_1k, help="S3 price per 1,000 PUTs")
    p.add_argument("--get-usd-per-1k", type=float, default=d.get_usd_per_1k, help="S3 price per 1,000 GETs")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cal_path = Path(args.calibration)
    if not cal_path.is_absolute() and not cal_path.exists():
        cal_path = REPO / cal_path
    calibration = json.loads(cal_path.read_text())
    fleet = Fleet(
        turns_per_s=args.turns_per_s, first_tokens=args.first_tokens, turn_tokens=args.turn_tokens, turns=args.turns,
        kv_bytes_per_token=args.kv_bytes_per_token, chunk_bytes=int(args.chunk_mib * MIB),
        kvstored_read_share=args.kvstored_read_share, fs_read_share=args.fs_read_share,
        cross_node_share=args.cross_node_share, s3_read_share=args.s3_read_share, ram_bytes=int(args.ram_gib * GIB),
        fs_bytes=int(args.fs_tib * (1 << 40)), s3_tier=not args.no_s3, interval_s=args.interval_s,
        group_chunks=args.group_chunks, replicas=args.replicas, routers=args.routers,
        put_usd_per_1k=args.put_usd_per_1k, get_usd_per_1k=args.get_usd_per_1k,
    )
    budget = Budget(args.cpu_budget, args.memory_budget_gib * GIB)
    costs = Costs.from_calibration(calibration)
    model = Model(fleet, budget, costs)
    machine = calibration.get("machine", {})
    load = calibration.get("load_average", {})
    result = run(model, args.nodes, args.max_nodes)
    puts = model.rates.s3_puts_per_s
    doc: dict[str, Any] = {
        "calibration": {"path": str(cal_path), "created": calibration.get("created"),
                        "cpu_model": machine.get("cpu_model"), "cpus": machine.get("cpus"),
                        "load_average": f"{load.get('start', ['?'])[0]}-{load.get('end', ['?'])[0]}"},
        "fleet": asdict(fleet), "budget": asdict(budget), "costs": asdict(costs), "rates": asdict(model.rates),
        "basis": [{"figure": a, "value": b, "basis": c} for a, b, c in basis(fleet, model.rates, costs)],
        "nodes": args.nodes, "max_nodes": args.max_nodes,
        **result,
        "s3": {"puts_per_s_per_node": puts, "in_flight_puts": puts * costs.s3_put_s,
               "prefixes_at_1000": math.ceil(puts * 1000 / S3_PREFIX_PUTS_PER_S),
               "usd_per_month_at_1000": 1000 * puts * fleet.put_usd_per_1k / 1000 * SECONDS_PER_MONTH},
        "sensitivity": sensitivity(fleet, budget, costs, args.max_nodes),
    }
    print_report(doc, model)
    if args.json:
        write_json(args.json, doc)
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
