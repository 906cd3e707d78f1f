# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The ZMQ publisher as a router sees it (real sockets, in process): coalescing per interval,
connect or bind, batches held while no router is there, per-model topics, resync."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq

from kvstored.chunks.ids import TierKind
from kvstored.config import ConfigError, load_config
from kvstored.events.bus import Cause, EventBus, EventType
from kvstored.events.coalesce import Change, Coalescer
from kvstored.events.endpoints import is_bind_endpoint
from kvstored.events.identity import BlockIdentity, IdentityBook
from kvstored.events.zmq_publisher import END_SEQ, ZmqEventPublisher, ZmqSettings, place_of
from tests.support.ports import free_port

NS_A, NS_B = "a" * 32, "b" * 32
MODELS = {NS_A: "org/model-a", NS_B: "org/model-b"}
RECV_GUARD_MS = 10_000


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _identity(i: int, parent: int | None = None) -> BlockIdentity:
    return BlockIdentity.of([4 * i + b + 1 for b in range(4)], parent, list(range(64 * i, 64 * i + 64)), 16)


def _stored(bus: EventBus, tier: str, kind: TierKind, ns: str, *keys: int) -> None:
    bus.publish(EventType.STORED, Cause.STORED, tier, kind, [(ns, _key(k)) for k in keys])


def _removed(bus: EventBus, tier: str, kind: TierKind, ns: str, *keys: int) -> None:
    bus.publish(EventType.REMOVED, Cause.EVICTED, tier, kind, [(ns, _key(k)) for k in keys])


# -- the coalescer ----------------------------------------------------------------------------


def test_coalescer_reports_net_changes_per_place_only():
    bus = EventBus()
    c: Coalescer = Coalescer(place_of)
    bus.add_listener(c.add)
    _stored(bus, "ram", TierKind.RAM, NS_A, 1, 2)
    _stored(bus, "fs", TierKind.FS, NS_A, 1)
    _removed(bus, "ram", TierKind.RAM, NS_A, 2)  # stored and gone within the interval: nothing
    assert c.take() == [
        Change(NS_A, _key(1), ("CPU", "LOCAL"), True),
        Change(NS_A, _key(1), ("STORAGE", "LOCAL"), True),
    ]
    _removed(bus, "ram", TierKind.RAM, NS_A, 1)
    _stored(bus, "ram", TierKind.RAM, NS_A, 1)  # evicted, promoted back: no change
    assert c.take() == []
    assert c.take() == []


def test_coalescer_removes_a_place_when_its_last_tier_drops_the_chunk():
    bus = EventBus()
    c: Coalescer = Coalescer(lambda e: "disk")  # two tiers, one place
    bus.add_listener(c.add)
    _stored(bus, "fs-a", TierKind.FS, NS_A, 1)
    _stored(bus, "fs-b", TierKind.FS, NS_A, 1)
    assert c.take() == [Change(NS_A, _key(1), "disk", True)]
    _removed(bus, "fs-a", TierKind.FS, NS_A, 1)
    assert c.take() == []
    _removed(bus, "fs-b", TierKind.FS, NS_A, 1)
    assert c.take() == [Change(NS_A, _key(1), "disk", False)]
    assert list(c.held()) == []


def test_peer_tier_chunks_are_not_the_nodes_own():
    bus = EventBus()
    c: Coalescer = Coalescer(place_of)
    bus.add_listener(c.add)
    _stored(bus, "peer", TierKind.PEER, NS_A, 1)
    assert c.take() == []


# -- the publisher ----------------------------------------------------------------------------


def test_bind_or_connect_follows_vllms_rule():
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("ipc:///run/kv.sock")
    assert not is_bind_endpoint("tcp://router:5557") and not is_bind_endpoint("tcp://127.0.0.1:5557")


def test_topic_template_is_checked():
    with pytest.raises(ConfigError, match="events_zmq_topic"):
        load_config(env={"KVSTORED_EVENTS_ZMQ_TOPIC": "kv@{pod}@{model}"})
    with pytest.raises(ConfigError, match="events_node"):
        load_config(env={"KVSTORED_EVENTS_NODE": "a@b"})


class _Node:
    """A bus with a publisher and the identities of keys 0..n, as the daemon wires them."""

    def __init__(self, settings: ZmqSettings, identified: int = 64) -> None:
        self.bus = EventBus()
        self.identities = IdentityBook()
        for i in range(identified):
            for ns in MODELS:
                self.identities.offer(ns, _key(i), _identity(i, 4 * i if i else None))
        self.publisher = ZmqEventPublisher(settings, self.identities, MODELS.__getitem__)
        self.bus.add_listener(self.publisher)

    async def __aenter__(self) -> _Node:
        self.publisher.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.publisher.close()


def _recv(sock: zmq.Socket) -> tuple[bytes, int, list]:
    assert sock.poll(RECV_GUARD_MS), "no batch came"
    topic, seq, payload = sock.recv_multipart()
    return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)


