# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The chain's side of Stats and /metrics: one read of every tier into observability's dataclasses."""

from __future__ import annotations

from kvstored.chain.chain import TierChain
from kvstored.chunks.ids import TierKind
from kvstored.io.scheduler import Priority
from kvstored.observability.snapshot import ChainSnapshot, StagingSnapshot, TierSnapshot, VerifySnapshot
from kvstored.tiers.base import PackUsage

NO_PACKS = PackUsage(0, 0, 0, (0, 0, 0, 0), 0, 0, 0)  # a tier that does not pack


def chain_snapshot(chain: TierChain) -> ChainSnapshot:
    c = chain.ram.counters
    return ChainSnapshot(
        tier_snapshots(chain),
        staging_snapshot(chain),
        chain.ram.resident_bytes,
        dict(chain.drops.totals),
        VerifySnapshot(chain.ram.unverified_count, c.verified_chunks, c.verified_bytes),
        chain.ram.held_bytes,
    )


def staging_snapshot(chain: TierChain) -> StagingSnapshot:
    staged = chain.staged
    if staged is None:
        return StagingSnapshot()
    return StagingSnapshot(staged.staging.capacity_bytes, staged.staging.used_bytes, staged.served)


def tier_snapshots(chain: TierChain) -> list[TierSnapshot]:
    ram, c = chain.ram, chain.ram.counters
    snaps = [
        TierSnapshot(
            name="ram",
            kind=TierKind.RAM,
            capacity_bytes=ram.capacity_bytes,
            used_bytes=ram.used_bytes,
            chunks=ram.chunk_count,
            lookups=c.lookups,
            hits=c.hits,
            evictions=c.evictions,
            stored_chunks=c.stored,
            loaded_chunks=c.loaded,
            promotions=c.promotions,
            writedowns=c.writedowns,
            dropped_dirty=c.dropped_dirty,
            checksum_failures=c.verify_failures,  # (adopted chunks whose bytes changed)
            read_bytes=c.read_bytes,
            written_bytes=c.written_bytes,
        )
    ]
    for lower, skipped in zip(chain.lower, chain.gate.skipped):
        tier, tc, usage = lower.tier, lower.tier.counters, lower.tier.usage()
        packed = tier.pack_usage() or NO_PACKS
        snaps.append(
            TierSnapshot(
                name=tier.name,
                kind=tier.kind,
                capacity_bytes=usage.capacity_bytes,
                used_bytes=usage.used_bytes,
                chunks=usage.chunks,
                lookups=tc.lookups,
                hits=tc.hits,
                evictions=tc.evictions,
                stored_chunks=tc.writes,
                loaded_chunks=tc.reads,
                read_bytes=tc.read_bytes,
                written_bytes=tc.written_bytes,
                checksum_failures=tc.checksum_failures,
                bad_entries=tc.bad_entries,
                errors=tc.errors,
                rejected_full=tc.rejected_full,
                rejected_admission=tc.rejected_admission,
                # only refused write-downs lose a copy: a refused delete runs directly
                dropped_backpressure=lower.queue.dropped[Priority.WRITEDOWN],
                queued=sum(lower.queue.backlog.values()),
                skipped_slow_hits=skipped.hits,
                skipped_slow_writedowns=skipped.admissions,
                rate_probes=skipped.probes,
                load_bytes_per_s=lower.load_rate.estimate().bytes_per_s,
                packs=packed.packs,
                packed_bytes=packed.bytes,
                packed_live_bytes=packed.live_bytes,
                packs_by_live_quarter=() if packed is NO_PACKS else packed.by_live_quarter,
                packs_written=packed.written,
                packs_expired=packed.expired,
                packs_dropped=packed.dropped,
            )
        )
    return snaps
