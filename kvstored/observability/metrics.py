# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Prometheus metrics of one daemon, in a registry of its own (tests run several daemons).

Counters and gauges the tiers already keep are not counted twice: `KvstoredCollector` reads
the chain's snapshot (the same read the Stats RPC makes) at scrape time. Only what nobody
else records is observed here: gRPC calls and their latency (`GrpcMetricsInterceptor`), and
secondary-tier operation latency (`DaemonMetrics.observe_tier_op`, for the tier chain to call).

Names follow the Prometheus conventions: `kvstored_` prefix, base units (`_bytes`, `_seconds`),
`_total` on counters. Label cardinality is bounded: `tier` and `kind` by the configured tiers,
`reason` and `op` by fixed lists, `service`/`method`/`code` by the registered gRPC handlers and
the status codes, `namespace` by MAX_NAMESPACE_SERIES (and, for quotas, only namespaces that have one),
`tenant` (its arena id: never anything derived from its salt) by MAX_TENANT_SERIES, the tenants
using the most RAM, `peer` (its address) by kvstored.peer.membership.MAX_PEER_LABELS: the first 64
peers found, the rest summed under peer="other" (with, for bytes sent, fetchers that are not
among the peers).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Iterable, Iterator

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from kvstored import __version__
from kvstored.chunks.ids import TierKind
from kvstored.namespaces import NamespaceRegistry
from kvstored.observability.snapshot import (
    STORE_DROP_REASONS,
    ChainSource,
    DirectoryRow,
    PeerRow,
    PeersSnapshot,
    PeersSource,
    QuotaSnapshot,
    QuotaSource,
    QuotaUsage,
    SessionCountsSource,
    TierSnapshot,
)

PREFIX = "kvstored"

# Why a chunk was not kept where it was headed; the `reason` label of kvstored_tier_drops_total.
DROP_REASONS: dict[str, str] = {
    "backpressure": "dropped_backpressure",  # the tier's write-down queue was full
    "admission": "rejected_admission",  # the tier's admission policy said no
    "disk_full": "rejected_full",  # the tier is out of space
    "error": "errors",  # an I/O or remote error
    "dirty_eviction": "dropped_dirty",  # RAM evicted a chunk with no copy below
}

# The `band` label of kvstored_tier_packs_by_live_fraction: TierStats.packs_by_live_quarter's order.
LIVE_BANDS = ("0-25%", "25-50%", "50-75%", "75-100%")

# Secondary-tier operations whose latency the tier chain reports (`op` label).
TIER_OPS = ("lookup", "read", "write", "remove")

# Unary gRPC over a unix socket takes ~0.4 ms; secondary tiers range from NVMe to S3.
GRPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TIER_OP_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

MAX_NAMESPACE_SERIES = 64  # kvstored_namespace_info series at most; the rest are only counted
MAX_TENANT_SERIES = 32  # per-tenant series for the tenants using the most RAM; the rest are only counted

TierOpObserver = Callable[[str, str, float], None]


