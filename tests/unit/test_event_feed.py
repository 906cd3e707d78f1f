# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Interval feeds in one process: coalesced streams of one audience share one encoded interval;
a late stream resumes from a seq without a gap or a repeat; a slow one is cut off alone."""

from __future__ import annotations

import asyncio

import pytest

from kvstored.chunks.ids import TierKind
from kvstored.errors import WatcherLagged
from kvstored.events.bus import Cause, EventBus, EventType, KvEvent, everything
from kvstored.events.feed import IntervalFeeds
from kvstored.server.watch import encode_interval, net_changes
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

NS = "0123456789abcdef0123456789abcdef"
PUBLIC = ""  # the audience of streams without a session


def _store(bus: EventBus, first: int, count: int, tier: str = "ram") -> list[bytes]:
    keys = [i.to_bytes(32, "big") for i in range(first, first + count)]
    for key in keys:
        bus.publish(EventType.STORED, Cause.STORED, tier, TierKind.RAM, [(NS, key)])
    return keys


class Counted:
    """encode_interval, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, events: list[KvEvent]) -> list[bytes]:
        self.calls += 1
        return encode_interval(events)


def _stored(payloads: list[bytes]) -> list[bytes]:
    messages = [pb.KvEvent.FromString(p) for p in payloads]
    return [k for m in messages for c in m.changes if c.type == pb.EVENT_TYPE_STORED for k in c.keys]


async def _take(stream_iter, count: int) -> list[bytes]:
    return [await anext(stream_iter) for _ in range(count)]


async def test_streams_of_one_audience_get_the_same_encoded_interval_encoded_once():
    bus = EventBus()
    encode = Counted()
    feeds = IntervalFeeds(bus, 0.01, encode)
    a = net_changes(feeds, PUBLIC, everything, 0)
    b = net_changes(feeds, PUBLIC, everything, 0)
    first_a, first_b = asyncio.ensure_future(anext(a)), asyncio.ensure_future(anext(b))
    await asyncio.sleep(0)  # both joined
    keys = _store(bus, 0, 10)
    feeds.flush()
    got_a, got_b = await first_a, await first_b
    assert got_a is got_b  # the very same bytes
    assert encode.calls == 1
    assert _stored([got_a]) == keys
    assert pb.KvEvent.FromString(got_a).seq == bus.last_seq
    await a.aclose()
    await b.aclose()


async def test_a_stream_joining_mid_interval_replays_up_to_it_and_repeats_nothing():
    bus = EventBus()
    feeds = IntervalFeeds(bus, 0.01, encode_interval)
    early = net_changes(feeds, PUBLIC, everything, 0)
    pending = asyncio.ensure_future(anext(early))
    await asyncio.sleep(0)
    before = _store(bus, 0, 5)
    feeds.flush()  # an interval the late stream was not there for
    await pending
    during = _store(bus, 5, 5)  # the feed's current interval, half gone when the late one joins
    late = net_changes(feeds, PUBLIC, everything, 1)
    replayed = await anext(late)  # its own replay: up to where the feed's interval begins
    assert _stored([replayed]) == before
    assert pb.KvEvent.FromString(replayed).seq == 5
    after = _store(bus, 10, 5)
    feeds.flush()
    live = await anext(late)
    assert _stored([live]) == during + after  # the whole interval, once
    assert pb.KvEvent.FromString(live).seq == bus.last_seq
    assert await anext(early) is live
    await early.aclose()
    await late.aclose()


async def test_a_slow_stream_is_cut_off_alone_and_told_where_to_resume():
    bus = EventBus(buffer_events=8)  # a stream may hold 8 events' worth of messages
    feeds = IntervalFeeds(bus, 0.01, encode_interval)
    slow = net_changes(feeds, PUBLIC, everything, 0)
    fast = net_changes(feeds, PUBLIC, everything, 0)
    first_slow, first_fast = asyncio.ensure_future(anext(slow)), asyncio.ensure_future(anext(fast))
    await asyncio.sleep(0)
    _store(bus, 0, 3)
    feeds.flush()
    got_slow, got_fast = [await first_slow], [await first_fast]
    for i in range(1, 6):  # 5 more intervals of 3 events; the slow stream reads none meanwhile
        _store(bus, i * 3, 3)
        feeds.flush()
        got_fast.append(await anext(fast))
        if i == 3:  # the interval the slow stream had no room for
            oldest_at_cut_off = bus.oldest_seq
    assert _stored(got_fast) == [k.to_bytes(32, "big") for k in range(18)]  # not held up
    with pytest.raises(WatcherLagged) as lagged:
        while True:
            got_slow.append(await anext(slow))
    # It holds what fitted (whole intervals), then ends; resuming after its last one loses nothing.
    seqs = [pb.KvEvent.FromString(p).seq for p in got_slow]
    assert seqs == [3, 6, 9]
    assert "from_seq=10" in str(lagged.value)
    assert oldest_at_cut_off <= 10  # (as with an event-by-event stream, while the buffer keeps it)
    await fast.aclose()


async def test_closing_sends_the_last_interval_then_ends_every_stream():
    bus = EventBus()
    feeds = IntervalFeeds(bus, 60.0, encode_interval)  # (the timer never fires here)
    timer = asyncio.create_task(feeds.run())
    stream = net_changes(feeds, PUBLIC, everything, 0)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    keys = _store(bus, 0, 4)
    timer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await timer
    feeds.close()
    assert _stored([await first]) == keys
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_the_timer_sends_an_interval_after_its_first_event():
    bus = EventBus()
    feeds = IntervalFeeds(bus, 0.01, encode_interval)
    timer = asyncio.create_task(feeds.run())
    try:
        stream = net_changes(feeds, PUBLIC, everything, 0)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        keys = _store(bus, 0, 3)
        assert _stored([await asyncio.wait_for(first, 10)]) == keys
        await stream.aclose()
    finally:
        timer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await timer
