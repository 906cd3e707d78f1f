# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Chunks stores did not store, by reason: counted (Stats, /metrics) and logged, at most one line
per reason per `interval_s`, carrying the count since that reason's previous line. A store that
drops everything under load is then seen in the log within one line, and a flood of them stays
one line per reason every ten seconds."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

from kvstored_client.kinds import DropReason

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0

# What each reason means to an operator, and what to do about it; the level of its line (another
# writer storing the same chunk, or a client using a namespace it did not register, are not the
# daemon's trouble).
_EXPLAINED: dict[DropReason, tuple[int, str]] = {
    DropReason.RAM_FULL: (
        logging.WARNING,
        "RAM is held by leased and reserved chunks and by chunks being written down (a larger "
        "--cpu-bytes, or a faster tier below, helps)",
    ),
    DropReason.QUOTA_FULL: (
        logging.WARNING,
        "the namespace's or its tenant's RAM quota is held by leased and reserved chunks and by "
        "chunks being written down",
    ),
    DropReason.IN_PROGRESS: (logging.INFO, "another writer was storing the same chunks"),
    DropReason.NOT_VISIBLE: (logging.INFO, "a session stored into a tenant namespace it did not register"),
}


class StoreDrops:
    def __init__(self, interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.totals: Counter[DropReason] = Counter()  # since the daemon started
        self._interval_s = interval_s
        self._clock = clock
        self._unlogged: Counter[DropReason] = Counter()
        self._logged_at: dict[DropReason, float] = {}

    def record(self, reasons: Iterable[DropReason]) -> None:
        """Count one store's dropped chunks (NONE entries are chunks it did not drop) and log
        the reasons whose last line is at least `interval_s` old."""
        batch = Counter(r for r in reasons if r is not DropReason.NONE)
        if not batch:
            return
        self.totals.update(batch)
        self._unlogged.update(batch)
        now = self._clock()
        for reason in batch:
            last = self._logged_at.get(reason)
            if last is not None and now - last < self._interval_s:
                continue
            count = self._unlogged.pop(reason)
            level, why = _EXPLAINED.get(reason, (logging.WARNING, reason.label))
            if last is None:
                log.log(level, "stores dropped %d chunk(s) (%s): %s", count, reason.label, why)
            else:
                log.log(level, "stores dropped %d chunk(s) in %.0f s (%s): %s", count, now - last, reason.label, why)
            self._logged_at[reason] = now