class KvstoredCollector(Collector):
    """Everything the daemon already counts, read once per scrape."""

    def __init__(
        self,
        chain: ChainSource,
        sessions: SessionCountsSource,
        namespaces: NamespaceRegistry,
        quotas: QuotaSource,
        peers: PeersSource = lambda: None,
    ) -> None:
        self._chain = chain
        self._sessions = sessions
        self._namespaces = namespaces
        self._quotas = quotas
        self._peers = peers

    def collect(self) -> Iterator:
        chain = self._chain()
        yield from tier_families(chain.tiers)
        yield from self._daemon_families()
        yield _gauge(
            "ram_resident_bytes",
            "memory the RAM tier's arenas hold (chunks, and free pages kept for "
            "reuse); free pages beyond a small slack go back to the kernel",
            chain.ram_resident_bytes,
        )
        yield _gauge(
            "ram_held_bytes",
            "RAM kept from use after a hand-over: the slots of ended sessions whose clients may still "
            "be copying into them, and the chunks they had leased, until each client is done, exits, "
            "or 60 s pass",
            chain.ram_held_bytes,
        )
        yield _gauge(
            "ram_unverified_chunks",
            "chunks adopted from a hand-over whose bytes are not yet checked against their checksum "
            "(a background sweep and each chunk's first read check them; 0 once done)",
            chain.verify.unverified_chunks,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_ram_verified_chunks",
            "adopted chunks whose bytes matched their hand-over checksum (those that did not are "
            "the RAM tier's checksum failures: dropped, never served)",
            value=chain.verify.verified_chunks,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_ram_verified_bytes", "bytes of the verified adopted chunks", value=chain.verify.verified_bytes
        )
        staging = chain.staging
        yield _gauge(
            "staging_capacity_bytes",
            "memory for region loads past a full RAM (staging_bytes; 0: off)",
            staging.capacity_bytes,
        )
        yield _gauge("staging_used_bytes", "staging memory holding chunks read for region loads", staging.used_bytes)
        yield CounterMetricFamily(
            f"{PREFIX}_staged_chunks",
            "chunks region loads got from a tier below RAM "
            "through staging (RAM had no free room: nothing evicted for them)",
            value=staging.staged_chunks,
        )
        drops = CounterMetricFamily(
            f"{PREFIX}_store_drops",
            "chunks stores did not store, by reason: ram_full, quota_full (RAM or the quota held by "
            "leased, reserved and being-written-down chunks), in_progress (another writer), "
            "not_visible (a tenant namespace the session did not register)",
            labels=["reason"],
        )
        for reason in STORE_DROP_REASONS:
            drops.add_metric([reason.label], chain.store_drops.get(reason, 0))
        yield drops
        yield from quota_families(self._quotas())
        peers = self._peers()
        if peers is not None:
            yield from peer_families(peers)

    def _daemon_families(self) -> Iterator:
        info = InfoMetricFamily(f"{PREFIX}_build", "kvstored build information")
        info.add_metric([], {"version": __version__})
        yield info
        counts = self._sessions()
        yield _gauge("sessions", "open client sessions", counts.sessions)
        yield _gauge("leases", "outstanding read leases (chunks pinned in RAM for a reader)", counts.leases)
        yield _gauge("reservations", "outstanding uncommitted reservations (chunks being written)", counts.reservations)
        yield _gauge(
            "ahead_slots", "slots reserved ahead of their keys, held by sessions (RAM in use)", counts.ahead_slots
        )
        yield _gauge("regions", "client shared-memory regions attached", counts.regions)
        yield _gauge("namespaces", "registered namespaces", len(self._namespaces))
        ns_info = InfoMetricFamily(
            f"{PREFIX}_namespace",
            f"registered public namespaces (the first {MAX_NAMESPACE_SERIES}): id -> model, dtype, chunk size",
            labels=["namespace", "model", "dtype", "chunk_bytes"],
        )
        # Tenant namespaces are not named: whoever reaches /metrics must learn nothing of them.
        for ns in [ns for ns in self._namespaces.all() if not ns.private][:MAX_NAMESPACE_SERIES]:
            ns_info.add_metric([ns.namespace_id, ns.model, ns.dtype, str(ns.chunk_bytes)], {})
        yield ns_info


def quota_families(snap: QuotaSnapshot) -> Iterator:
    """Tenants' and namespaces' RAM quotas: the MAX_TENANT_SERIES tenants using the most RAM, and
    the MAX_NAMESPACE_SERIES namespaces with a quota using the most."""
    yield _gauge(
        "tenants",
        "tenants holding an arena (a session registered one of their namespaces, or their chunks are in RAM)",
        len(snap.tenants),
    )
    for label, series, cap in (
        ("tenant", snap.tenants, MAX_TENANT_SERIES),
        ("namespace", snap.namespaces, MAX_NAMESPACE_SERIES),
    ):
        top: list[QuotaUsage] = sorted(series, key=lambda u: -u.used_bytes)[:cap]
        quota = GaugeMetricFamily(
            f"{PREFIX}_{label}_quota_bytes", f"RAM quota of the {label} (the {cap} using the most RAM)", labels=[label]
        )
        used = GaugeMetricFamily(
            f"{PREFIX}_{label}_ram_bytes", f"RAM the {label}'s chunks hold (the {cap} using the most)", labels=[label]
        )
        evictions = CounterMetricFamily(
            f"{PREFIX}_{label}_quota_evictions",
            f"chunks of the {label} evicted to keep it within its quota (the {cap} using the most RAM)",
            labels=[label],
        )
        for u in top:
            quota.add_metric([u.name], u.quota_bytes)
            used.add_metric([u.name], u.used_bytes)
            evictions.add_metric([u.name], u.evictions)
        yield from (quota, used, evictions)


