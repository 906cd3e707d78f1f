# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A tier's measured load rate: bytes per second of busy time, from the reads it does.

Bookkeeping only (no I/O, no event loop): LowerTier.timed_read calls begin() as a read starts
and end() with what begin() returned as it ends. A sample is the bytes one read delivered over
its share of the tier's busy time: while k reads are in flight, each is charged 1/k of the time
that passes. So reads that overlap share the time they overlap, and with `concurrency` reads in
flight the samples are the tier's throughput, not a single read's speed, however their ends fall:
k reads served as one batch (a peer's fetch) that end together are k samples of k chunks over the
batch's time, not one slow sample followed by k - 1 near-instant ones. The estimate is an
exponentially weighted moving average of those samples, so a tier that slows down or speeds up
is followed within a few reads."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]

DEFAULT_WEIGHT = 0.3  # of the newest sample: a changed tier is followed within ~5 reads


@dataclass(frozen=True, slots=True)
class RateEstimate:
    bytes_per_s: float  # 0: no sample yet (unknown)
    samples: int
    age_s: float  # since the last sample (inf: none yet)

    @property
    def known(self) -> bool:
        return self.samples > 0


class LoadRate:
    """EWMA of one tier's read throughput (bytes/s of busy time)."""

    def __init__(self, weight: float = DEFAULT_WEIGHT, clock: Clock = time.monotonic) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self._weight = weight
        self._clock = clock
        self._rate = 0.0
        self._samples = 0
        self._last_sample = -math.inf
        self._active = 0  # reads in flight
        self._shared = 0.0  # busy seconds each read in flight has been charged since the start
        self._advanced = 0.0  # when _shared was last brought up to date

    def _advance(self, now: float) -> None:
        if self._active:
            self._shared += (now - self._advanced) / self._active
        self._advanced = now

    def begin(self) -> float:
        """A read starts; returns what end() needs to know of it."""
        self._advance(self._clock())
        self._active += 1
        return self._shared

    def end(self, began: float, nbytes: int, ok: bool) -> None:
        """A read ended; `began`: what begin() returned for it; `ok`: it delivered `nbytes` (a
        failed read's time is not a rate)."""
        now = self._clock()
        self._advance(now)
        self._active = max(0, self._active - 1)
        share = self._shared - began
        if not self._active:
            self._shared = 0.0  # (no read holds an older value: keeps the sums small and exact)
        if ok and nbytes > 0 and share > 0:
            self.record(nbytes / share, now)

    def record(self, bytes_per_s: float, now: float | None = None) -> None:
        """Fold one throughput sample in."""
        self._rate = bytes_per_s if not self._samples else self._rate + self._weight * (bytes_per_s - self._rate)
        self._samples += 1
        self._last_sample = self._clock() if now is None else now

    @property
    def active(self) -> int:
        return self._active

    def estimate(self) -> RateEstimate:
        return RateEstimate(self._rate, self._samples, self._clock() - self._last_sample)
