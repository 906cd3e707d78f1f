# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The event bus and the ZMQ publisher in one process: subscriber cut-off and ZMQ replay."""

from __future__ import annotations

import asyncio
import socket

import zmq

from kvstored.chunks.ids import TierKind
from kvstored.events.bus import Cause, EventBus, EventType
from kvstored.events.identity import BlockIdentity, IdentityBook
from kvstored.events.zmq_publisher import END_SEQ, ZmqEventPublisher, ZmqSettings

NS = "0123456789abcdef0123456789abcdef"
BATCHES = 10_000  # the default events_buffer
KEYS_PER_BATCH = 64  # a write-down wave: ~2.5 KiB per batch
HANG_GUARD_MS = 20_000


def _tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _publish_stored(bus: EventBus, count: int, keys_per_event: int = 1, first: int = 0) -> None:
    for i in range(first, first + count):
        keys = [(i * keys_per_event + j).to_bytes(32, "big") for j in range(keys_per_event)]
        bus.publish(EventType.STORED, Cause.WRITTEN_DOWN, "fs", TierKind.FS, [(NS, k) for k in keys])


def test_subscriber_is_cut_off_before_more_events_wait_than_the_buffer_keeps():
    bus = EventBus(buffer_events=16)  # the subscriber queue would default to 10,000
    sub = bus.subscribe()
    _publish_stored(bus, 16)
    assert not sub.lagged
    _publish_stored(bus, 1)
    assert sub.lagged  # the 17th found the queue full
    taken = [sub.queue.get_nowait().seq for _ in range(sub.queue.qsize())]
    assert taken == list(range(1, 17))
    # Where the watcher resumes (the first event it was not given) is still buffered.
    resume = taken[-1] + 1
    assert bus.oldest_seq <= resume
    assert [e.seq for e in bus.replay(resume)] == list(range(resume, bus.last_seq + 1))


def _replay_to_late_reader(endpoint: str) -> tuple[list[int], bool]:
    """Ask for a replay from seq 0 and read it only once the daemon has handed all of it to ZMQ;
    returns the seqs received and whether the end marker came."""
    ctx = zmq.Context()
    try:
        late = ctx.socket(zmq.DEALER)
        late.RCVTIMEO = HANG_GUARD_MS
        late.connect(endpoint)
        late.send_multipart([b"", (0).to_bytes(8, "big")])
        assert late.poll(HANG_GUARD_MS, zmq.POLLIN), "the replay never started"  # started, nothing read
        # Requests are answered one after the other: once a second one is, the first replay
        # has been sent in full, while `late` has read none of it.
        other = ctx.socket(zmq.DEALER)
        other.RCVTIMEO = HANG_GUARD_MS
        other.connect(endpoint)
        other.send_multipart([b"", (1 << 62).to_bytes(8, "big")])
        assert other.recv_multipart()[2] == END_SEQ
        seqs: list[int] = []
        while True:
            try:
                _, _, seq, _ = late.recv_multipart()
            except zmq.Again:  # the end marker was dropped
                return seqs, False
            if seq == END_SEQ:
                return seqs, True
            seqs.append(int.from_bytes(seq, "big"))
    finally:
        ctx.destroy(linger=0)


async def test_zmq_replay_of_a_full_buffer_reaches_a_reader_that_starts_late():
    replay_endpoint = _tcp_endpoint()
    bus = EventBus(BATCHES)
    identities = IdentityBook(pending_limit=BATCHES * KEYS_PER_BATCH)
    publisher = ZmqEventPublisher(
        ZmqSettings(_tcp_endpoint(), replay_endpoint, "kv", buffer_batches=BATCHES, interval_s=3600),
        identities,
        lambda ns: "m",
    )
    publisher.start()
    bus.add_listener(publisher)
    identity = BlockIdentity.of([1, 2, 3, 4], None, list(range(64)), 16)
    try:
        for i in range(BATCHES - 1):  # one interval per event: one batch each, after seq 0 (AllBlocksCleared)
            for j in range(KEYS_PER_BATCH):
                identities.offer(NS, (i * KEYS_PER_BATCH + j).to_bytes(32, "big"), identity)
            _publish_stored(bus, 1, KEYS_PER_BATCH, first=i)
            publisher.flush()
        seqs, ended = await asyncio.to_thread(_replay_to_late_reader, replay_endpoint)
    finally:
        await publisher.close()
    assert (len(seqs), ended) == (BATCHES, True)
    assert seqs == list(range(BATCHES))


def test_a_removal_of_millions_of_keys_is_published_in_events_a_grpc_client_can_read():
    """A ClearNamespace's removals come as several events of at most MAX_EVENT_KEYS keys, in
    order, each one WatchEvents message under gRPC's default 4 MiB receive limit (one event of
    1.9M keys outgrew even a peer's 64 MiB limit, and no subscriber could read past it)."""
    from kvstored.events.bus import MAX_EVENT_KEYS
    from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

    bus = EventBus()
    sub = bus.subscribe()
    keys = [i.to_bytes(32, "big") for i in range(2 * MAX_EVENT_KEYS + 5)]
    bus.publish(EventType.REMOVED, Cause.DELETED, "ram", TierKind.RAM, [(NS, k) for k in keys])
    events = [sub.queue.get_nowait() for _ in range(sub.queue.qsize())]
    assert [len(e.keys) for e in events] == [MAX_EVENT_KEYS, MAX_EVENT_KEYS, 5]
    assert [k for e in events for k in e.keys] == keys
    assert [e.seq for e in events] == [1, 2, 3] and bus.last_seq == 3
    sizes = [
        pb.KvEvent(seq=e.seq, ts=e.ts, namespace_id=e.namespace_id, tier=e.tier, keys=e.keys).ByteSize() for e in events
    ]
    assert max(sizes) < 4 << 20