PEER_STATES = ("connecting", "up", "down", "incompatible", "self")
PEER_OUTCOMES = {  # outcome label -> PeerRow field
    "received": "received_chunks",
    "missing": "missing_chunks",
    "corrupt": "corrupt_chunks",
    "failed": "failed_chunks",
    "timed_out": "timed_out_chunks",
    "breaker_open": "refused_by_breaker",
}
PEER_COUNTERS = {  # metric (without kvstored_peer_ and _total) -> (PeerRow field, help)
    "received_bytes": ("received_bytes", "chunk bytes fetched from the peer (verified)"),
    "sent_bytes": (
        "sent_bytes",
        'chunk bytes served to the peer ("other" also counts fetchers that are not among the peers)',
    ),
    "fetches": ("fetches", "orders sent to the peer (one batch of chunks each)"),
    "events": ("events", "the peer's KV events applied to the remote-location index"),
    "resyncs": ("resyncs", "snapshots taken of the peer (first contact, a restart, events no longer buffered)"),
}


def peer_families(snap: PeersSnapshot) -> Iterator:
    """The peer tier: per peer (label `peer`, at most MAX_PEER_LABELS values plus "other"), the
    index, and what is leased to or received from peers."""
    by_label: dict[str, list[PeerRow]] = {}
    for row in snap.peers:
        by_label.setdefault(row.label, []).append(row)
    states = GaugeMetricFamily(f"{PREFIX}_peers", "peers by state", labels=["state"])
    for state in PEER_STATES:
        states.add_metric([state], sum(1 for row in snap.peers if row.state == state))
    up = GaugeMetricFamily(
        f"{PREFIX}_peer_up",
        '1 when the peer is up (handshake done, its events followed; "other": how many are)',
        labels=["peer"],
    )
    breaker = GaugeMetricFamily(
        f"{PREFIX}_peer_breaker_open",
        '1 while the peer\'s breaker is open or probing: its chunks are misses ("other": how many are)',
        labels=["peer"],
    )
    indexed = GaugeMetricFamily(
        f"{PREFIX}_peer_indexed_chunks", "chunks the remote-location index says the peer holds", labels=["peer"]
    )
    chunks = CounterMetricFamily(
        f"{PREFIX}_peer_fetched_chunks",
        "chunks asked of the peer, by outcome: "
        "received, missing (a stale index entry), corrupt, failed, timed_out, "
        "breaker_open (not asked: its breaker was open)",
        labels=["peer", "outcome"],
    )
    counters = {
        name: CounterMetricFamily(f"{PREFIX}_peer_{name}", doc, labels=["peer"])
        for name, (_, doc) in PEER_COUNTERS.items()
    }
    for label, rows in by_label.items():
        up.add_metric([label], sum(1 for row in rows if row.state == "up"))
        breaker.add_metric([label], sum(1 for row in rows if row.breaker != "closed"))
        indexed.add_metric([label], sum(row.indexed_chunks for row in rows))
        for outcome, field in PEER_OUTCOMES.items():
            chunks.add_metric([label, outcome], sum(getattr(row, field) for row in rows))
        for name, (field, _) in PEER_COUNTERS.items():
            extra = snap.other_sent_bytes if name == "sent_bytes" and label == "other" else 0
            counters[name].add_metric([label], sum(getattr(row, field) for row in rows) + extra)
    if snap.other_sent_bytes and "other" not in by_label:
        counters["sent_bytes"].add_metric(["other"], snap.other_sent_bytes)
    yield from (states, up, breaker, indexed, chunks, *counters.values())
    yield _gauge("peer_index_entries", "chunks in the remote-location index (all peers)", snap.index_entries)
    yield _gauge(
        "peer_index_capacity", "most chunks the remote-location index holds (index_entries)", snap.index_capacity
    )
    yield CounterMetricFamily(
        f"{PREFIX}_peer_index_evictions",
        "index entries dropped to stay within its capacity",
        value=snap.index_evictions,
    )
    yield _gauge("peer_leases", "chunks pinned in RAM while they are sent to peers", snap.leases)
    yield _gauge(
        "peer_reservations", "RAM slots peer fetches are receiving into (or that stay quarantined)", snap.reservations
    )
    yield CounterMetricFamily(f"{PREFIX}_peer_served_chunks", "chunks sent to peers", value=snap.served_chunks)
    yield CounterMetricFamily(f"{PREFIX}_peer_served_bytes", "chunk bytes sent to peers", value=snap.served_bytes)
    yield CounterMetricFamily(
        f"{PREFIX}_peer_refused_chunks",
        "chunks peers asked for that were not here (or not theirs to have: tenant namespaces)",
        value=snap.refused_chunks,
    )
    if snap.directory is not None:
        yield from directory_families(snap.directory)


