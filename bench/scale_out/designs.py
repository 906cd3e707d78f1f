# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The five designs and what each costs a node at a node count."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from bench.lib.report import GIB
from bench.scale_out.fleet import HEADER_BYTES_PER_SEGMENT, MSS, SECONDS_PER_MONTH, Budget, Costs, Fleet, Rates

Parts = dict[str, float]
Traffic = tuple[float, float, float]  # bytes, messages and keys a second
NO_TRAFFIC = (0.0, 0.0, 0.0)


@dataclass
class Point:
    """One design at one node count, per node."""

    nodes: int
    cpu_fraction: float  # of one core
    cpu_parts: Parts
    memory_bytes: float
    memory_parts: Parts
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

    @cached_property
    def rates(self) -> Rates:
        return Rates.of(self.fleet, self.costs)

    def wire_bytes(self, messages: float, keys: float, segments: float | None = None) -> float:
        c = self.costs
        payload = messages * c.bytes_per_event + keys * c.bytes_per_key
        segs = segments if segments is not None else max(messages, payload / MSS)
        return payload + segs * HEADER_BYTES_PER_SEGMENT

    def s3(self, coverage: float) -> tuple[float, float, float]:
        """PUTs/s, GETs/s and $ per month of one node: cross-node reads its index cannot place go to S3."""
        r, f = self.rates, self.fleet
        puts = r.s3_puts_per_s
        gets = r.s3_base_gets_per_s + (r.peer_fetches_per_s * (1 - coverage) if f.s3_tier else 0.0)
        return puts, gets, (puts * f.put_usd_per_1k + gets * f.get_usd_per_1k) / 1000 * SECONDS_PER_MONTH

    def local_lookup_s(self) -> float:
        return self.costs.lookup_fixed_s + self.rates.looked_up_chunks_per_turn * self.costs.lookup_s_per_key

    def index(self, nodes: int, entries: float, bytes_per_entry: float) -> tuple[float, float]:
        """The bytes of an index of `entries`, and the share of them the memory budget holds beside
        the node's streams (to each of its peers)."""
        room = max(0.0, self.budget.memory_bytes - 2 * (nodes - 1) * self.costs.stream_bytes) / bytes_per_entry
        return entries * bytes_per_entry, min(1.0, room / entries) if entries else 1.0

    def point(
        self, nodes: int, cpu: Parts, memory: Parts, inbound: Traffic, lookup_s: float, entries: float, coverage: float
    ) -> Point:
        cpu_sum, memory_sum = sum(cpu.values()), sum(memory.values())
        return Point(
            nodes, cpu_sum, cpu, memory_sum, memory, *inbound, lookup_s * 1e3, entries, coverage, *self.s3(coverage)
        )

    def mesh(self, nodes: int) -> Point:
        r = self.rates
        return self._full_mesh(nodes, r.events_per_s, r.keys_per_s, r.events_per_s * self.costs.segments_per_event)

    def coalesced(self, nodes: int) -> Point:
        return self._full_mesh(
            nodes, self.costs.messages_per_interval / self.fleet.interval_s, self.rates.net_keys_per_s
        )

    def _full_mesh(self, nodes: int, messages: float, keys: float, segments: float | None = None) -> Point:
        """Every node follows every other: `messages` and `keys` a second from each peer (the mesh as
        built: every event; coalesced: the net changes once per interval)."""
        c = self.costs
        peers = nodes - 1
        mean_slot = max(0.0, (nodes - 2) / 2)  # holders' slots spread over the peers
        per_key = c.follow_s_per_key + c.follow_s_per_key_per_slot * mean_slot
        m = c.index_bytes_per_entry + c.index_bytes_per_slot * mean_slot
        entries = peers * self.rates.chunks_held  # a full view: every peer's chunks
        index, coverage = self.index(nodes, entries, m)
        cpu = {
            "follow": peers * (messages * c.follow_s_per_event + keys * per_key),
            "publish": peers * (messages * c.publish_s_per_event + keys * c.publish_s_per_key),
            "streams": 2 * peers * c.stream_idle_s_per_s,
        }
        memory = {"index": index, "streams": 2 * peers * c.stream_bytes}
        inbound = (peers * self.wire_bytes(messages, keys, segments), peers * messages, peers * keys)
        lookup = self.local_lookup_s() + peers * c.contains_s_per_peer
        return self.point(nodes, cpu, memory, inbound, lookup, entries, coverage)

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
        index, coverage = self.index(nodes, entries, c.index_bytes_per_entry)
        memory = {"index": index, "streams": 2 * peers * c.stream_bytes}
        lookup = self.local_lookup_s() + (
            c.remote_lookup_s + r.lookup_groups_per_turn * nodes * c.rendezvous_s_per_node if peers else 0.0
        )
        inbound = (self.wire_bytes(messages, keys_in), messages, keys_in)
        return self.point(nodes, cpu, memory, inbound, lookup, entries, coverage)

    def redis_tier(self, nodes: int) -> dict[str, float]:
        """The Redis Cluster a fleet's directory takes: its load, memory and the masters it needs
        (each within --redis-shard-cpu of a core and --redis-shard-gib)."""
        c, r, f = self.costs, self.rates, self.fleet
        # per node: the heartbeat; a net change stored is HSET + PEXPIRE, one dropped an HDEL (about
        # half each); the refresh pass re-writes every chunk held once per TTL / 2
        writes = 1 / c.dir_interval_s + r.net_keys_per_s * (c.dir_commands_per_key + 1) / 2
        writes += r.refresh_keys_per_s * c.dir_commands_per_key
        asked = f.turns_per_s * r.directory_keys_per_turn
        cores = nodes * (writes * c.redis_s_per_command + asked * c.redis_s_per_lookup_key)
        entries = nodes * r.chunks_held
        master_bytes = entries * c.redis_bytes_per_entry
        shards = max(1, math.ceil(cores / f.redis_shard_cpu), math.ceil(master_bytes / (f.redis_shard_gib * GIB)))
        return {
            "nodes": nodes,
            "commands_per_s": nodes * writes,
            "lookup_keys_per_s": nodes * asked,
            "ops_per_s": nodes * (writes + asked),
            "cores": cores,
            "entries": entries,
            "memory_bytes": master_bytes * (1 + f.redis_replicas),
            "masters": shards,
            "processes": shards * (1 + f.redis_replicas),
            "master_memory_bytes": master_bytes / shards,
            "master_cores": cores / shards,
        }

    def redis_directory(self, nodes: int) -> Point:
        c, r, f = self.costs, self.rates, self.fleet
        if nodes < 2:
            return self.point(nodes, {}, {"index": 0.0}, NO_TRAFFIC, self.local_lookup_s(), 0.0, 1.0)
        touched = min(f.directory_buckets, int(self.redis_tier(nodes)["masters"]))
        # a lookup's pipeline goes to each master its keys' buckets live on: the fixed cost measured
        # with the calibration's masters, plus the measured cost per further master (without that
        # figure, the fixed cost scaled by the masters: an upper bound)
        measured = min(f.directory_buckets, int(c.dir_measured_shards))
        if c.dir_lookup_s_per_master:
            per_lookup = c.dir_lookup_s + (touched - measured) * c.dir_lookup_s_per_master
        else:
            per_lookup = c.dir_lookup_s * touched / measured
        keys = r.directory_keys_per_turn
        cpu = {
            "heartbeat": c.dir_heartbeat_s_per_interval / c.dir_interval_s,
            "writes": (r.net_keys_per_s + r.refresh_keys_per_s) * c.dir_write_s_per_key,
            "lookups": f.turns_per_s * (per_lookup + keys * c.dir_lookup_s_per_key),
        }
        memory = {"index": 0.0, "client": c.dir_client_bytes}  # (no index of the others)
        # replies: a few bytes per command and per key asked (no holder: empty), a segment per master
        # per interval and per lookup
        commands = 1 / c.dir_interval_s + (r.net_keys_per_s + r.refresh_keys_per_s) * c.dir_commands_per_key
        segments = (1 / c.dir_interval_s + f.turns_per_s) * touched
        inbound = (4 * (commands + f.turns_per_s * keys) + segments * HEADER_BYTES_PER_SEGMENT, segments, 0.0)
        lookup = self.local_lookup_s() + c.dir_lookup_added_s + keys * c.dir_lookup_added_s_per_key
        return self.point(nodes, cpu, memory, inbound, lookup, 0.0, 1.0)

    def router(self, nodes: int) -> Point:
        c, r, f = self.costs, self.rates, self.fleet
        messages = 1 / f.interval_s
        cpu = {
            "publish": f.routers * (messages * c.publish_s_per_event + r.net_keys_per_s * c.publish_s_per_key),
            "streams": f.routers * c.stream_idle_s_per_s,
        }
        memory = {"index": 0.0, "streams": f.routers * c.stream_bytes}
        return self.point(nodes, cpu, memory, NO_TRAFFIC, self.local_lookup_s(), 0.0, 1.0)

    def router_tier(self, nodes: int) -> dict[str, float]:
        """What the router tier takes in for the whole fleet (our per-event and per-key costs and
        bytes per entry as a stand-in for the router's own)."""
        c, r, f = self.costs, self.rates, self.fleet
        messages = nodes / f.interval_s
        keys = nodes * r.net_keys_per_s
        entries = nodes * r.chunks_held
        return {
            "nodes": nodes,
            "messages_per_s": messages,
            "keys_per_s": keys,
            "cores": messages * c.follow_s_per_event + keys * c.follow_s_per_key,
            "index_entries": entries,
            "index_bytes": entries * c.index_bytes_per_entry,
            "inbound_bytes_per_s": self.wire_bytes(messages, keys),
        }


