# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Pure helpers for remote tiers: a negative cache and retry delays (the circuit breaker is
kvstored.io.breaker, shared with the peer mesh).

No I/O and no event loop here: time comes from an injectable clock, so the logic is unit-tested
without sleeping.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

Clock = Callable[[], float]


class NegativeCache:
    """Keys recently seen missing, remembered for `ttl_s` (0 disables it), at most `max_entries`."""

    def __init__(self, ttl_s: float, max_entries: int = 1 << 20, clock: Clock = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._max = max_entries
        self._clock = clock
        self._expiry: OrderedDict[Hashable, float] = OrderedDict()  # earliest expiry first

    def __len__(self) -> int:
        return len(self._expiry)

    def __contains__(self, key: Hashable) -> bool:
        expiry = self._expiry.get(key)
        if expiry is None:
            return False
        if self._clock() < expiry:
            return True
        del self._expiry[key]
        return False

    def add(self, key: Hashable) -> None:
        if self.ttl_s <= 0:
            return
        now = self._clock()
        self._expiry[key] = now + self.ttl_s
        self._expiry.move_to_end(key)
        while self._expiry:  # drop what has expired (they are all at the front) and the overflow
            oldest_key, oldest = next(iter(self._expiry.items()))
            if oldest > now and len(self._expiry) <= self._max:
                break
            del self._expiry[oldest_key]

    def discard(self, key: Hashable) -> None:
        self._expiry.pop(key, None)


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: attempt n (0-based) waits U(0, min(cap, base * 2**n))."""

    attempts: int = 4  # calls in all, the first one included
    base_s: float = 0.05
    cap_s: float = 1.0

    def delay(self, attempt: int, rng: Callable[[], float] = random.random) -> float:
        return rng() * min(self.cap_s, self.base_s * (2**attempt))