DIRECTORY_COUNTERS = {  # metric (without kvstored_directory_ and _total) -> (DirectoryRow field, help)
    "lookups": ("lookups", "lookups asked of the fleet directory (one round trip, two when heartbeats are due)"),
    "lookup_chunks": ("lookup_chunks", "chunks asked of the directory (those local tiers and the mesh missed)"),
    "hit_chunks": ("hit_chunks", "chunks the directory named a live holder of"),
    "errors": ("errors", "directory lookups that failed (unreachable, an error reply): misses"),
    "timeouts": ("timeouts", "directory lookups past directory_timeout_s: misses"),
    "refused": ("refused", "directory lookups not tried, its breaker open: misses"),
    "write_batches": ("write_batches", "pipelined write batches (one per interval while reachable)"),
    "write_commands": ("write_commands", "commands written to the directory (heartbeat, HSET/PEXPIRE, HDEL)"),
    "write_errors": ("write_errors", "write batches that failed (kept for the next interval)"),
    "refreshed_chunks": ("refreshed", "chunks re-written by the refresh pass (TTL renewal, after an outage)"),
    "dropped_changes": ("dropped_changes", "changes not kept while the directory was away (a refresh covers them)"),
    "stale_deleted": ("stale_deleted", "fields of dead, restarted or mistaken holders deleted"),
    "moved": ("moved", "MOVED replies followed: a slot's owner changed (failover, resharding)"),
    "asked": ("asked", "ASK replies followed: a slot being migrated"),
    "slot_map_reads": ("slot_map_reads", "cluster slot maps read (at start, after a MOVED or a lost node)"),
    "connects": ("connects", "connections opened to the cluster's nodes (two per master; again after an outage)"),
}


def directory_families(row: DirectoryRow) -> Iterator:
    """The fleet directory (kvstored/directory/): lookups, writes, lag, its breaker."""
    yield _gauge(
        "directory_breaker_open", "1 while the directory's breaker is open or probing", row.breaker != "closed"
    )
    yield _gauge("directory_lag_seconds", "age of the oldest change not yet in the directory", row.lag_s)
    yield _gauge("directory_pending_changes", "net changes waiting for the next write", row.pending_changes)
    yield _gauge("directory_found_peers", "holders reached because the directory named them", row.found_peers)
    for name, (field, doc) in DIRECTORY_COUNTERS.items():
        yield CounterMetricFamily(f"{PREFIX}_directory_{name}", doc, value=getattr(row, field))


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", documentation, value=value)


