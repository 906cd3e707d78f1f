# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""One read of the peer tier's state, both sides, for the Status RPC (kvstoredctl peers) and
/metrics."""

from __future__ import annotations

import dataclasses

from kvstored.observability.snapshot import DirectoryRow, PeerRow, PeersSnapshot
from kvstored.server.peer_serving import PeerServing
from kvstored.tiers.peer import PeerTier
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb


def directory_row(tier: PeerTier) -> DirectoryRow | None:
    node = tier.directory
    if node is None:
        return None
    c, followed = node.counters, node.cluster_counters()
    return DirectoryRow(
        url=node.settings.url.redacted(),
        breaker=node.breaker.state.name.lower(),
        lag_s=node.lag_s(),
        pending_changes=len(node.changes),
        lookups=c.lookups,
        lookup_chunks=c.lookup_chunks,
        hit_chunks=c.hits,
        errors=c.errors,
        timeouts=c.timeouts,
        refused=c.refused,
        write_batches=c.write_batches,
        write_commands=c.write_commands,
        write_errors=c.write_errors,
        refreshed=c.refreshed,
        dropped_changes=c.dropped_changes,
        stale_deleted=c.stale_deleted,
        connects=followed.connects,
        found_peers=sum(1 for r in tier.membership.records() if not r.follows),
        moved=followed.moved,
        asked=followed.asked,
        slot_map_reads=followed.refreshes,
        last_error=node.last_error,
        shards=tuple(node.shards()),
    )


def peers_snapshot(serving: PeerServing, tier: PeerTier) -> PeersSnapshot:
    rows, known = [], set()
    for record in tier.membership.records():
        c = record.counters
        known.add(record.incarnation)
        rows.append(
            PeerRow(
                address=str(record.address),
                label=record.label,
                state=record.state.name.lower(),
                transport=record.transport.value if record.transport else "",
                incarnation=record.incarnation,
                indexed_chunks=tier.index.count(record.slot) if record.slot is not None else 0,
                received_bytes=c.received_bytes,
                sent_bytes=serving.sent_to.get(record.incarnation, 0),
                breaker=record.breaker.state.name.lower(),
                received_chunks=c.received_chunks,
                missing_chunks=c.missing_chunks,
                corrupt_chunks=c.corrupt_chunks,
                failed_chunks=c.failed_chunks,
                timed_out_chunks=c.timed_out_chunks,
                fetches=c.fetches,
                refused_by_breaker=c.refused_by_breaker,
                events=c.events,
                resyncs=c.resyncs,
                detail=record.detail,
                last_seq=record.last_seq,
            )
        )
    others = sum(sent for incarnation, sent in serving.sent_to.items() if incarnation not in known)
    hello = serving.hello
    sc = serving.counters
    return PeersSnapshot(
        incarnation=serving.incarnation,
        peers=rows,
        index_entries=len(tier.index),
        index_capacity=tier.index.max_entries,
        index_evictions=tier.index.evictions,
        leases=serving.leases,
        reservations=tier.reservations,
        served_chunks=sc.served_chunks,
        served_bytes=sc.served_bytes,
        refused_chunks=sc.refused_chunks,
        other_sent_bytes=sc.other_sent_bytes + others,
        transports=tuple(sorted(t.value for t in hello.transports)) if hello else (),
        tcp_port=hello.tcp_port if hello else 0,
        ucx_port=hello.ucx_port if hello else 0,
        directory=directory_row(tier),
    )


def status(serving: PeerServing, tier: PeerTier) -> pb.PeerStatusResponse:
    snap = peers_snapshot(serving, tier)
    peers = []
    for row in snap.peers:
        fields = dataclasses.asdict(row)
        fields.pop("label")
        fields["state"] = pb.PeerState.Value("PEER_STATE_" + row.state.upper())
        fields["breaker"] = pb.BreakerState.Value("BREAKER_STATE_" + row.breaker.upper())
        peers.append(pb.PeerInfo(**fields))
    return pb.PeerStatusResponse(
        enabled=True,
        incarnation=snap.incarnation,
        peers=peers,
        index_entries=snap.index_entries,
        index_capacity=snap.index_capacity,
        leases=snap.leases,
        reservations=snap.reservations,
        other_sent_bytes=snap.other_sent_bytes,
        served_chunks=snap.served_chunks,
        refused_chunks=snap.refused_chunks,
        transports=list(snap.transports),
        tcp_port=snap.tcp_port,
        ucx_port=snap.ucx_port,
        served_bytes=snap.served_bytes,
        index_evictions=snap.index_evictions,
        directory=_directory_status(snap.directory),
    )


def _directory_status(row: DirectoryRow | None) -> pb.DirectoryStatus | None:
    if row is None:
        return None
    fields = dataclasses.asdict(row)
    fields["breaker"] = pb.BreakerState.Value("BREAKER_STATE_" + row.breaker.upper())
    fields["shards"] = list(row.shards)
    return pb.DirectoryStatus(**fields)
