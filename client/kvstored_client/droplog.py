# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Chunks a client dropped, logged: at most one WARNING per reason per `interval_s`, carrying the
count since that reason's previous line. A store degrades to `dropped` without raising (a busy
daemon, a deadline missed), so without this line a store that drops everything says nothing;
a flood of them stays one line per reason every ten seconds. The daemon logs its own reasons
(ram_full, quota_full, ...) the same way in its log (kvstored.chain.drops)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

log = logging.getLogger("kvstored_client")

LOG_INTERVAL_S = 10.0


class DropLog:
    def __init__(
        self,
        where: str,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.where = where  # who dropped: "kvstored at var/kvstored.sock", "kvstored tier"
        self._interval_s = interval_s
        self._clock = clock
        self._log = logger
        self._unlogged: Counter[str] = Counter()
        self._logged_at: dict[str, float] = {}

    def record(self, reason: str, n: int, why: str) -> bool:
        """Count `n` chunks dropped for `reason` (a metric label: "unavailable", "ram_full"...);
        log them if that reason's last line is at least `interval_s` old. True if logged."""
        if n <= 0:
            return False
        self._unlogged[reason] += n
        now = self._clock()
        last = self._logged_at.get(reason)
        if last is not None and now - last < self._interval_s:
            return False
        count = self._unlogged.pop(reason)
        if last is None:
            self._log.warning("%s: stores dropped %d chunk(s) (%s): %s", self.where, count, reason, why)
        else:
            self._log.warning(
                "%s: stores dropped %d chunk(s) in %.0f s (%s): %s", self.where, count, now - last, reason, why
            )
        self._logged_at[reason] = now
        return True