def tier_families(snaps: Iterable[TierSnapshot]) -> list:
    """The per-tier metric families of one snapshot (labels: tier, kind)."""
    labels = ["tier", "kind"]

    def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"{PREFIX}_tier_{name}", doc, labels=labels + list(extra))

    def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
        return CounterMetricFamily(f"{PREFIX}_tier_{name}", doc, labels=labels + list(extra))

    capacity = gauge("capacity_bytes", "tier capacity (0: unbounded)")
    used = gauge("used_bytes", "bytes the tier's chunks occupy")
    utilization = gauge("utilization_ratio", "used / capacity (bounded tiers only)")
    chunks = gauge("chunks", "chunks held")
    queued = gauge("queued_operations", "operations waiting in the tier's I/O queue (secondary tiers)")
    load_rate = gauge(
        "load_rate_bytes_per_second", "measured load throughput, bytes per busy second (secondary tiers; 0: not yet)"
    )
    skipped_hits = counter(
        "skipped_slow_hits", "hits not reported because loading them would be slower than recomputing (chunks)"
    )
    skipped_writedowns = counter(
        "skipped_slow_writedowns", "write-downs not done because this tier cannot beat recomputing (chunks)"
    )
    rate_probes = counter(
        "rate_probes", "skipped hits promoted, or write-downs let through, to measure a tier skipped as slow again"
    )
    lookups = counter("lookups", "keys looked up in this tier")
    hits = counter("hits", "lookups that found the chunk in this tier")
    misses = counter("misses", "lookups that did not find the chunk in this tier")
    stored = counter("stored_chunks", "chunks written into this tier")
    loaded = counter("loaded_chunks", "chunks read out of this tier")
    promotions = counter("promotions", "chunks copied up into this tier from a tier below (RAM)")
    writedowns = counter("writedowns", "chunks copied down to the tiers below before eviction (RAM)")
    evictions = counter("evictions", "chunks evicted to make room")
    drops = counter(
        "drops", "chunks not kept, by reason: backpressure, admission, disk_full, error, dirty_eviction", ("reason",)
    )
    read_bytes = counter("read_bytes", "bytes read from this tier (secondary tiers)")
    written_bytes = counter("written_bytes", "bytes written to this tier (secondary tiers)")
    checksum = counter("checksum_failures", "corrupt or truncated copies found (removed, served as misses)")
    bad_entries = counter(
        "bad_entries",
        "entries under a chunk's name that are not chunk files (FIFO, socket, "
        "directory, symlink): never read, removed where possible, served as misses",
    )
    packs = gauge("packs", "packed s3: pack objects indexed")
    packed = gauge("packed_bytes", "packed s3: bytes of the pack objects indexed, live records or not")
    packed_live = gauge(
        "packed_live_bytes", "packed s3: bytes of the records still served from packs (the rest waits for expiry)"
    )
    by_live = gauge(
        "packs_by_live_fraction",
        "packed s3: packs by the share of their bytes still served, in quarters (band: 0-25%, ..., 75-100%)",
        ("band",),
    )
    packs_written = counter("packs_written", "packed s3: pack objects this daemon PUT")
    packs_expired = counter("packs_expired", "packed s3: packs deleted whole for capacity, oldest first")
    packs_dropped = counter("packs_dropped", "packed s3: packs found vanished, truncated or unreadable (misses)")

    for s in snaps:
        lv = [s.name, s.kind.name.lower()]
        capacity.add_metric(lv, s.capacity_bytes)
        used.add_metric(lv, s.used_bytes)
        if s.capacity_bytes:
            utilization.add_metric(lv, s.used_bytes / s.capacity_bytes)
        chunks.add_metric(lv, s.chunks)
        queued.add_metric(lv, s.queued)
        load_rate.add_metric(lv, s.load_bytes_per_s)  # (RAM: 0; its hits always count)
        skipped_hits.add_metric(lv, s.skipped_slow_hits)
        skipped_writedowns.add_metric(lv, s.skipped_slow_writedowns)
        rate_probes.add_metric(lv, s.rate_probes)
        lookups.add_metric(lv, s.lookups)
        hits.add_metric(lv, s.hits)
        misses.add_metric(lv, max(s.lookups - s.hits, 0))
        stored.add_metric(lv, s.stored_chunks)
        loaded.add_metric(lv, s.loaded_chunks)
        promotions.add_metric(lv, s.promotions)
        writedowns.add_metric(lv, s.writedowns)
        evictions.add_metric(lv, s.evictions)
        for reason, field in DROP_REASONS.items():
            drops.add_metric(lv + [reason], getattr(s, field))
        read_bytes.add_metric(lv, s.read_bytes)
        written_bytes.add_metric(lv, s.written_bytes)
        checksum.add_metric(lv, s.checksum_failures)
        bad_entries.add_metric(lv, s.bad_entries)
        packs.add_metric(lv, s.packs)
        packed.add_metric(lv, s.packed_bytes)
        packed_live.add_metric(lv, s.packed_live_bytes)
        for band, count in zip(LIVE_BANDS, s.packs_by_live_quarter):
            by_live.add_metric(lv + [band], count)
        packs_written.add_metric(lv, s.packs_written)
        packs_expired.add_metric(lv, s.packs_expired)
        packs_dropped.add_metric(lv, s.packs_dropped)
    return [
        capacity,
        used,
        utilization,
        chunks,
        queued,
        load_rate,
        skipped_hits,
        skipped_writedowns,
        rate_probes,
        lookups,
        hits,
        misses,
        stored,
        loaded,
        promotions,
        writedowns,
        evictions,
        drops,
        read_bytes,
        written_bytes,
        checksum,
        bad_entries,
        packs,
        packed,
        packed_live,
        by_live,
        packs_written,
        packs_expired,
        packs_dropped,
    ]


