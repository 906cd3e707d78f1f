# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The WatchEvents stream: buffered events from a seq, then live ones; one message per bus event,
or, coalesced, the net changes once per interval (what a peer's follower asks for: a node that
writes down and evicts one chunk at a time would otherwise cost each follower a message per key).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvstored.errors import WatcherLagged
from kvstored.events.bus import MAX_EVENT_KEYS, EventBus, EventFilter, KvEvent, Subscription
from kvstored.events.coalesce import net_events
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
    bus: EventBus, accepts: EventFilter, from_seq: int, interval_s: float
) -> AsyncIterator[pb.KvEvent]:
    """The net changes of each interval (coalesce.net_events) in one message (`partial` on all
    but the last where it takes several); the replay from from_seq is one interval. An idle
    stream waits for an event, then gathers for interval_s."""
    sub = bus.subscribe(accepts)
    try:
        last = 0
        pending: list[KvEvent] = []
        if from_seq:
            pending = [e for e in bus.replay(from_seq) if accepts(e)]
            last = bus.last_seq
        while True:
            for message in interval_messages(pending):
                yield message
            if sub.lagged and sub.queue.empty():
                raise _lagged(last)
            first = await sub.queue.get()
            if first is None:
                return
            await asyncio.sleep(interval_s)
            pending, closed = _drain(sub, first, last)
            last = max(last, pending[-1].seq) if pending else last
            if closed:
                for message in interval_messages(pending):
                    yield message
                return
    finally:
        bus.unsubscribe(sub)


def _drain(sub: Subscription, first: KvEvent, after: int) -> tuple[list[KvEvent], bool]:
    """The events queued now (past `after`: the replay may have covered some), and whether the
    bus closed."""
    events = [first] if first.seq > after else []
    while True:
        try:
            event = sub.queue.get_nowait()
        except asyncio.QueueEmpty:
            return events, False
        if event is None:
            return events, True
        if event.seq > after:
            events.append(event)


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
