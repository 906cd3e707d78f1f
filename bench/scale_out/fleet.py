# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The modelled fleet, its budget, the measured costs and the rates they give."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from bench.lib.report import GIB, MIB, REPO
from kvstored.chunks.chunkfile import HEADER_BYTES

DEFAULT_CALIBRATION = REPO / "docs" / "scale-out-calibration.json"
SECONDS_PER_MONTH = 30 * 86_400
HEADER_BYTES_PER_SEGMENT = 66  # on a real network: IPv4 20 + TCP 32 (timestamps) + Ethernet 14
MSS = 1448  # payload bytes per segment at a 1500-byte MTU
S3_PREFIX_PUTS_PER_S = 3500  # AWS: PUT/COPY/POST/DELETE per second per partitioned prefix


# -- what is modelled, and the budget -----------------------------------------------------------------


def flag(default: Any, text: str) -> Any:
    """A Fleet field and the help of its flag (cli.py: --x-y sets x_y)."""
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class Fleet:
    """The workload of one GPU node and what it holds (defaults: bench/multiturn.py's workload), each
    field a flag of bench.scale_out."""

    turns_per_s: float = flag(10.0, "turns per GPU node per second")
    first_tokens: int = flag(12 * 1024, "tokens of a conversation's first prompt")
    turn_tokens: int = flag(4 * 1024, "tokens each later turn adds")
    turns: int = flag(8, "turns per conversation")
    kv_bytes_per_token: int = flag(20_480, "KV bytes per token (Qwen3.6-35B-A3B: 20,480; Llama-3.1-8B: 131,072)")
    chunk_bytes: int = flag(2 * MIB, "chunk size")
    kvstored_read_share: float = flag(
        0.5, "share of a turn's reusable chunks loaded from kvstored (the GPU has the rest)"
    )
    fs_read_share: float = flag(
        0.3, "share of kvstored reads served by the node's own fs tier (each promotion is an event)"
    )
    cross_node_share: float = flag(0.1, "share of turns sent to a node other than the one holding the conversation")
    s3_read_share: float = flag(0.01, "share of kvstored reads only S3 can serve")
    ram_bytes: int = flag(100 * GIB, "each node's RAM tier")  # (what its peers may fetch from: RAM and fs)
    fs_bytes: int = flag(2 << 40, "each node's fs tier (0: not indexed)")
    # RAM -> fs -> peer -> s3: every write-down also goes to S3 (a PUT, and an event)
    s3_tier: bool = flag(True, "no S3 tier below the peers")  # (the flag: --no-s3)
    pack_bytes: int = flag(32 * MIB, "the S3 tier's pack_bytes (0: one object per chunk)")
    interval_s: float = flag(0.1, "coalesced mesh, directory, router: one message per destination per interval")
    group_chunks: int = flag(32, "directory: consecutive chunks of a chain owned together")
    replicas: int = flag(1, "directory: owners per chunk group")
    routers: int = flag(1, "router: instances each node publishes to")
    redis_replicas: int = flag(1, "Redis Cluster directory: replicas per master")
    # (Redis runs commands on one core)
    redis_shard_cpu: float = flag(0.5, "Redis Cluster directory: a master's CPU budget, share of one core")
    redis_shard_gib: float = flag(25.0, "Redis Cluster directory: a master's memory budget")
    directory_entry_ttl_s: float = flag(
        1800.0, "Redis Cluster directory: entry TTL (every chunk re-written once per TTL / 2)"
    )
    directory_buckets: int = flag(
        16, "Redis Cluster directory: hash-tag buckets (the masters a lookup touches, at most)"
    )
    # S3 Standard, us-east-1 list prices: PUT (COPY, POST, LIST), GET (SELECT)
    put_usd_per_1k: float = flag(0.005, "S3 price per 1,000 PUTs")
    get_usd_per_1k: float = flag(0.0004, "S3 price per 1,000 GETs")

    @property
    def chunks_per_put(self) -> int:  # (a pack's records carry a chunk file header each)
        return max(1, self.pack_bytes // (self.chunk_bytes + HEADER_BYTES))

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
    # a coalesced stream's messages per interval (one per kind of change), measured; 1 where not
    messages_per_interval: float = 1.0
    # The Redis Cluster directory (bench/scale_calibrate/directory.py; zeros where not measured).
    dir_interval_s: float = 0.5  # the calibration's directory_interval_s
    dir_heartbeat_s_per_interval: float = 0.0  # the node's CPU: heartbeat and an empty batch
    dir_write_s_per_key: float = 0.0  # the node's CPU per chunk written
    dir_commands_per_key: float = 2.0  # HSET + PEXPIRE per chunk stored (HDEL: 1 per chunk dropped)
    dir_lookup_s: float = 0.0  # the node's CPU per lookup asked of the directory ...
    dir_lookup_s_per_key: float = 0.0  # ... and per key in it ...
    dir_lookup_s_per_master: float = 0.0  # ... and per master its keys live on beyond the calibration's
    dir_lookup_added_s: float = 0.0  # what asking adds to a Lookup's latency ...
    dir_lookup_added_s_per_key: float = 0.0
    dir_client_bytes: float = 0.0  # the node's memory for the directory client (its code, its connections)
    redis_s_per_command: float = 0.0  # Redis's CPU per write command (its replicas' included)
    redis_s_per_lookup_key: float = 0.0  # ... per key asked (HGETALL)
    redis_bytes_per_entry: float = 0.0  # a master's memory per chunk entry
    dir_measured_shards: float = 3  # masters of the calibration's cluster
    dir_client_s_per_key: float = 0.0  # a chunk's HSET + PEXPIRE through the daemon's client alone ...
    dir_redis_py_s_per_key: float = 0.0  # ... through redis-py's cluster pipeline (the baseline) ...
    dir_raw_resp_s_per_key: float = 0.0  # ... and as raw RESP packed by hiredis (the floor)

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
            messages_per_interval=doc.get("coalescing", {}).get("coalesced_messages_per_interval", 1.0),
            **directory_costs(doc.get("directory")),
        )