class DaemonMetrics:
    """The registry of one daemon and the few metrics observed as things happen."""

    def __init__(
        self,
        chain: ChainSource,
        sessions: SessionCountsSource,
        namespaces: NamespaceRegistry,
        quotas: QuotaSource,
        peers: PeersSource = lambda: None,
    ) -> None:
        """`chain`, `sessions`, `quotas`, `peers`: the tier chain's snapshot, what the server's
        session broker counts, its tenants' quotas and the peer tier's state now (read at each
        scrape)."""
        disable_created_metrics()  # no *_created series: process-wide, which suits a daemon
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(KvstoredCollector(chain, sessions, namespaces, quotas, peers))
        ProcessCollector(registry=self.registry)
        self.grpc_handled = Counter(
            f"{PREFIX}_grpc_server_handled",
            "gRPC calls completed (streams when they end), by method and status code",
            ["service", "method", "code"],
            registry=self.registry,
        )
        self.grpc_seconds = Histogram(
            f"{PREFIX}_grpc_server_handling_seconds",
            "unary gRPC call latency in the daemon, by method and status code",
            ["service", "method", "code"],
            buckets=GRPC_BUCKETS,
            registry=self.registry,
        )
        self.session_calls = Counter(
            f"{PREFIX}_session_calls",
            "KVStore calls that came over the session socket's fast path (also counted in the gRPC series)",
            ["method", "code"],
            registry=self.registry,
        )
        self._session_series: dict[tuple[str, str, str], tuple[Counter, Histogram, Counter]] = {}
        self.tier_op_seconds = Histogram(
            f"{PREFIX}_tier_operation_seconds",
            "secondary tier operation latency (lookup is one batched call)",
            ["tier", "kind", "op"],
            buckets=TIER_OP_BUCKETS,
            registry=self.registry,
        )
        self._tier_ops: dict[tuple[str, str], Histogram] = {}
        below = [t for t in chain().tiers if t.kind is not TierKind.RAM]
        for tier in below:  # every series exists from the first scrape
            for op in TIER_OPS:
                self._tier_ops[(tier.name, op)] = self.tier_op_seconds.labels(tier.name, tier.kind.name.lower(), op)
        self.interceptor = GrpcMetricsInterceptor(self.grpc_handled, self.grpc_seconds)

    def preinit_grpc(self, service: ServiceDescriptor) -> None:
        """Create the OK series of the service's methods, so rates exist before the first call."""
        for method in service.methods:
            self.grpc_handled.labels(service.full_name, method.name, "OK")
            if not method.server_streaming:
                self.grpc_seconds.labels(service.full_name, method.name, "OK")

    def observe_session_call(self, service: str, method: str, code: str, seconds: float) -> None:
        """Record one call answered over the session socket's fast path. It lands in the gRPC
        series as well, under its method's name: rates, error alerts and latency panels cover a
        method whichever transport carried it."""
        series = self._session_series.get((service, method, code))
        if series is None:  # labels() costs more than the rest of a fast call's bookkeeping: once
            series = self._session_series[(service, method, code)] = (
                self.grpc_handled.labels(service, method, code),
                self.grpc_seconds.labels(service, method, code),
                self.session_calls.labels(method, code),
            )
        handled, latency, calls = series
        handled.inc()
        latency.observe(seconds)
        calls.inc()

    def observe_tier_op(self, tier: str, op: str, seconds: float) -> None:
        """Record one secondary-tier operation: `tier` is its configured name, `op` one of TIER_OPS.

        For the tier chain to call around `tier.contains` ("lookup", once per batch), `tier.read`,
        `tier.write` and `tier.remove`, with a `time.perf_counter()` difference. Cheap (a dict
        lookup and a histogram observe), safe from the event loop and from threads.
        """
        child = self._tier_ops.get((tier, op))
        if child is None:
            if op not in TIER_OPS:
                raise ValueError(f"unknown tier op {op!r} (one of {', '.join(TIER_OPS)})")
            child = self._tier_ops[(tier, op)] = self.tier_op_seconds.labels(tier, "", op)
        child.observe(seconds)


