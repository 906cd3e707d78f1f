# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Net presence changes per interval: what a follower of this node must learn, no more.

The bus reports every step (a store, a write-down, an eviction, a promotion back up); a router
or a peer following the node only needs, per interval, which chunks appeared at or left a
place. A *place* is whatever the follower distinguishes: the ZMQ publisher uses (medium,
locality), so a chunk on both fs and S3 is one STORAGE place each; a peer stream can use the
tier itself. Several tiers may share a place: a chunk leaves a place when the last of them
drops it. A chunk stored and evicted within one interval yields nothing at all.

Bookkeeping only (no I/O, no clock): the owner calls add() from a bus listener and take() on
its own timer.

`net_events` is the stateless kind, for a coalesced WatchEvents stream (a peer's follower): it
sees only one interval's events, so per tier each chunk's last change wins (stored and evicted
within the interval reads as removed, which a follower applies as a no-op). A Coalescer per
stream would hold every chunk the node has, once per follower.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstored.chunks.ids import TierKind
from kvstored.events.bus import MAX_EVENT_KEYS, Cause, EventType, KvEvent

Place = TypeVar("Place", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Change(Generic[Place]):
    namespace_id: str
    key: bytes
    place: Place
    present: bool  # True: now held at `place`; False: gone from it


class Coalescer(Generic[Place]):
    def __init__(self, place_of: Callable[[KvEvent], Place | None]) -> None:
        """place_of: the place an event's tier counts as, or None for tiers the follower ignores."""
        self._place_of = place_of
        self._holders: dict[tuple[str, bytes, Place], set[str]] = {}  # the tiers holding it now
        # Touched since the last take, with whether it was present then (insertion order: the
        # order of the calls, so a prefix stored chunk by chunk comes out parent first).
        self._dirty: dict[tuple[str, bytes, Place], bool] = {}

    def add(self, event: KvEvent) -> None:
        # CLEARED needs nothing: the chain publishes a cleared namespace's keys as REMOVED first.
        if event.type is EventType.CLEARED:
            return
        place = self._place_of(event)
        if place is None:
            return
        stored = event.type is EventType.STORED
        for key in event.keys:
            entry = (event.namespace_id, key, place)
            holders = self._holders.get(entry)
            self._dirty.setdefault(entry, holders is not None)
            if stored:
                if holders is None:
                    self._holders[entry] = {event.tier}
                else:
                    holders.add(event.tier)
            elif holders is not None:
                holders.discard(event.tier)
                if not holders:
                    del self._holders[entry]

    def found(self, namespace_id: str, key: bytes, place: Place, tier: str) -> None:
        """`tier` holds the chunk though no event said so (a restarted node's disk, read back):
        as if it had stored it now."""
        entry = (namespace_id, key, place)
        holders = self._holders.get(entry)
        self._dirty.setdefault(entry, holders is not None)
        if holders is None:
            self._holders[entry] = {tier}
        else:
            holders.add(tier)

    def unsent(self, namespace_id: str, key: bytes, places: tuple[Place, ...]) -> None:
        """The chunk's places held now count as not yet sent: the next take() lists them as
        appeared (their changes went by while the follower could not be told, say)."""
        for place in places:
            entry = (namespace_id, key, place)
            if entry in self._holders:
                self._dirty[entry] = False

    @property
    def pending(self) -> bool:
        return bool(self._dirty)

    def take(self) -> list[Change[Place]]:
        """The net changes since the last take, in the order they were first touched."""
        changes = []
        for (ns, key, place), was in self._dirty.items():
            now = (ns, key, place) in self._holders
            if now != was:
                changes.append(Change(ns, key, place, now))
        self._dirty.clear()
        return changes

    def holds(self, namespace_id: str, key: bytes, places: tuple[Place, ...]) -> bool:
        return any((namespace_id, key, p) in self._holders for p in places)

    def held(self) -> list[tuple[str, bytes, Place]]:
        """Everything held now, in the order first held (a snapshot for a follower that lost
        track; take() first so the snapshot and the changes already sent agree). A copy: the
        follower may go through it while changes go on."""
        return list(self._holders)


def net_events(events: Sequence[KvEvent]) -> list[KvEvent]:
    """One interval's events as net changes: per (type, cause, tier, namespace) one event (split
    at MAX_EVENT_KEYS) with the chunks whose last change in the tier it was, in the order the
    chunks were first touched; a CLEARED event stays where it was (what came before it is
    emitted before it). Every event carries the seq and time of the interval's last event."""
    if not events:
        return []
    last = events[-1]
    out: list[KvEvent] = []
    # (tier, namespace, key) -> (type, cause, tier_kind), insertion-ordered by first touch
    latest: dict[tuple[str, str, bytes], tuple[EventType, Cause, TierKind]] = {}

    def flush() -> None:
        groups: dict[tuple[EventType, Cause, str, TierKind, str], list[bytes]] = {}
        for (tier, ns, key), (type_, cause, kind) in latest.items():
            groups.setdefault((type_, cause, tier, kind, ns), []).append(key)
        for (type_, cause, tier, kind, ns), keys in groups.items():
            for first in range(0, len(keys), MAX_EVENT_KEYS):
                chunk = tuple(keys[first : first + MAX_EVENT_KEYS])
                out.append(KvEvent(last.seq, last.ts, type_, cause, tier, kind, ns, chunk))
        latest.clear()

    for event in events:
        if event.type is EventType.CLEARED:
            flush()
            out.append(
                KvEvent(last.seq, last.ts, event.type, event.cause, event.tier, event.tier_kind, event.namespace_id, ())
            )
            continue
        for key in event.keys:
            entry = (event.tier, event.namespace_id, key)
            latest[entry] = (event.type, event.cause, event.tier_kind)  # (keeps its first position)
    flush()
    return out
