# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The WatchEvents stream: buffered events from a seq, then live ones; one message per bus event,
or, coalesced, the net changes once per interval (what a peer's follower asks for: a node that
writes down and evicts one chunk at a time would otherwise cost each follower a message per key).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Hashable

from kvstored.errors import WatcherLagged
from kvstored.events.bus import MAX_EVENT_KEYS, EventBus, EventFilter, KvEvent
from kvstored.events.coalesce import net_events
from kvstored.events.feed import IntervalFeeds
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb


def to_proto(e: KvEvent, numbered: bool = True) -> pb.KvEvent:
    """numbered=False: a coalesced message's change (its message carries the seq and time)."""
    return pb.KvEvent(
        seq=e.seq if numbered else 0,
        ts=e.ts if numbered else 0.0,
        type=int(e.type),
        cause=int(e.cause),
        tier=e.tier,
        tier_kind=int(e.tier_kind),
        namespace_id=e.namespace_id,
        keys=e.keys,
    )


def _lagged(last: int) -> WatcherLagged:
    return WatcherLagged(f"event watcher fell behind after seq {last}; resume with from_seq={last + 1}")


async def each_event(bus: EventBus, accepts: EventFilter, from_seq: int) -> AsyncIterator[pb.KvEvent]:
    """Every event, one message each. (The caller has checked from_seq is still buffered.)"""
    sub = bus.subscribe(accepts)  # before the replay, so no event falls between the two
    try:
        last = 0
        if from_seq:
            for event in bus.replay(from_seq):
                if accepts(event):
                    yield to_proto(event)
                last = event.seq
        while True:
            live = await sub.queue.get()
            if live is None:
                return
            if live.seq > last:
                yield to_proto(live)
                last = live.seq
            if sub.lagged and sub.queue.empty():
                raise _lagged(last)
    finally:
        bus.unsubscribe(sub)


async def net_changes(
    feeds: IntervalFeeds, audience: Hashable, accepts: EventFilter, from_seq: int
) -> AsyncIterator[bytes]:
    """The net changes of each interval (coalesce.net_events), encoded: the audience's feed's
    messages, the same bytes for every stream of the audience (feed.py); first the replay from
    from_seq up to the feed's interval, as one interval of this stream's own."""
    replay, stream = feeds.join(audience, accepts, from_seq)
    try:
        last = 0
        for payload in encode_interval(replay):
            yield payload
        if replay:
            last = replay[-1].seq
        while True:
            message = await stream.next()
            if message is None:
                if stream.lagged:
                    raise _lagged(last)
                return
            yield message.payload
            if message.events:  # the last of its interval: resumable after it
                last = message.seq
    finally:
        feeds.leave(audience, stream)


def encode_interval(events: list[KvEvent]) -> list[bytes]:
    """An interval's messages (interval_messages), encoded once for every stream that sends them."""
    return [m.SerializeToString() for m in interval_messages(events)]


def interval_messages(events: list[KvEvent]) -> list[pb.KvEvent]:
    """An interval's net changes as one message (several past MAX_EVENT_KEYS keys, as the bus
    splits events: a message a follower can always take)."""
    net = net_events(events)
    if not net:
        return []
    packs: list[list[KvEvent]] = [[]]
    keys = 0
    for change in net:
        if packs[-1] and keys + len(change.keys) > MAX_EVENT_KEYS:
            packs.append([])
            keys = 0
        packs[-1].append(change)
        keys += len(change.keys)
    last = events[-1]
    return [
        pb.KvEvent(
            seq=last.seq, ts=last.ts, changes=[to_proto(c, numbered=False) for c in pack], partial=i < len(packs) - 1
        )
        for i, pack in enumerate(packs)
    ]