def split_method(full: str) -> tuple[str, str]:
    """'/kvstored.v1.KVStore/Lookup' -> ('kvstored.v1.KVStore', 'Lookup')."""
    service, _, method = full.lstrip("/").rpartition("/")
    return service, method


def _code_name(code: object) -> str:
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # the aio context may hand back the raw status number
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status.name
    return "UNKNOWN"


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts gRPC calls by method and final status code, and times the unary ones.

    Register it before the error-mapping interceptor, so the code it sees is the one the client
    gets (an aborted call ends with the code `context.abort` set). Server streams (WatchEvents,
    health Watch) are counted when they end; their duration is not a latency and is not timed.
    """

    def __init__(self, handled: Counter, seconds: Histogram) -> None:
        self._handled = handled
        self._seconds = seconds

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        service, method = split_method(handler_call_details.method)
        if handler.unary_unary is not None:
            return self._unary(handler, service, method)
        if handler.unary_stream is not None:
            return self._stream(handler, service, method)
        return handler

    def _unary(self, handler, service: str, method: str):
        inner, handled, seconds = handler.unary_unary, self._handled, self._seconds

        async def unary(request, context: grpc.aio.ServicerContext):
            start, code = time.perf_counter(), "UNKNOWN"
            try:
                response = await inner(request, context)
                code = _code_name(context.code() or grpc.StatusCode.OK)
                return response
            except BaseException as exc:
                code = _failure_code(exc, context)
                raise
            finally:
                handled.labels(service, method, code).inc()
                seconds.labels(service, method, code).observe(time.perf_counter() - start)

        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _stream(self, handler, service: str, method: str):
        inner, handled = handler.unary_stream, self._handled

        async def stream(request, context: grpc.aio.ServicerContext):
            code = "UNKNOWN"
            try:
                async for item in inner(request, context):
                    yield item
                code = _code_name(context.code() or grpc.StatusCode.OK)
            except BaseException as exc:
                code = _failure_code(exc, context)
                raise
            finally:
                handled.labels(service, method, code).inc()

        async def writer(request, context: grpc.aio.ServicerContext):  # a handler that writes its stream itself
            code = "UNKNOWN"
            try:
                await inner(request, context)
                code = _code_name(context.code() or grpc.StatusCode.OK)
            except BaseException as exc:
                code = _failure_code(exc, context)
                raise
            finally:
                handled.labels(service, method, code).inc()

        return grpc.unary_stream_rpc_method_handler(
            stream if inspect.isasyncgenfunction(inner) else writer,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _failure_code(exc: BaseException, context: grpc.aio.ServicerContext) -> str:
    """The status a call that raised ends with: the aborted code, CANCELLED, or UNKNOWN."""
    if isinstance(exc, grpc.aio.AbortError):
        return _code_name(context.code())
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return "UNKNOWN"