async def test_connects_to_a_router_that_binds_and_holds_batches_until_it_subscribes():
    port = free_port()
    settings = ZmqSettings(f"tcp://127.0.0.1:{port}", topic="kv@{node}@{model}", node="n1", interval_s=3600)
    ctx = zmq.Context()
    try:
        async with _Node(settings) as node:
            _stored(node.bus, "ram", TierKind.RAM, NS_A, 0, 1)
            node.publisher.flush()  # no router yet: held
            assert node.publisher.last_seq == 0
            sub = ctx.socket(zmq.SUB)  # the router binds, the node's PUB connects (llm-d's shape)
            sub.bind(f"tcp://127.0.0.1:{port}")
            sub.subscribe(b"kv@")
            _stored(node.bus, "ram", TierKind.RAM, NS_B, 2)
            for _ in range(200):  # until the subscription has come through (ZMQ reconnects by itself)
                node.publisher.flush()
                if sub.poll(50):
                    break
            received = [_recv(sub), _recv(sub)]
    finally:
        ctx.destroy(linger=0)
    (t0, s0, b0), (t1, s1, b1) = received
    assert (t0, s0, t1, s1) == (b"kv@n1@org/model-a", 0, b"kv@n1@org/model-b", 1)
    ts, events, dp_rank = b0
    assert isinstance(ts, float) and dp_rank == 0
    assert [e["block_hashes"] for e in events] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert [e["parent_block_hash"] for e in events] == [None, 4]
    assert events[1]["token_ids"] == list(range(64, 128))
    assert all(e["block_size"] == 16 and e["medium"] == "CPU" and "ownership" not in e for e in events)
    assert b1[1][0]["block_hashes"] == [9, 10, 11, 12]


async def test_held_batches_are_bounded_while_no_router_is_there():
    port = free_port()
    settings = ZmqSettings(f"tcp://127.0.0.1:{port}", topic="kv", queue_batches=2, interval_s=3600)
    ctx = zmq.Context()
    try:
        async with _Node(settings) as node:
            for i in range(5):
                _stored(node.bus, "ram", TierKind.RAM, NS_A, i)
                node.publisher.flush()
            assert node.publisher.counts.held_dropped == 3
            sub = ctx.socket(zmq.SUB)
            sub.bind(f"tcp://127.0.0.1:{port}")
            sub.subscribe(b"")
            for _ in range(200):
                node.publisher.flush()
                if sub.poll(50):
                    break
            got = [_recv(sub)[1] for _ in range(2)]
    finally:
        ctx.destroy(linger=0)
    assert got == [3, 4]  # the newest two; the rest only by replay


async def test_removals_name_every_block_per_medium_and_unidentified_chunks_stay_out():
    replay_port = free_port()
    settings = ZmqSettings("tcp://127.0.0.1:*", f"tcp://127.0.0.1:{replay_port}", topic="kv", interval_s=3600)
    async with _Node(settings, identified=2) as node:
        _stored(node.bus, "ram", TierKind.RAM, NS_A, 0, 1, 99)  # 99: stored without an identity
        _stored(node.bus, "fs", TierKind.FS, NS_A, 0)
        _stored(node.bus, "s3", TierKind.S3, NS_A, 0)
        node.publisher.flush()
        _removed(node.bus, "ram", TierKind.RAM, NS_A, 0, 1, 99)
        node.publisher.flush()
        batches = await asyncio.to_thread(_replay, replay_port, 0)
        assert node.publisher.counts.unidentified == 2
    (_, stored), (_, removed) = batches
    assert [(e["type"], e["medium"], e["locality"]) for e in stored] == [
        ("BlockStored", "CPU", "LOCAL"),
        ("BlockStored", "CPU", "LOCAL"),
        ("BlockStored", "STORAGE", "LOCAL"),
        ("BlockStored", "STORAGE", "REMOTE"),
    ]
    assert removed == [
        {
            "type": "BlockRemoved",
            "block_hashes": [1, 2, 3, 4, 5, 6, 7, 8],
            "medium": "CPU",
            "group_idx": 0,
            "locality": "LOCAL",
        }
    ]


async def test_a_router_that_lost_track_gets_a_snapshot_per_model():
    replay_port = free_port()
    settings = ZmqSettings(
        "tcp://127.0.0.1:*", f"tcp://127.0.0.1:{replay_port}", topic="kv@{model}", buffer_batches=2, interval_s=3600
    )
    async with _Node(settings) as node:
        for i in range(4):  # seqs 0-3; only 2 and 3 buffered
            _stored(node.bus, "ram", TierKind.RAM, NS_A if i % 2 else NS_B, i)
            node.publisher.flush()
        _removed(node.bus, "ram", TierKind.RAM, NS_B, 0)  # not yet flushed: the resync flushes first
        batches = await asyncio.to_thread(_replay, replay_port, 1)
        assert node.publisher.counts.resyncs == 1
        normal = await asyncio.to_thread(_replay, replay_port, 3)
    seqs = {seq for seq, _ in batches}
    assert seqs == {4}  # the state as of the last batch sent (the removal's)
    first = batches[0][1]
    assert first == [{"type": "AllBlocksCleared"}]
    held = {(e["block_hashes"][0]) for _, events in batches[1:] for e in events}
    assert held == {5, 9, 13}  # keys 1, 2, 3; key 0 was removed
    assert [seq for seq, _ in normal] == [3, 4]


def _replay(port: int, start: int) -> list[tuple[int, list]]:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.RCVTIMEO = RECV_GUARD_MS
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, list]] = []
        while True:
            _, _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
    finally:
        ctx.destroy(linger=0)
