# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The writer's bookkeeping (no I/O): what this node must tell the directory next.

- ChangeLog: the net changes since the last write, from the event bus (a chunk stored then
  evicted within one interval costs nothing); bounded by max_pending: past it, changes are
  dropped and a full re-write is asked for instead.
- RefreshPass: every chunk this node holds re-written once per period (a slice per interval),
  which renews the keys' TTL and restores what the directory lost (a failover, a restart).
  After an outage or at start it runs urgently: as fast as the batch size allows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstored.chunks.ids import ChunkId, TierKind
from kvstored.directory.keys import PUBLISHED_KINDS
from kvstored.events.bus import EventType, KvEvent

Holding = tuple[TierKind, ChunkId]  # a chunk this node holds, and in which kind of tier


@dataclass(frozen=True, slots=True)
class Change:
    kind: TierKind
    chunk: ChunkId
    present: bool  # False: deleted from that tier


class ChangeLog:
    def __init__(self, max_pending: int, shareable: Callable[[str], bool]) -> None:
        self.max_pending = max_pending
        self._shareable = shareable
        self._pending: dict[tuple[TierKind, ChunkId], bool] = {}
        self._oldest: float | None = None  # when the oldest change still pending happened
        self.dropped = 0  # changes not kept (max_pending): a full re-write covers them
        self.resync_wanted = False

    def __len__(self) -> int:
        return len(self._pending)

    def on_event(self, event: KvEvent, now: float) -> None:
        if event.tier_kind not in PUBLISHED_KINDS or not self._shareable(event.namespace_id):
            return
        if event.type is EventType.CLEARED:
            # Which keys were cleared is not in the event: their fields stay until a reader finds
            # them missing at fetch (and deletes them) or their keys expire.
            return
        present = event.type is EventType.STORED
        pending = self._pending
        for key in event.keys:
            if len(pending) >= self.max_pending and (event.tier_kind, (event.namespace_id, key)) not in pending:
                self.dropped += 1
                self.resync_wanted = True
                continue
            pending[(event.tier_kind, (event.namespace_id, key))] = present
        if pending and self._oldest is None:
            self._oldest = now

    def take(self, n: int) -> list[Change]:
        """Up to n changes, oldest first, no longer pending."""
        out: list[Change] = []
        for (kind, chunk), present in self._pending.items():
            if len(out) == n:
                break
            out.append(Change(kind, chunk, present))
        for change in out:
            del self._pending[(change.kind, change.chunk)]
        return out

    def give_back(self, changes: Sequence[Change], since: float) -> None:
        """A write that failed: its changes are pending again, unless a newer one came meanwhile."""
        for change in changes:
            self._pending.setdefault((change.kind, change.chunk), change.present)
        if self._pending and (self._oldest is None or since < self._oldest):
            self._oldest = since

    def written(self, now: float) -> None:
        """Everything taken so far reached the directory."""
        self._oldest = now if self._pending else None

    def lag(self, now: float) -> float:
        """How long the oldest change not yet in the directory has waited (0: none)."""
        return 0.0 if self._oldest is None else max(0.0, now - self._oldest)


class RefreshPass:
    def __init__(self, period_s: float, interval_s: float, batch: int) -> None:
        self.steps = max(1, math.floor(period_s / interval_s))  # intervals per pass
        self.batch = batch
        self._todo: list[Holding] = []
        self._per_step = 0
        self.urgent = True  # the first pass, at start: write everything now
        self.passes = 0

    def restart_urgently(self) -> None:
        """Write everything again as fast as batches allow (the directory lost it, or this node's
        changes were dropped)."""
        self._todo = []
        self.urgent = True

    def next_slice(self, holdings: Callable[[], list[Holding]]) -> list[Holding]:
        """What to re-write this interval (a new pass starts when the last one is done)."""
        if not self._todo:
            self._todo = holdings()
            self._todo.reverse()  # (popped from the end: oldest listed first)
            self._per_step = self.batch if self.urgent else min(self.batch, math.ceil(len(self._todo) / self.steps))
            self.passes += 1
            if not self._todo:
                self.urgent = False
                return []
        n = min(len(self._todo), max(1, self._per_step))
        out = self._todo[-n:]
        del self._todo[-n:]
        out.reverse()
        if not self._todo:
            self.urgent = False
        return out
