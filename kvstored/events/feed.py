# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Interval feeds: the coalesced WatchEvents streams of one audience share one feed.

An audience is a set of streams that see the same events (the same filter: peers' followers all
see the public namespaces). Its feed gathers the audience's bus events of one interval, has them
encoded once (net changes, coalesce.net_events, as one or a few messages), and hands the same
encoded messages to every stream of the audience: the publisher's cost per follower is one
queued reference and one gRPC write per interval, not every raw event queued, filtered and
coalesced once per follower.

Seq/resume: a message carries the seq of the last event its interval covers (`partial` on all
but the last of an interval). A stream joining with from_seq first gets its own replay of the
buffered events from from_seq up to where the feed's current interval begins, then the feed's
messages; an interval's changes are each chunk's last, so a join in the middle of an interval
costs nothing twice. A stream whose queue holds more than `subscriber_queue` events' worth of
messages is cut off (lagged), exactly when an event-by-event stream would be: it resumes from
its last complete interval, still buffered.

The timer (run()) belongs to its owner's lifecycle; close() sends the last interval and ends
every stream.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvstored.events.bus import EventBus, EventFilter, KvEvent, Tap

Encode = Callable[[list[KvEvent]], list[bytes]]  # an interval's events -> its messages, encoded


@dataclass(frozen=True, slots=True)
class FeedMessage:
    payload: bytes  # the encoded message, shared by every stream of the audience
    seq: int  # the last seq its interval covers
    events: int  # bus events the message stands for (0 but on the last of an interval)


class FeedStream:
    """One WatchEvents stream on a feed: what it has not sent yet."""

    def __init__(self, limit: int) -> None:
        self._limit = limit  # bus events' worth of messages it may hold
        self._backlog = 0
        self._queue: deque[FeedMessage] = deque()
        self._ready = asyncio.Event()
        self.lagged = False  # its queue overflowed: it ends once what it holds is sent
        self.closed = False  # the feed closed: it ends once what it holds is sent

    def offer(self, messages: list[FeedMessage]) -> None:
        if self.lagged or self.closed:
            return
        events = sum(m.events for m in messages)
        if self._queue and self._backlog + events > self._limit:
            self.lagged = True  # (a whole interval or none: it resumes from its last complete one)
        else:
            self._queue.extend(messages)
            self._backlog += events
        self._ready.set()

    def end(self) -> None:
        self.closed = True
        self._ready.set()

    async def next(self) -> FeedMessage | None:
        """The next message; None when the stream must end (see lagged / closed)."""
        while not self._queue:
            if self.lagged or self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        message = self._queue.popleft()
        self._backlog -= message.events
        return message


class IntervalFeed:
    """One audience's interval: its bus events since the last flush."""

    def __init__(self, bus: EventBus, accepts: EventFilter, encode: Encode, wake: asyncio.Event) -> None:
        self._bus = bus
        self._encode = encode
        self._wake = wake
        self.pending: list[KvEvent] = []
        self.since = bus.last_seq + 1  # the first seq of the current interval
        self.streams: set[FeedStream] = set()
        self._tap: Tap = bus.listen(self._on_event, accepts)

    def _on_event(self, event: KvEvent) -> None:
        if not self.pending:
            self._wake.set()
        self.pending.append(event)

    def flush(self) -> None:
        events, self.pending = self.pending, []
        self.since = self._bus.last_seq + 1
        if not events:
            return
        payloads = self._encode(events)
        if not payloads:
            return
        seq = events[-1].seq
        messages = [FeedMessage(p, seq, 0) for p in payloads[:-1]]
        messages.append(FeedMessage(payloads[-1], seq, len(events)))
        for stream in self.streams:
            stream.offer(messages)

    def close(self) -> None:
        self._bus.unsubscribe(self._tap)


class IntervalFeeds:
    """Every audience's feed, and the timer that flushes them once per interval."""

    def __init__(self, bus: EventBus, interval_s: float, encode: Encode) -> None:
        self._bus = bus
        self._interval_s = interval_s
        self._encode = encode
        self._feeds: dict[Hashable, IntervalFeed] = {}
        self._wake = asyncio.Event()  # set by the first event of an interval
        self._closed = False

    def join(self, audience: Hashable, accepts: EventFilter, from_seq: int) -> tuple[list[KvEvent], FeedStream]:
        """A stream on `audience`'s feed (created on first use, with `accepts` its filter) and the
        buffered events it must replay first (from from_seq up to the feed's current interval;
        the caller has checked from_seq is still buffered)."""
        feed = self._feeds.get(audience)
        if feed is None:
            feed = self._feeds[audience] = IntervalFeed(self._bus, accepts, self._encode, self._wake)
        stream = FeedStream(self._bus.subscriber_queue)
        if self._closed:
            stream.end()
        feed.streams.add(stream)
        replay = [e for e in self._bus.replay(from_seq) if e.seq < feed.since and accepts(e)] if from_seq else []
        return replay, stream

    def leave(self, audience: Hashable, stream: FeedStream) -> None:
        feed = self._feeds.get(audience)
        if feed is None:
            return
        feed.streams.discard(stream)
        if not feed.streams:  # nobody to gather for
            feed.close()
            del self._feeds[audience]

    def flush(self) -> None:
        self._bus.flush_soon()
        for feed in self._feeds.values():
            feed.flush()

    async def run(self) -> None:
        """The timer: an interval starts with its first event and ends interval_s later (an idle
        daemon does not tick)."""
        while True:
            await self._wake.wait()
            await asyncio.sleep(self._interval_s)
            self._wake.clear()
            self.flush()

    def close(self) -> None:
        """Send the last interval, then end every stream (after what it holds)."""
        self.flush()
        self._closed = True
        for feed in self._feeds.values():
            for stream in feed.streams:
                stream.end()
