# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Pure helpers for remote tiers: a circuit breaker, a negative cache and retry delays.

No I/O and no event loop here: time comes from an injectable clock, so the logic is unit-tested
without sleeping.
"""

from __future__ import annotations

import enum
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

Clock = Callable[[], float]


class BreakerState(enum.Enum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls are refused until reset_s has passed since the breaker opened
    HALF_OPEN = "half-open"  # one probe call goes through; its verdict closes or reopens


@dataclass(frozen=True, slots=True)
class Permit:
    """Leave to make one call; hand it back with record() or abandon()."""

    probe: bool


_CALL = Permit(probe=False)
_PROBE = Permit(probe=True)


class CircuitBreaker:
    """Stops calling an endpoint after `failures` consecutive failed calls, for `reset_s`.

    A dead endpoint then costs one failure per call for the first few calls, and nothing for the
    calls after them. Once `reset_s` has passed, one probe call is let through (half-open): its
    success closes the breaker, its failure opens it for another `reset_s`. Only the probe's
    verdict counts while the breaker is not closed: late verdicts of calls admitted before it
    opened change nothing.
    """

    def __init__(self, failures: int, reset_s: float, clock: Clock = time.monotonic) -> None:
        if failures < 1:
            raise ValueError("a circuit breaker needs failures >= 1")
        if reset_s < 0:
            raise ValueError("reset_s must be >= 0")
        self.failures = failures
        self.reset_s = reset_s
        self._clock = clock
        self._consecutive = 0
        self._opened_at: float | None = None  # None: closed
        self._probing = False
        self.times_opened = 0

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._probing or self._clock() - self._opened_at >= self.reset_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def would_allow(self) -> bool:
        """Whether allow() would grant a call now (no side effects)."""
        if self._opened_at is None:
            return True
        return not self._probing and self._clock() - self._opened_at >= self.reset_s

    def allow(self) -> Permit | None:
        """A permit for one call, or None: the caller must fail at once without calling."""
        if self._opened_at is None:
            return _CALL
        if self._probing or self._clock() - self._opened_at < self.reset_s:
            return None
        self._probing = True
        return _PROBE

    def record(self, permit: Permit, ok: bool) -> None:
        """The call made under `permit` reached the endpoint (ok) or did not."""
        if permit.probe:
            self._probing = False
            if ok:
                self._close()
            else:
                self._opened_at = self._clock()
            return
        if self._opened_at is not None:
            return
        if ok:
            self._consecutive = 0
            return
        self._consecutive += 1
        if self._consecutive >= self.failures:
            self.trip()

    def abandon(self, permit: Permit) -> None:
        """The call ended without a verdict (cancelled): the next call may probe at once."""
        if permit.probe:
            self._probing = False

    def trip(self) -> None:
        """Open now (e.g. the endpoint was unreachable at start)."""
        if self._opened_at is None:
            self.times_opened += 1
        self._opened_at = self._clock()
        self._consecutive = 0

    def _close(self) -> None:
        self._opened_at = None
        self._consecutive = 0


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
