# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A circuit breaker for any remote endpoint (an S3 bucket, a peer daemon): bookkeeping only.

No I/O and no event loop here: time comes from an injectable clock, so the logic is unit-tested
without sleeping. One class for every remote, so S3 and the peers open, probe and close alike.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
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

    def reset(self) -> None:
        """Close now and forget every failure (e.g. the endpoint is a new process)."""
        self._close()
        self._probing = False

    def _close(self) -> None:
        self._opened_at = None
        self._consecutive = 0