def directory_costs(d: dict[str, Any] | None) -> dict[str, float]:
    if not d:
        return {}
    idle, w, look, clients = d["idle"], d["writes"], d["lookups"], d.get("clients", {})
    return {
        "dir_interval_s": d["interval_s"],
        "dir_heartbeat_s_per_interval": idle["heartbeat_cpu_s_per_interval"],
        "dir_write_s_per_key": w["daemon_cpu_s_per_key"],
        "dir_commands_per_key": w["commands_per_key"],
        "dir_lookup_s": look["daemon_cpu_s_per_lookup"],
        "dir_lookup_s_per_key": look["daemon_cpu_s_per_key"],
        "dir_lookup_added_s": look["added_ms_per_lookup"] * 1e-3,
        "dir_lookup_added_s_per_key": look["added_ms_per_key"] * 1e-3,
        "dir_client_bytes": max(0.0, idle["client_rss_bytes"]),
        "redis_s_per_command": w["redis_cpu_s_per_command"],
        "redis_s_per_lookup_key": look["redis_cpu_s_per_key"],
        "redis_bytes_per_entry": w["redis_bytes_per_entry"],
        "dir_lookup_s_per_master": clients.get("lookup_cpu_s_per_master", 0.0),
        "dir_client_s_per_key": clients.get("client_cpu_s_per_key", 0.0),
        "dir_redis_py_s_per_key": clients.get("redis_py_cpu_s_per_key", 0.0),
        "dir_raw_resp_s_per_key": clients.get("raw_resp_cpu_s_per_key", 0.0),
    }


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
    directory_keys_per_turn: float  # Redis directory: a turn's local misses, asked once
    refresh_keys_per_s: float  # ... every chunk held re-written once per entry TTL / 2
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
            stored_chunks_per_turn=stored,
            looked_up_chunks_per_turn=looked_up,
            stores_per_s=stores,
            reads_per_s=reads,
            fs_promotions_per_s=promotions,
            peer_fetches_per_s=fetched,
            events_per_s=events,
            keys_per_s=keys,
            single_key_events_per_s=single,
            net_keys_per_s=net,
            groups_changed_per_s=net / run,
            lookup_groups_per_turn=math.ceil(looked_up / f.group_chunks),
            chunks_held=(f.ram_bytes + f.fs_bytes) / f.chunk_bytes,
            # the new tail misses everywhere; a turn on another node than its conversation's misses all
            directory_keys_per_turn=stored + f.cross_node_share * looked_up,
            refresh_keys_per_s=(f.ram_bytes + f.fs_bytes) / f.chunk_bytes / (f.directory_entry_ttl_s / 2),
            s3_puts_per_s=lives / f.chunks_per_put if f.s3_tier else 0.0,  # every write-down goes to fs and S3
            s3_base_gets_per_s=reads * f.s3_read_share if f.s3_tier else 0.0,
        )