@dataclass(frozen=True)
class Design:
    key: str
    label: str
    point: Callable[[int], Point]
    how: str


def designs(m: Model) -> list[Design]:
    """The designs (`how`: in a line; docs/scale-out.md has them in full)."""
    return [
        Design("mesh", "mesh (as built)", m.mesh, "every node follows every other's events, one message per event"),
        Design("coalesced", "coalesced mesh", m.coalesced, "a full index; net changes once per interval per peer"),
        Design("directory", "rendezvous directory", m.directory, "rendezvous-hashed owners of chunk groups"),
        Design("redis", "Redis Cluster directory (as built)", m.redis_directory, "net changes to a Redis Cluster"),
        Design("router", "router (llm-d KV events)", m.router, "net changes to a router that routes turns"),
    ]


def exceeds(p: Point, budget: Budget) -> str:
    if p.cpu_fraction > budget.cpu_fraction:
        return "cpu"
    return "memory" if p.memory_bytes > budget.memory_bytes else ""


def break_point(design: Design, budget: Budget, max_nodes: int) -> dict[str, Any] | None:
    """The fewest nodes at which the design exceeds the budget (its costs grow with the node count:
    a binary search), or None up to max_nodes."""
    if not exceeds(design.point(max_nodes), budget):
        return None
    lo, hi = 1, max_nodes  # lo within the budget (one node has no peers), hi over it
    if exceeds(design.point(lo), budget):
        hi = lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if exceeds(design.point(mid), budget) else (mid, hi)
    p = design.point(hi)
    return {"nodes": hi, "resource": exceeds(p, budget), "cpu_fraction": p.cpu_fraction, "memory_bytes": p.memory_bytes}


def plot_nodes(max_nodes: int) -> list[int]:
    out = sorted({max(1, round(10 ** (i / 20))) for i in range(int(20 * math.log10(max_nodes)) + 1)} | {max_nodes})
    return [n for n in out if n <= max_nodes]
