# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The ZMQ publisher as a router sees it (real sockets, in process): coalescing per interval,
connect or bind, batches held while no router is there, per-model topics, resync."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zmq

from kvstored.chunks.ids import TierKind
from kvstored.config import ConfigError, load_config
from kvstored.events import zmq_publisher
from kvstored.events.bus import Cause, EventBus, EventType
from kvstored.events.coalesce import Change, Coalescer
from kvstored.events.endpoints import is_bind_endpoint
from kvstored.events.identity import BlockIdentity, IdentityBook, ParentsFirst, encode_record
from kvstored.events.zmq_publisher import _SNAPSHOT_STEP, END_SEQ, ZmqEventPublisher, ZmqSettings, place_of
from tests.support.ports import free_port
from tests.support.zmq_events import replay

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

    def __init__(
        self,
        settings: ZmqSettings,
        identified: int = 64,
        known: list[str] | None = None,
        publishes: Callable[[str], bool] | None = None,
        ram_empty: bool = True,
    ) -> None:
        """known: the namespaces known as the daemon starts (its tiers' records); ram_empty
        False: RAM was handed over."""
        self.bus = EventBus()
        self.identities = IdentityBook()
        for i in range(identified):
            for ns in MODELS:
                self.identities.offer(ns, _key(i), _identity(i, 4 * i if i else None))
        self.publisher = ZmqEventPublisher(settings, self.identities, MODELS.__getitem__, publishes)
        self.bus.add_listener(self.publisher)
        self.known = known
        self.ram_empty = ram_empty

    async def __aenter__(self) -> _Node:
        self.publisher.start(self.known or (), ram_empty=self.ram_empty)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.publisher.close()


def _per_model_topics(port: int) -> ZmqSettings:
    """Batches for a router on `port`, a topic per model, sent only when flushed."""
    return ZmqSettings(f"tcp://127.0.0.1:{port}", topic="kv@{node}@{model}", node="n1", interval_s=3600)


def _router(ctx: zmq.Context, port: int, topic: bytes) -> zmq.Socket:
    """A router's SUB socket: it binds, the node's PUB connects (llm-d's shape)."""
    sub = ctx.socket(zmq.SUB)
    sub.bind(f"tcp://127.0.0.1:{port}")
    sub.subscribe(topic)
    return sub


def _flush_until_sent(node: _Node, sub: zmq.Socket) -> None:
    """Flush until `sub` has something to read (its subscription has come through; batches wait till then)."""
    for _ in range(200):
        node.publisher.flush()
        if sub.poll(50):
            return


def _recv(sock: zmq.Socket) -> tuple[bytes, int, list]:
    assert sock.poll(RECV_GUARD_MS), "no batch came"
    topic, seq, payload = sock.recv_multipart()
    return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)


