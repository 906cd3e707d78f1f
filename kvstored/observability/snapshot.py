# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What the Stats RPC and /metrics read: every tier's usage and counters (the chain fills a
ChainSnapshot), the session counts the server hands both. Observability reads these; it imports
neither the chain nor the server."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvstored.chunks.ids import TierKind
from kvstored_client.kinds import DropReason

# The reasons the daemon gives for a dropped chunk (Stats, kvstored_store_drops_total's `reason`):
# UNAVAILABLE is the client's own, it never reaches the daemon.
STORE_DROP_REASONS = tuple(r for r in DropReason if r not in (DropReason.NONE, DropReason.UNAVAILABLE))


@dataclass(frozen=True)
class SessionCounts:
    sessions: int = 0  # open client sessions
    leases: int = 0  # read leases held by sessions
    reservations: int = 0  # uncommitted reservations held by sessions
    regions: int = 0  # client regions attached
    ahead_slots: int = 0  # slots reserved ahead of their keys, held by sessions (counted in RAM)


SessionCountsSource = Callable[[], SessionCounts]


@dataclass(frozen=True)
class QuotaUsage:
    """A RAM quota and its use: a tenant's (name: its key) or a namespace's (name: its id)."""

    name: str
    quota_bytes: int
    used_bytes: int
    evictions: int  # chunks evicted to keep within the quota


@dataclass(frozen=True)
class QuotaSnapshot:
    tenants: list[QuotaUsage]  # every tenant holding an arena
    namespaces: list[QuotaUsage]  # every namespace with a quota of its own


QuotaSource = Callable[[], QuotaSnapshot]


@dataclass(frozen=True)
class PeerRow:
    """One peer as this daemon sees it (kvstoredctl peers, /metrics)."""

    address: str
    label: str  # its metrics label: its address for the first 64 peers, else "other"
    state: str  # connecting, up, down, incompatible, self
    transport: str  # "tcp", "ucx" or ""
    incarnation: int
    indexed_chunks: int
    received_bytes: int  # fetched from it
    sent_bytes: int  # served to it
    breaker: str  # closed, open, half_open
    received_chunks: int = 0
    missing_chunks: int = 0
    corrupt_chunks: int = 0
    failed_chunks: int = 0
    timed_out_chunks: int = 0
    fetches: int = 0  # orders sent to it
    refused_by_breaker: int = 0
    events: int = 0
    resyncs: int = 0
    detail: str = ""
    last_seq: int = 0  # of its events, the last one the index reflects


@dataclass(frozen=True)
class DirectoryRow:
    """The fleet directory as this node sees it (kvstored/directory/node.py's counters)."""

    url: str  # password redacted
    breaker: str  # closed, open, half_open
    lag_s: float  # age of the oldest change not yet written
    pending_changes: int
    lookups: int
    lookup_chunks: int
    hit_chunks: int
    errors: int
    timeouts: int
    refused: int
    write_batches: int
    write_commands: int
    write_errors: int
    refreshed: int
    dropped_changes: int
    stale_deleted: int
    connects: int
    found_peers: int  # holders reached because the directory named them
    moved: int  # MOVED replies followed (a slot's owner changed: failover, resharding)
    asked: int  # ASK replies followed (a slot being migrated)
    slot_map_reads: int  # CLUSTER SLOTS reads (at start, after a MOVED or a lost node)
    last_error: str = ""
    shards: tuple[str, ...] = ()  # HOST:PORT of the masters the client knows


@dataclass(frozen=True)
class PeersSnapshot:
    incarnation: int
    peers: list[PeerRow]
    index_entries: int
    index_capacity: int
    index_evictions: int
    leases: int  # serving side: chunks pinned while sent to peers
    reservations: int  # fetching side: slots received into, or quarantined
    served_chunks: int
    served_bytes: int
    refused_chunks: int
    other_sent_bytes: int  # served to fetchers not among the peers
    transports: tuple[str, ...]
    tcp_port: int
    ucx_port: int
    directory: DirectoryRow | None = None


PeersSource = Callable[[], "PeersSnapshot | None"]  # None: no peer tier


@dataclass(frozen=True)
class TierSnapshot:
    name: str
    kind: TierKind
    capacity_bytes: int
    used_bytes: int
    chunks: int
    lookups: int
    hits: int
    evictions: int
    stored_chunks: int
    loaded_chunks: int
    read_bytes: int = 0
    written_bytes: int = 0
    promotions: int = 0
    writedowns: int = 0
    dropped_dirty: int = 0
    checksum_failures: int = 0
    bad_entries: int = 0
    errors: int = 0
    rejected_full: int = 0
    rejected_admission: int = 0
    dropped_backpressure: int = 0
    queued: int = 0
    skipped_slow_hits: int = 0  # hits not reported: loading would be slower than recomputing
    skipped_slow_writedowns: int = 0  # write-downs not done: the tier cannot beat recomputing
    rate_probes: int = 0  # skipped hits promoted (write-downs let through) to measure the tier again
    load_bytes_per_s: float = 0.0  # measured load throughput (0: not yet)
    # packed s3 (kvstored/tiers/base.py PackUsage); 0 and () for the other tiers
    packs: int = 0
    packed_bytes: int = 0
    packed_live_bytes: int = 0
    packs_by_live_quarter: tuple[int, ...] = ()
    packs_written: int = 0
    packs_expired: int = 0
    packs_dropped: int = 0


@dataclass(frozen=True)
class StagingSnapshot:
    """Staging memory: region loads past a full RAM (chain/staged.py)."""

    capacity_bytes: int = 0  # 0: off (or no tier below RAM)
    used_bytes: int = 0
    staged_chunks: int = 0  # chunks region loads got from below RAM through it


@dataclass(frozen=True)
class VerifySnapshot:
    """Adopted chunks' bytes checked after a hand-over (kvstored/chain/verify.py)."""

    unverified_chunks: int = 0  # not yet checked (the sweep or its first read will)
    verified_chunks: int = 0  # checked and matching (the others count as RAM checksum failures)
    verified_bytes: int = 0


@dataclass(frozen=True)
class ChainSnapshot:
    """One read of the tier chain, filled by the chain (kvstored/chain/stats.py)."""

    tiers: list[TierSnapshot]  # RAM first, then the tiers below in order
    staging: StagingSnapshot
    ram_resident_bytes: int  # memory the RAM tier's arenas hold
    store_drops: dict[DropReason, int] = field(default_factory=dict)  # chunks stores dropped, by reason
    verify: VerifySnapshot = field(default_factory=VerifySnapshot)
    ram_held_bytes: int = 0  # kept for clients of sessions a hand-over ended (server/held_writes.py)


ChainSource = Callable[[], ChainSnapshot]
