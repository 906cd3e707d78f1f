# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Hits and write-downs only where loading beats recomputing.

A namespace whose engine said how fast it recomputes (prefill tokens/s and KV bytes per token)
has a recompute time per chunk. A hit below RAM is worth reporting only if loading it (waiting
for the tier's queue, then its bytes at the tier's measured rate, load_rate.py) is expected to
finish before the engine would have recomputed the same tokens; a tier that cannot beat
recomputing at all gets none of the namespace's write-downs.

- reported_prefix(): the pure decision for one lookup's hit prefix.
- RecomputeGate: the chain's side: the tiers' rates and queues, the skip counters, and probes.
  A tier skipped for slowness does no loads, so its rate would never be measured again: once
  its last sample is `probe_s` old, the hits one lookup skipped on it are promoted anyway (into
  free RAM, nobody waiting on them) and one write-down is let through, and their reads measure
  it again. All of that lookup's skipped hits, not one: they are read side by side, as a load
  would read them, and a tier that serves a lookup's chunks as one batch (a peer) is measured at
  its throughput, where one chunk alone would measure its round trip.
Where a tier's rate is not known yet (no sample), its hits count and it is written to:
optimistic, as without this gate. Bookkeeping only; the chain does the I/O.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstored.chain.load_rate import Clock
from kvstored.chain.lower import LowerTier
from kvstored.chunks.ids import ChunkId
from kvstored.namespaces import Namespace

NamespaceFinder = Callable[[str], Namespace | None]

DEFAULT_PROBE_S = 5.0


@dataclass(frozen=True, slots=True)
class TierLoad:
    """What a load from one tier waits for now."""

    bytes_per_s: float  # measured throughput (0: unknown)
    jobs_ahead: int  # queued loads and running jobs in front of a new load


def expected_finish_s(load: TierLoad, new_jobs: int, chunk_bytes: int) -> float:
    """When the last of `new_jobs` loads submitted now should have finished (0: rate unknown)."""
    if load.bytes_per_s <= 0:
        return 0.0
    return (load.jobs_ahead + new_jobs) * chunk_bytes / load.bytes_per_s


def reported_prefix(
    below: Sequence[int | None], chunk_bytes: int, recompute_chunk_s: float, loads: Sequence[TierLoad]
) -> int:
    """How much of a hit prefix to report. `below[i]`: the lower tier chunk i would load from,
    None for one in RAM (or already coming up). Reporting p chunks saves recomputing p chunks and
    costs waiting for the loads among them (tiers load side by side, each behind its queue); the
    answer is the p that saves the most, the longest of equals. RAM hits before the first chunk
    below always count."""
    counts = [0] * len(loads)
    finish = 0.0
    best, best_gain = 0, 0.0
    for i, tier in enumerate(below):
        if tier is not None:
            counts[tier] += 1
            finish = max(finish, expected_finish_s(loads[tier], counts[tier], chunk_bytes))
        gain = (i + 1) * recompute_chunk_s - finish
        if gain >= best_gain:
            best, best_gain = i + 1, gain
    return best


@dataclass(slots=True)
class SkipCounts:
    """Per tier: what the gate left out because loading would be slower than recomputing."""

    hits: int = 0  # hits below RAM not reported (chunks)
    admissions: int = 0  # write-downs not done (chunks)
    probes: int = 0  # skipped hits promoted, or write-downs let through, to measure the tier again


class RecomputeGate:
    def __init__(
        self,
        lower: Sequence[LowerTier],
        namespaces: NamespaceFinder,
        enabled: bool = True,
        probe_s: float = DEFAULT_PROBE_S,
        clock: Clock = time.monotonic,
    ) -> None:
        self._lower = list(lower)
        self._index = {id(t): i for i, t in enumerate(self._lower)}
        self._namespaces = namespaces
        self.enabled = enabled
        self._probe_s = probe_s
        self._clock = clock
        self._probed = [-math.inf] * len(self._lower)
        self.skipped = [SkipCounts() for _ in self._lower]

    def applies(self, ns: Namespace) -> bool:
        """Whether lookups and write-downs of `ns` are gated (it gave its rates; not turned off)."""
        return self.enabled and ns.recompute_chunk_s > 0

    def loads(self) -> list[TierLoad]:
        return [TierLoad(t.load_rate.estimate().bytes_per_s, t.queue.loads_ahead) for t in self._lower]

    def prefix(self, ns: Namespace, below: Sequence[int | None]) -> int:
        """reported_prefix() for `ns` with the tiers as they are now."""
        return reported_prefix(below, ns.chunk_bytes, ns.recompute_chunk_s, self.loads())

    def beats_recompute(self, index: int, ns: Namespace) -> bool:
        """Whether tier `index`, unqueued, loads `ns`'s chunks faster than the engine recomputes
        them (True while its rate is unknown)."""
        rate = self._lower[index].load_rate.estimate()
        return not rate.known or rate.bytes_per_s >= ns.recompute_bytes_per_s

    def skip_hit(self, index: int) -> None:
        self.skipped[index].hits += 1

    def take_probe(self, index: int, chunks: int = 1) -> bool:
        """Whether tier `index` is due a measurement (no sample, nor probe, for probe_s); taking
        it starts the next interval and counts `chunks` probes (the reads or writes it lets through)."""
        now = self._clock()
        if self._lower[index].load_rate.estimate().age_s < self._probe_s or now - self._probed[index] < self._probe_s:
            return False
        self._probed[index] = now
        self.skipped[index].probes += chunks
        return True

    def admits(self, lower: LowerTier, chunk: ChunkId) -> bool:
        """Whether `chunk` is written down to `lower` (counted where not)."""
        ns = self._namespaces(chunk[0])
        index = self._index[id(lower)]
        if ns is None or not self.applies(ns) or self.beats_recompute(index, ns) or self.take_probe(index):
            return True
        self.skipped[index].admissions += 1
        return False