async def test_connects_to_a_router_that_binds_and_holds_batches_until_it_subscribes():
    port = free_port()
    settings = _per_model_topics(port)
    ctx = zmq.Context()
    try:
        async with _Node(settings) as node:
            _stored(node.bus, "ram", TierKind.RAM, NS_A, 0, 1)
            node.publisher.flush()  # no router yet: held (after seq 0, AllBlocksCleared)
            assert node.publisher.last_seq == 1
            sub = _router(ctx, port, b"kv@")
            _stored(node.bus, "ram", TierKind.RAM, NS_B, 2)
            _flush_until_sent(node, sub)  # until the subscription has come through (ZMQ reconnects by itself)
            received = [_recv(sub), _recv(sub), _recv(sub)]
    finally:
        ctx.destroy(linger=0)
    (tc, sc, bc), (t0, s0, b0), (t1, s1, b1) = received
    assert (tc, sc, bc[1]) == (b"kv@n1@", 0, [{"type": "AllBlocksCleared"}])  # every model's: no model
    assert (t0, s0, t1, s1) == (b"kv@n1@org/model-a", 1, b"kv@n1@org/model-b", 2)
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
            assert node.publisher.counts.held_dropped == 4  # seq 0 (AllBlocksCleared) and 1-3
            sub = _router(ctx, port, b"")
            _flush_until_sent(node, sub)
            got = [_recv(sub)[1] for _ in range(2)]
    finally:
        ctx.destroy(linger=0)
    assert got == [4, 5]  # the newest two; the rest only by replay


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
    (_, cleared), (_, stored), (_, removed) = batches
    assert cleared == [{"type": "AllBlocksCleared"}]
    # key 1 (its parent: key 0's last block) after every place of key 0
    assert [(e["type"], e["block_hashes"][0], e["medium"], e["locality"]) for e in stored] == [
        ("BlockStored", 1, "CPU", "LOCAL"),
        ("BlockStored", 1, "STORAGE", "LOCAL"),
        ("BlockStored", 1, "STORAGE", "REMOTE"),
        ("BlockStored", 5, "CPU", "LOCAL"),
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
        for i in range(4):  # seqs 1-4 (0: AllBlocksCleared); only 3 and 4 buffered
            _stored(node.bus, "ram", TierKind.RAM, NS_A if i % 2 else NS_B, i)
            node.publisher.flush()
        _removed(node.bus, "ram", TierKind.RAM, NS_B, 0)  # not yet flushed: the resync flushes first
        raw = await asyncio.to_thread(replay, replay_port, 2)
        assert node.publisher.counts.resyncs == 1
        normal = await asyncio.to_thread(_replay, replay_port, 4)
    batches = [(topic, seq, msgpack.unpackb(payload)[1]) for topic, seq, payload in raw]
    assert {seq for _, seq, _ in batches} == {5}  # the state as of the last batch sent (the removal's)
    # AllBlocksCleared first, on the node's topic and on each model's: a router that takes the
    # model from the topic (llm-d) applies it to that model, and one subscribed to a single
    # model's topic sees it (the node's topic alone left both with the model's blocks before)
    cleared = [{"type": "AllBlocksCleared"}]
    assert [(topic, events) for topic, _, events in batches[:3]] == [
        (b"kv@", cleared),
        (b"kv@org/model-b", cleared),
        (b"kv@org/model-a", cleared),
    ]
    held = {(topic, e["block_hashes"][0]) for topic, _, events in batches[3:] for e in events}
    # keys 1, 2, 3 (key 0 was removed), each on its model's topic
    assert held == {(b"kv@org/model-a", 5), (b"kv@org/model-b", 9), (b"kv@org/model-a", 13)}
    assert [seq for seq, _ in normal] == [4, 5]


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


# -- per-model subscribers, restarts, parents, identities, resync cost --------------------------


async def _received_by_one_models_subscriber(also_model_a: bool) -> list[bytes]:
    """Topics a router subscribed to model-b's topic only receives over five intervals, each
    touching model-a first when `also_model_a`."""
    port = free_port()
    settings = _per_model_topics(port)
    ctx = zmq.Context()
    got = []
    try:
        async with _Node(settings) as node:
            sub = _router(ctx, port, b"kv@n1@org/model-b")
            for _ in range(200):  # until the subscription came through
                node.publisher.flush()
                if node.publisher._subscriptions:
                    break
                sub.poll(20)  # (a SUB attaches its pipes, and sends its subscription, when used)
            assert node.publisher._subscriptions == {b"kv@n1@org/model-b"}
            for i in range(5):
                if also_model_a:
                    _stored(node.bus, "ram", TierKind.RAM, NS_A, i)
                _stored(node.bus, "ram", TierKind.RAM, NS_B, i)
                node.publisher.flush()
            while sub.poll(300):
                got.append(sub.recv_multipart()[0])
    finally:
        ctx.destroy(linger=0)
    return got


async def test_a_router_subscribed_to_one_models_topic_gets_its_batches_whatever_else_is_published():
    assert await _received_by_one_models_subscriber(also_model_a=False) == [b"kv@n1@org/model-b"] * 5
    # model-a's batches (not subscribed) no longer hold model-b's back, nor get them dropped
    assert await _received_by_one_models_subscriber(also_model_a=True) == [b"kv@n1@org/model-b"] * 5


async def test_held_batches_go_to_the_topics_subscribed_and_the_others_are_dropped():
    port = free_port()
    settings = _per_model_topics(port)
    ctx = zmq.Context()
    try:
        async with _Node(settings) as node:
            for i in range(3):  # no router yet: model-a's and model-b's batches held in turn
                _stored(node.bus, "ram", TierKind.RAM, NS_A, i)
                node.publisher.flush()
                _stored(node.bus, "ram", TierKind.RAM, NS_B, i)
                node.publisher.flush()
            sub = _router(ctx, port, b"kv@n1@org/model-b")
            _flush_until_sent(node, sub)
            got = [_recv(sub)[:2] for _ in range(3)]
            assert not sub.poll(200)
            assert not node.publisher._held
    finally:
        ctx.destroy(linger=0)
    assert got == [(b"kv@n1@org/model-b", 2), (b"kv@n1@org/model-b", 4), (b"kv@n1@org/model-b", 6)]


async def test_a_restarted_daemon_tells_the_router_its_blocks_are_gone_at_seq_0():
    """Docs: a router that sees seq go back (a restart) replays from 0. The new daemon's RAM is
    empty: the replay starts with AllBlocksCleared, before what its fs tier read back."""
    replay_port = free_port()
    settings = ZmqSettings("tcp://127.0.0.1:*", f"tcp://127.0.0.1:{replay_port}", topic="kv", interval_s=3600)
    async with _Node(settings) as node:
        _stored(node.bus, "ram", TierKind.RAM, NS_A, 0, 1)
        node.publisher.flush()
    async with _Node(settings) as node:  # the restart
        node.publisher.restore("fs", TierKind.FS, [((NS_A, _key(2)), encode_record(_identity(2)))])
        _stored(node.bus, "ram", TierKind.RAM, NS_A, 5)
        node.publisher.flush()
        batches = await asyncio.to_thread(_replay, replay_port, 0)
    assert batches[0] == (0, [{"type": "AllBlocksCleared"}])
    assert [(e["block_hashes"][0], e["medium"]) for _, events in batches[1:] for e in events] == [
        (9, "STORAGE"),
        (21, "CPU"),
    ]


async def test_a_daemon_that_took_ram_over_clears_nothing():
    """After a hand-over RAM holds what the daemon before announced: a clear would make routers
    forget blocks still there (and this daemon cannot announce them again: their identities
    stayed with the old one). Its own events follow from seq 0."""
    replay_port = free_port()
    settings = ZmqSettings("tcp://127.0.0.1:*", f"tcp://127.0.0.1:{replay_port}", topic="kv", interval_s=3600)
    async with _Node(settings, known=[NS_A], ram_empty=False) as node:
        _stored(node.bus, "ram", TierKind.RAM, NS_A, 5)
        node.publisher.flush()
        batches = await asyncio.to_thread(_replay, replay_port, 0)
    assert [seq for seq, _ in batches] == [0]
    assert [e["type"] for _, events in batches for e in events] == ["BlockStored"]


async def test_a_starting_daemon_clears_every_known_models_topic_not_only_the_nodes():
    """Seq 0 went on the node's topic only (`kv@<node>@`): llm-d takes the model from the topic,
    so it cleared model "" and kept the real models' blocks of the daemon before, and a router
    subscribed to one model's topic never saw it. Each model known at the start (the tiers'
    records) gets its own AllBlocksCleared, right after seq 0; a namespace not published (a
    tenant's) none."""
    port, replay_port = free_port(), free_port()
    settings = ZmqSettings(
        f"tcp://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{replay_port}",
        topic="kv@{node}@{model}",
        node="n1",
        interval_s=3600,
    )
    tenant = "t" * 32  # (not in MODELS: asking its model fails)
    ctx = zmq.Context()
    try:
        async with _Node(settings, known=[NS_A, tenant, NS_B, NS_A], publishes=MODELS.__contains__) as node:
            sub = _router(ctx, port, b"kv@n1@org/model-b")  # a router for model-b only
            _stored(node.bus, "ram", TierKind.RAM, NS_B, 0)
            _flush_until_sent(node, sub)  # until the subscription has come through: held till then
            live = [_recv(sub), _recv(sub)]
            raw = await asyncio.to_thread(replay, replay_port, 0)
    finally:
        ctx.destroy(linger=0)
    cleared = [{"type": "AllBlocksCleared"}]
    (tc, sc, bc), (ts, ss, bs) = live
    assert (tc, sc, bc[1]) == (b"kv@n1@org/model-b", 2, cleared)
    assert (ts, ss, [e["block_hashes"] for e in bs[1]]) == (b"kv@n1@org/model-b", 3, [[1, 2, 3, 4]])
    assert [(topic, seq, msgpack.unpackb(payload)[1]) for topic, seq, payload in raw[:3]] == [
        (b"kv@n1@", 0, cleared),
        (b"kv@n1@org/model-a", 1, cleared),
        (b"kv@n1@org/model-b", 2, cleared),
    ]
    assert [(topic, seq) for topic, seq, _ in raw[3:]] == [(b"kv@n1@org/model-b", 3)]


def _chained(n: int) -> IdentityBook:
    """Keys 0..n-1 of NS_A, each chained onto the one before (one prompt, chunk by chunk)."""
    book = IdentityBook()
    for i in range(n):
        book.offer(NS_A, _key(i), _identity(i, 4 * i if i else None))
    return book


def _stored_order(batches: list[list]) -> list[int]:
    """The first block of each BlockStored, checking each comes after its parent if that is there."""
    stored = [e for events in batches for e in events if e["type"] == "BlockStored"]
    last = {e["block_hashes"][-1] for e in stored}
    known: set[int] = set()
    for e in stored:
        parent = e["parent_block_hash"]
        assert parent is None or parent not in last or parent in known, f"{e['block_hashes']} before its parent"
        known.update(e["block_hashes"])
    return [e["block_hashes"][0] for e in stored]


def test_a_resync_snapshot_names_each_parent_before_its_child():
    """A parent evicted and stored again is held after its child (dict order): a router applying
    the snapshot in order would meet the child first (Dynamo drops a block whose parent it does
    not know)."""
    settings = ZmqSettings("inproc://parents", topic="kv", interval_s=3600)
    bus, book = EventBus(), _chained(3)
    publisher = ZmqEventPublisher(settings, book, MODELS.__getitem__)
    bus.add_listener(publisher)
    _stored(bus, "ram", TierKind.RAM, NS_A, 0, 1, 2)
    publisher._publish(publisher._coalescer.take())
    _removed(bus, "fs", TierKind.FS, NS_A, 0)  # (not held there: no change, nothing forgotten)
    _removed(bus, "ram", TierKind.RAM, NS_A, 1)  # the middle one evicted...
    publisher._publish(publisher._coalescer.take())
    book.offer(NS_A, _key(1), _identity(1, 4))
    _stored(bus, "ram", TierKind.RAM, NS_A, 1)  # ... and stored again: held after its child, key 2
    publisher._publish(publisher._coalescer.take())
    snapshot = [msgpack.unpackb(payload)[1] for _, payload in publisher.snapshot()]
    assert snapshot[0] == [{"type": "AllBlocksCleared"}]
    assert _stored_order(snapshot) == [1, 5, 9]


def test_an_intervals_batch_names_each_parent_before_its_child():
    """A client storing a prompt's chunks last first (or two stores racing) touches a child
    before its parent within one interval."""
    settings = ZmqSettings("inproc://parents", topic="kv", interval_s=3600)
    bus = EventBus()
    publisher = ZmqEventPublisher(settings, _chained(4), MODELS.__getitem__)
    bus.add_listener(publisher)
    sent: list[bytes] = []
    publisher._send = lambda topic, payload: sent.append(payload)
    _stored(bus, "fs", TierKind.FS, NS_A, 3, 2)
    _stored(bus, "ram", TierKind.RAM, NS_A, 3, 1, 2, 0)
    publisher._publish(publisher._coalescer.take())
    (events,) = [msgpack.unpackb(p)[1] for p in sent]
    assert _stored_order([events]) == [1, 5, 9, 9, 13, 13]


def test_parents_first_survives_a_cycle_and_keeps_unrelated_items_in_order():
    order: ParentsFirst[str] = ParentsFirst()
    order.add("c", BlockIdentity.of([3], 2, [0], 1))  # c's parent is b's last block, b's is c's
    order.add("x", BlockIdentity.of([7], None, [0], 1))
    order.add("b", BlockIdentity.of([2], 3, [0], 1))
    order.add("y", BlockIdentity.of([8], 99, [0], 1))  # its parent is not there
    assert [item for item, _ in order] == ["b", "c", "x", "y"]


def test_identities_of_chunks_gone_within_an_interval_are_forgotten_and_a_new_one_is_taken():
    """The book keeps an identity while the node holds its chunk: a chunk stored and evicted
    within one interval makes no change, and was kept forever (and a later store of the key with
    another identity ignored)."""
    settings = ZmqSettings("inproc://forget", topic="kv", interval_s=3600)
    bus, book = EventBus(), IdentityBook()
    publisher = ZmqEventPublisher(settings, book, MODELS.__getitem__)
    bus.add_listener(publisher)
    for i in range(1000):
        book.offer(NS_A, _key(i), _identity(i))
        _stored(bus, "ram", TierKind.RAM, NS_A, i)
        _removed(bus, "ram", TierKind.RAM, NS_A, i)
    _stored(bus, "peer", TierKind.PEER, NS_A, 5)  # (another node's: not touched here)
    publisher._publish(publisher._coalescer.take())
    assert list(publisher._coalescer.held()) == []
    assert len(book) == 0
    book.offer(NS_A, _key(7), _identity(70))  # the key stored again, with other blocks
    _stored(bus, "ram", TierKind.RAM, NS_A, 7)
    publisher._publish(publisher._coalescer.take())
    assert book.get(NS_A, _key(7)) == _identity(70)


@pytest.mark.parametrize("models", [1, 250])
async def test_a_resync_of_a_large_node_does_not_hold_the_event_loop(
    models: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resync (anyone reaching the replay port with an old seq can ask for one) was built on
    the event loop in one go: ~1 s for 100k chunk-places, every RPC stalled meanwhile. Then it let
    the loop run only when one topic filled a batch: with many models, each under a batch's
    worth, the walk and its packing went in one step again (357 ms for 250 models). Counted, not
    timed: the chunk-places looked up or packed between two turns of the loop."""
    n = 50_000
    namespaces = [f"{m:032x}" for m in range(models)]
    models_of = {ns: f"org/model-{m}" for m, ns in enumerate(namespaces)}
    replay_port = free_port()
    book = IdentityBook(pending_limit=n + 1)
    bus = EventBus()
    settings = ZmqSettings(
        "tcp://127.0.0.1:*", f"tcp://127.0.0.1:{replay_port}", topic="kv@{model}", buffer_batches=1, interval_s=3600
    )
    publisher = ZmqEventPublisher(settings, book, models_of.__getitem__)
    publisher._replay_hwm = 1_000_000  # (no batch dropped by the ROUTER: this test is about the loop)
    bus.add_listener(publisher)
    keys = [(namespaces[i % models], _key(i)) for i in range(n)]
    for i, (ns, k) in enumerate(keys):
        book.offer(ns, k, BlockIdentity.of([4 * i + b for b in range(4)], None, list(range(64)), 16))
    publisher.start()
    try:
        bus.publish(EventType.STORED, Cause.STORED, "ram", TierKind.RAM, keys)
        bus.publish(EventType.STORED, Cause.STORED, "fs", TierKind.FS, keys)
        publisher.flush()  # more batches than the buffer (1) holds: a replay from 0 is a resync
        done = 0  # chunk-places looked up (building the snapshot), then packed (sending it)
        get, stored_event = book.get, zmq_publisher.stored_event

        def counted_get(ns: str, key: bytes) -> BlockIdentity | None:
            nonlocal done
            done += 1
            return get(ns, key)

        def counted_stored_event(*args: Any) -> Any:
            nonlocal done
            done += 1
            return stored_event(*args)

        monkeypatch.setattr(book, "get", counted_get)
        monkeypatch.setattr(zmq_publisher, "stored_event", counted_stored_event)
        longest = 0  # the most done within one turn of the loop
        stop = False

        async def turns() -> None:
            nonlocal longest
            last = done
            while not stop:
                await asyncio.sleep(0)  # (the loop's next turn: every other task ready runs once)
                longest = max(longest, done - last)
                last = done

        counting = asyncio.create_task(turns())
        # (raw frames: decoding them in this process's thread would hold the loop itself)
        raw = await asyncio.to_thread(replay, replay_port, 0)
        stop = True
        await counting
    finally:
        await publisher.close()
    got = [msgpack.unpackb(payload)[1] for _, _, payload in raw]
    assert publisher.counts.resyncs == 1
    assert done == 2 * 2 * n  # each chunk-place looked up, then packed
    assert longest <= _SNAPSHOT_STEP, f"{longest} chunk-places in one turn of the loop ({models} models)"
    assert got[: models + 1] == [[{"type": "AllBlocksCleared"}]] * (models + 1)  # the node's, each model's
    assert sum(len(events) for events in got[models + 1 :]) == 2 * n
