"""One read of every tier's usage and counters, shared by the Stats RPC and /metrics; and the
session counts the server hands both (observability reads them, it does not import the server)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstored.io.scheduler import Priority
from kvstored.tiers.base import TierKind
from kvstored.tiers.chain import TierChain


@dataclass(frozen=True)
class SessionCounts:
    sessions: int = 0  # open client sessions
    leases: int = 0  # read leases held by sessions
    reservations: int = 0  # uncommitted reservations held by sessions
    regions: int = 0  # client regions attached


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
    writebacks: int = 0
    dropped_dirty: int = 0
    checksum_failures: int = 0
    bad_entries: int = 0
    errors: int = 0
    rejected_full: int = 0
    rejected_admission: int = 0
    dropped_backpressure: int = 0
    queued: int = 0


@dataclass(frozen=True)
class StagingSnapshot:
    """Staging memory: region loads past a full RAM (tiers/staged.py)."""

    capacity_bytes: int = 0  # 0: off (or no tier below RAM)
    used_bytes: int = 0
    staged_chunks: int = 0  # chunks region loads got from below RAM through it


def staging_snapshot(chain: TierChain) -> StagingSnapshot:
    staged = chain.staged
    if staged is None:
        return StagingSnapshot()
    return StagingSnapshot(staged.staging.capacity_bytes, staged.staging.used_bytes, staged.served)


def tier_snapshots(chain: TierChain) -> list[TierSnapshot]:
    ram, c = chain.ram, chain.ram.counters
    snaps = [
        TierSnapshot(
            name="ram", kind=TierKind.RAM, capacity_bytes=ram.capacity_bytes, used_bytes=ram.used_bytes,
            chunks=ram.chunk_count, lookups=c.lookups, hits=c.hits, evictions=c.evictions,
            stored_chunks=c.stored, loaded_chunks=c.loaded, promotions=c.promotions, writebacks=c.writebacks,
            dropped_dirty=c.dropped_dirty, read_bytes=c.read_bytes, written_bytes=c.written_bytes,
        )
    ]
    for lower in chain.lower:
        tier, tc, usage = lower.tier, lower.tier.counters, lower.tier.usage()
        snaps.append(TierSnapshot(
            name=tier.name, kind=tier.kind, capacity_bytes=usage.capacity_bytes, used_bytes=usage.used_bytes,
            chunks=usage.chunks, lookups=tc.lookups, hits=tc.hits, evictions=tc.evictions,
            stored_chunks=tc.writes, loaded_chunks=tc.reads, read_bytes=tc.read_bytes,
            written_bytes=tc.written_bytes, checksum_failures=tc.checksum_failures, bad_entries=tc.bad_entries,
            errors=tc.errors,
            rejected_full=tc.rejected_full, rejected_admission=tc.rejected_admission,
            # only refused write-downs lose a copy: a refused delete runs directly
            dropped_backpressure=lower.queue.dropped[Priority.WRITEDOWN], queued=sum(lower.queue.backlog.values()),
        ))
    return snaps
