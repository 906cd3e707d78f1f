# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""KV events: every store, promotion, write-down, eviction and removal, per tier.

The bus numbers events, keeps the last `buffer_events` for replay, and fans them out to
subscribers (gRPC streams, the ZMQ publisher). Publishing never blocks and never fails: a
subscriber that falls too far behind is cut off (it resumes by replaying from its last seq, as
long as that seq is still buffered). A subscriber may see only some events (`EventFilter`: tenant
namespaces' events go only to sessions that may see them); the others neither reach its queue
nor count towards its lag.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvstored.choices import Choice
from kvstored.chunks.ids import ChunkId, TierKind


class EventEncoding(Choice):
    """How ZMQ KV events are encoded."""

    MAP = "map"  # vLLM 0.33: each event a map tagged with "type"
    ARRAY = "array"  # older consumers: positional arrays, tag first


class EventType(enum.IntEnum):
    STORED = 1
    REMOVED = 2
    CLEARED = 3


class Cause(enum.IntEnum):
    STORED = 1  # a client stored it
    PROMOTED = 2  # copied up from a lower tier
    WRITTEN_DOWN = 3  # copied down from RAM
    EVICTED = 4  # capacity
    DELETED = 5  # a client deleted it
    CORRUPT = 6  # failed verification and was removed


@dataclass(frozen=True, slots=True)
class KvEvent:
    seq: int
    ts: float
    type: EventType
    cause: Cause
    tier: str
    tier_kind: TierKind
    namespace_id: str
    keys: tuple[bytes, ...]


EventFilter = Callable[[KvEvent], bool]  # True: the subscriber may see this event


def everything(event: KvEvent) -> bool:
    return True


class Subscription:
    def __init__(self, maxsize: int, accepts: EventFilter = everything) -> None:
        self.queue: asyncio.Queue[KvEvent | None] = asyncio.Queue(maxsize)  # None: the bus closed
        self.lagged = False  # set when the queue overflowed: the stream must end
        self.accepts = accepts

    def offer(self, event: KvEvent) -> None:
        if self.lagged or not self.accepts(event):
            return
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.lagged = True


Listener = Callable[[KvEvent], None]


class Tap:
    """A subscriber that takes each event it accepts as it is published (an interval feed
    gathering its interval: no queue of its own)."""

    def __init__(self, take: Listener, accepts: EventFilter = everything) -> None:
        self.take = take
        self.accepts = accepts

    def offer(self, event: KvEvent) -> None:
        if self.accepts(event):
            self.take(event)


# Keys per event at most: a ClearNamespace of millions of keys would otherwise be one message
# larger than a gRPC client takes (4 MiB by default; a peer's follower, 64 MiB), which no
# subscriber could ever read past. 16,384 keys of 32 bytes: about 0.6 MB encoded.
MAX_EVENT_KEYS = 16_384


class EventBus:
    def __init__(self, buffer_events: int = 10_000, subscriber_queue: int = 10_000) -> None:
        self._seq = itertools.count(1)
        self._buffer: deque[KvEvent] = deque(maxlen=buffer_events)
        # A subscriber holds no more than the buffer: it is cut off before it has fallen further
        # behind than a resume could replay (with no buffer there is no resuming anyway).
        self._subscriber_queue = min(subscriber_queue, buffer_events) if buffer_events > 0 else subscriber_queue
        self._subscriptions: set[Subscription | Tap] = set()
        self._listeners: list[Listener] = []
        self.last_seq = 0
        self._soon: tuple[tuple[EventType, Cause, str, TierKind], list[ChunkId]] | None = None  # publish_soon's

    @property
    def buffer_events(self) -> int:
        return self._buffer.maxlen or 0

    @property
    def subscriber_queue(self) -> int:
        """Events a subscriber may fall behind by before it is cut off."""
        return self._subscriber_queue

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def publish(self, type: EventType, cause: Cause, tier: str, tier_kind: TierKind, chunks: Iterable[ChunkId]) -> None:
        """One event per namespace among `chunks` (keys keep their order), split into events of
        at most MAX_EVENT_KEYS keys."""
        self._flush_soon()
        by_ns: dict[str, list[bytes]] = {}
        for ns, key in chunks:
            by_ns.setdefault(ns, []).append(key)
        now = time.time()
        for ns, keys in by_ns.items():
            for first in range(0, len(keys), MAX_EVENT_KEYS):
                self._emit(
                    KvEvent(
                        next(self._seq),
                        now,
                        type,
                        cause,
                        tier,
                        tier_kind,
                        ns,
                        tuple(keys[first : first + MAX_EVENT_KEYS]),
                    )
                )

    def publish_soon(
        self, type: EventType, cause: Cause, tier: str, tier_kind: TierKind, chunks: Iterable[ChunkId]
    ) -> None:
        """publish(), at the end of this loop turn, together with the other calls of the same kind
        made meanwhile: chunks that complete one by one (a batch of promotions) make one event per
        namespace, so each subscriber (a peer following this daemon) gets one message, not one per
        chunk. An event of another kind published meanwhile flushes these first: events keep the
        order of the calls."""
        kind = (type, cause, tier, tier_kind)
        if self._soon is not None and self._soon[0] != kind:
            self._flush_soon()
        if self._soon is None:
            self._soon = (kind, [])
            asyncio.get_running_loop().call_soon(self._flush_soon)
        self._soon[1].extend(chunks)

    def flush_soon(self) -> None:
        """Publish what publish_soon holds now (an interval ending)."""
        self._flush_soon()

    def _flush_soon(self) -> None:
        if self._soon is not None:
            (type, cause, tier, tier_kind), chunks = self._soon
            self._soon = None
            self.publish(type, cause, tier, tier_kind, chunks)

    def publish_cleared(self, tier: str, tier_kind: TierKind, namespace_id: str) -> None:
        self._flush_soon()
        self._emit(
            KvEvent(next(self._seq), time.time(), EventType.CLEARED, Cause.DELETED, tier, tier_kind, namespace_id, ())
        )

    def _emit(self, event: KvEvent) -> None:
        self.last_seq = event.seq
        self._buffer.append(event)
        for sub in self._subscriptions:
            sub.offer(event)
        for listener in self._listeners:
            listener(event)

    @property
    def oldest_seq(self) -> int:
        """The seq of the oldest event still buffered (the next seq when none is)."""
        return self._buffer[0].seq if self._buffer else self.last_seq + 1

    def replay(self, from_seq: int) -> list[KvEvent]:
        """Buffered events with seq >= from_seq (older ones are gone: compare with oldest_seq)."""
        return [e for e in self._buffer if e.seq >= from_seq]

    def subscribe(self, accepts: EventFilter = everything) -> Subscription:
        sub = Subscription(self._subscriber_queue, accepts)
        self._subscriptions.add(sub)
        return sub

    def listen(self, take: Listener, accepts: EventFilter = everything) -> Tap:
        """Like subscribe(), but `take` gets each accepted event as it is published."""
        tap = Tap(take, accepts)
        self._subscriptions.add(tap)
        return tap

    def unsubscribe(self, sub: Subscription | Tap) -> None:
        self._subscriptions.discard(sub)

    def close(self) -> None:
        """End every subscription (daemon shutdown): streams finish instead of being cut."""
        self._flush_soon()
        for sub in self._subscriptions:
            if isinstance(sub, Tap):
                continue
            while True:
                try:
                    sub.queue.put_nowait(None)
                    break
                except asyncio.QueueFull:
                    sub.queue.get_nowait()
