# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""KV events on ZMQ in vLLM's wire format, as llm-d and Dynamo index them.

Each message is multipart `[topic, seq (8 bytes big-endian), msgpack(batch)]`, the batch being
vLLM's array-like `[ts, [event, ...], data_parallel_rank]`; seq counts from 0, one sequence for
every topic of the publisher, and seq 0 is AllBlocksCleared (below). Events are BlockStored /
BlockRemoved per engine block, with the identity the client handed over with the store
(identity.py): 64-bit block hashes, the parent hash, token ids, the engine's block size,
group_idx, medium CPU (RAM) or STORAGE (fs, s3) and locality; never `ownership` (the publisher
is the node itself). Encoded as vLLM 0.33's tagged maps or as the positional arrays older
decoders read.

The topic is a template (`kv@{node}@{model}` by default, llm-d's shape): one topic per model, so
two models with equal block hashes never mix.

Changes are coalesced per interval (coalesce.py): per interval, one batch per topic with each
chunk's net change at each place, the removals first, then the blocks stored, each after its
parent when that is stored in the same batch (Dynamo drops a block whose parent it does not
know). A chunk that appears and goes within an interval is never sent.

Like vLLM's publisher the PUB socket binds a wildcard or ipc/inproc endpoint (`tcp://*:5557`)
and connects to any other (`tcp://router:5557`, where the router binds its SUB); ZMQ reconnects
by itself. While no subscriber is there at all (the router restarting, or not up yet), batches
are held, the oldest dropped past `queue_batches`, and those of the topics subscribed are sent
when one subscribes (the socket is an XPUB, which sees subscriptions).

A ROUTER replay socket answers `[b"", start_seq (8 bytes)]` with every buffered batch from that
seq, then an end marker (seq -1), as vLLM's publisher does. A start seq older than the buffer
(a router that lost track, or restarted after the buffer rolled over) gets a resync instead:
AllBlocksCleared, then BlockStored for every block the node held as of the last seq sent, per
topic, each after its parent, all at that seq, then the end marker. A resync is built and sent
a batch at a time, one at a time, between the loop's other work: the loop runs every
`_SNAPSHOT_WALK_STEP` blocks walked whatever their topics (many models, each under a batch's
worth, fill no batch until the walk's end).

AllBlocksCleared means every block of the publisher (the whole node); a cleared namespace is
sent as its blocks removed. It is sent in a resync and from seq 0: a daemon starts with nothing
in RAM, so a router that sees seq go back (a restart) and replays from 0 drops the blocks of
the daemon before. It goes on the template's topic without a model (`kv@{node}@`) and on every
model's topic the publisher knows, each as its own batch, all before any block stored: a
router that takes the model from the topic (llm-d's `kv@<pod>@<model>`) applies a clear to the
topic's model (that of the node's topic is ""), and one subscribed to a single model's topic
gets its model's live. At the start those are the models of the namespaces known then (the
tiers' records) whose events are published, at seqs 1, 2, ... after the node's seq 0; in a
resync every topic published on or held, all at the resync's seq. Several clears in a row are
harmless: Dynamo and llm-d drop every block of the worker or pod on each (Dynamo's
`clear_all_blocks`, llm-d's `Index.Clear`), and vLLM's `KVEventBatch` decodes any number.

A restarted daemon publishes what its fs tier still holds: the fs tier keeps each chunk's
identity record in the chunk file's header and reads them back in the background after the
start (`restore_from`); each chunk whose record checks out is published as STORAGE from the
next interval on, and a chunk without one (or with a doubtful one) is served but not published,
nor is one of a namespace whose events are not published (a tenant's, or one not known again).
S3 is not read back: its chunks are published with locality REMOTE, which Dynamo drops, and a
restart would have to list the bucket and read every object's header. Chunks this node fetched
from a peer and keeps are its own: the peer's fetch reply carries the identity the holder had
(kvstored/peer/messages.py), offered to the book like a client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from kvstored.chunks.ids import ChunkId, TierKind
from kvstored.errors import ListenError
from kvstored.events.bus import EventEncoding, EventType, KvEvent
from kvstored.events.coalesce import Change, Coalescer
from kvstored.events.endpoints import is_bind_endpoint
from kvstored.events.identity import BlockIdentity, ChunkRef, IdentityBook, ParentsFirst, decode_record

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
CPU, STORAGE = "CPU", "STORAGE"
LOCAL, REMOTE = "LOCAL", "REMOTE"
Place = tuple[str, str]  # (medium, locality)
# The peer tier's chunks are other nodes' (their own publishers report them): not this node's.
_PLACE: dict[TierKind, Place] = {
    TierKind.RAM: (CPU, LOCAL),
    TierKind.FS: (STORAGE, LOCAL),
    TierKind.S3: (STORAGE, REMOTE),
}
PLACES = tuple(dict.fromkeys(_PLACE.values()))
Found = list[tuple[ChunkId, bytes | None]]  # a tier's chunks and their identity records (None: none kept)
Held = list[tuple[str, bytes, Place]]  # chunk-places held: namespace id, key, place
_EVENTS_PER_BATCH = 1024  # a resync of a large node is many batches, none too large for a consumer
_SNAPSHOT_STEP = 4096  # chunk-places a resync goes through before letting the loop run
_SNAPSHOT_WALK_STEP = 1024  # blocks a resync orders and packs (whatever their topics) before letting it run


def place_of(event: KvEvent) -> Place | None:
    return _PLACE.get(event.tier_kind)


@dataclass(frozen=True, slots=True)
class ZmqSettings:
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = "kv@{node}@{model}"  # placeholders: {node}, {model}, {namespace}
    node: str = ""
    data_parallel_rank: int = 0
    encoding: EventEncoding = EventEncoding.MAP
    buffer_batches: int = 10_000  # kept for replay
    queue_batches: int = 10_000  # held while no subscriber is there
    interval_s: float = 0.1


def stored_event(identity: BlockIdentity, medium: str, locality: str, encoding: EventEncoding) -> Any:
    hashes = list(identity.block_hashes)
    tokens = list(identity.token_ids)
    if encoding is EventEncoding.ARRAY:
        # vLLM's field order (array_like); trailing fields older decoders lack are left off.
        return ["BlockStored", hashes, identity.parent_block_hash, tokens, identity.block_size, None, medium]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": identity.parent_block_hash,
        "token_ids": tokens,
        "block_size": identity.block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": identity.group_idx,
        "locality": locality,
    }


def removed_event(hashes: list[int], medium: str, locality: str, group_idx: int, encoding: EventEncoding) -> Any:
    if encoding is EventEncoding.ARRAY:
        return ["BlockRemoved", hashes, medium]
    return {
        "type": "BlockRemoved",
        "block_hashes": hashes,
        "medium": medium,
        "group_idx": group_idx,
        "locality": locality,
    }


CLEARED_MAP: dict[str, Any] = {"type": "AllBlocksCleared"}
CLEARED_ARRAY: list[Any] = ["AllBlocksCleared"]


def encode_batch(ts: float, events: list[Any], data_parallel_rank: int) -> bytes:
    return msgpack.packb([ts, events, data_parallel_rank], use_bin_type=True)


def encode_packed_batch(ts: float, packed_events: list[bytes], data_parallel_rank: int) -> bytes:
    """encode_batch's bytes, of events each packed already (msgpack's array is its header and
    its elements): a resync packs each event as it is made, so that a batch's events never
    live long enough to be the garbage collector's work."""
    packer = msgpack.Packer(use_bin_type=True)
    head = packer.pack_array_header(3) + packer.pack(ts) + packer.pack_array_header(len(packed_events))
    return b"".join((head, *packed_events, packer.pack(data_parallel_rank)))


@dataclass(slots=True)
class PublisherCounts:
    batches: int = 0  # numbered (sent, held or both)
    held_dropped: int = 0  # held while no subscriber, then pushed out by newer ones
    unidentified: int = 0  # chunk changes not published: stored without an identity
    withheld: int = 0  # chunks a tier held at the start, of a namespace not published (a tenant's)
    resyncs: int = 0
    restored: int = 0  # chunks a tier held at the start, published from their identity records
    unrecorded: int = 0  # ... held at the start without an identity record (not published)
    doubtful: int = 0  # ... held at the start with a record that did not check out (not published)


class ZmqEventPublisher:
    def __init__(
        self,
        settings: ZmqSettings,
        identities: IdentityBook,
        model_of: Callable[[str], str],
        publishes: Callable[[str], bool] | None = None,
    ) -> None:
        """model_of: a namespace id's model (for the topic). publishes: whether routers may see
        a namespace's chunks (None: every namespace's); the same for the bus's events and for
        what a tier held before the start."""
        self._s = settings
        self._identities = identities
        self._model_of = model_of
        self._publishes = publishes
        self._touched: set[ChunkRef] = set()  # chunks with a place touched this interval
        self._coalescer: Coalescer[Place] = Coalescer(place_of)
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=settings.buffer_batches)  # seq, topic, payload
        self._held: deque[tuple[bytes, bytes, bytes]] = deque()  # frames waiting for a subscriber
        self._subscriptions: set[bytes] = set()  # topic prefixes subscribed (XPUB passes each once)
        # Like vLLM's publisher: a full replay plus its end marker, twice over, fits in the
        # ROUTER's send queue (past its high-water mark ROUTER silently drops messages).
        self._replay_hwm = 2 * (settings.buffer_batches + 1)
        self._seq = itertools.count(0)
        self.last_seq = -1
        self._cleared = CLEARED_ARRAY if settings.encoding is EventEncoding.ARRAY else CLEARED_MAP
        self._topics: dict[str, bytes] = {}
        self._ctx = zmq.asyncio.Context()  # the replay socket is served on the event loop
        self._pub_ctx = zmq.Context()  # XPUB sends and subscription reads are plain non-blocking calls
        self._pub: zmq.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self.counts = PublisherCounts()

    def start(self, namespace_ids: Iterable[str] = (), ram_empty: bool = True) -> None:
        """namespace_ids: the namespaces known as the daemon starts (those the tiers' records
        brought back, or a hand-over): their models' topics are told of the empty RAM too.
        ram_empty False (RAM handed over by the daemon before): nothing is cleared, as what that
        daemon announced of its RAM still holds."""
        self._pub = self._pub_ctx.socket(zmq.XPUB)
        self._pub.set_hwm(100_000)
        if is_bind_endpoint(self._s.endpoint):
            _bind(self._pub, self._s.endpoint, "events_zmq_endpoint")
        else:
            self._pub.connect(self._s.endpoint)
        if self._s.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, self._replay_hwm)  # before bind: pipes take it then
            _bind(self._replay, self._s.replay_endpoint, "events_zmq_replay_endpoint")
            self._tasks.append(asyncio.create_task(self._serve_replay(self._replay), name="zmq-replay"))
        self._tasks.append(asyncio.create_task(self._run(), name="zmq-events"))
        # Seq 0 on: the node starts with none of its blocks in RAM, whatever a daemon before it said.
        cleared = encode_batch(time.time(), [self._cleared], self._s.data_parallel_rank)
        for topic in self._cleared_topics(namespace_ids) if ram_empty else ():
            self._send(topic, cleared)
        log.info(
            "KV events: %s %s (replay %s, %s encoding, every %.0f ms)",
            "bound to" if is_bind_endpoint(self._s.endpoint) else "connecting to",
            self._s.endpoint,
            self._s.replay_endpoint or "off",
            self._s.encoding.value,
            self._s.interval_s * 1000,
        )

    def __call__(self, event: KvEvent) -> None:
        """Bus listener: bookkeeping only; the timer publishes."""
        if self._publishes is not None and not self._publishes(event.namespace_id):
            return
        if event.type is EventType.STORED:
            for key in event.keys:
                self._identities.on_stored(event.namespace_id, key)
        if place_of(event) is not None:
            self._touched.update((event.namespace_id, key) for key in event.keys)
        self._coalescer.add(event)

    def topic(self, namespace_id: str) -> bytes:
        topic = self._topics.get(namespace_id)
        if topic is None:
            topic = self._s.topic.format(
                node=self._s.node, model=self._model_of(namespace_id), namespace=namespace_id
            ).encode()
            self._topics[namespace_id] = topic
        return topic

    def _node_topic(self) -> bytes:
        """The topic of what concerns every model (AllBlocksCleared)."""
        return self._s.topic.format(node=self._s.node, model="", namespace="").encode()

    def _cleared_topics(self, namespace_ids: Iterable[str] = ()) -> list[bytes]:
        """Where AllBlocksCleared goes: the node's topic, then every model's topic this publisher
        has published on or computed (a snapshot's), and those of `namespace_ids` published. A
        router that takes the model from the topic (llm-d's `kv@<pod>@<model>`) would apply a
        clear on the node's topic to model "" and keep the real models' blocks, and a router
        subscribed to one model's topic would never see it."""
        for ns in namespace_ids:
            if self._publishes is None or self._publishes(ns):
                self.topic(ns)
        return list(dict.fromkeys((self._node_topic(), *self._topics.values())))

    # -- what the tiers held before the start ----------------------------------------------

    def restore_from(self, tier: str, tier_kind: TierKind, batches: AsyncIterator[Found]) -> None:
        """Read `tier`'s chunks and identity records in the background (restore() per batch)."""
        self._tasks.append(asyncio.create_task(self._restore(tier, tier_kind, batches), name=f"zmq-restore-{tier}"))

    async def _restore(self, tier: str, tier_kind: TierKind, batches: AsyncIterator[Found]) -> None:
        before = (self.counts.restored, self.counts.unrecorded, self.counts.doubtful)
        try:
            async for batch in batches:
                self.restore(tier, tier_kind, batch)
        except Exception:  # the tier's failure: its chunks are served anyway, only not announced
            log.exception("KV events: reading the identities of tier %s's chunks failed", tier)
            return
        restored, unrecorded, doubtful = (
            now - then
            for now, then in zip((self.counts.restored, self.counts.unrecorded, self.counts.doubtful), before)
        )
        log.info(
            "KV events: tier %s's chunks read back: %d published, %d without an identity, %d with a doubtful one",
            tier,
            restored,
            unrecorded,
            doubtful,
        )

    def restore(self, tier: str, tier_kind: TierKind, found: Iterable[tuple[ChunkId, bytes | None]]) -> None:
        """Chunks `tier` holds though no event said so (it held them before this daemon started),
        each with the identity record kept beside it (None: none was): published as held there
        from the next interval on. A chunk whose record is missing or does not decode is not
        published (it is still served), nor is one of a namespace not published (a tenant's: the
        live events of its chunks are not published either, so neither would their removal)."""
        place = _PLACE.get(tier_kind)
        if place is None:
            return
        for (ns, key), record in found:
            if self._publishes is not None and not self._publishes(ns):
                self.counts.withheld += 1
                continue
            if not self._identities.holds(ns, key):
                if record is None:
                    self.counts.unrecorded += 1
                    continue
                try:
                    identity = decode_record(record)
                except ValueError as exc:
                    self.counts.doubtful += 1
                    log.debug("KV events: chunk %s of %s on %s not published: %s", key.hex(), ns, tier, exc)
                    continue
                self._identities.hold(ns, key, identity)
                self._coalescer.unsent(ns, key, PLACES)  # RAM copies made meanwhile went unpublished
                self.counts.restored += 1
            self._coalescer.found(ns, key, place, tier)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._s.interval_s)
            self.flush()

    def flush(self) -> None:
        """Send any batches held for a subscriber that has now come, then publish the interval's
        net changes (one batch per topic)."""
        self._read_subscriptions()
        self._send_held()  # (before the interval's own batches: seq order)
        if self._coalescer.pending:
            self._publish(self._coalescer.take())

    def _publish(self, changes: list[Change[Place]]) -> None:
        by_topic: dict[bytes, list[Any]] = {}
        removals: dict[tuple[bytes, str, str, int], list[int]] = {}  # merged per topic/place/group
        stored: ParentsFirst[tuple[bytes, Place]] = ParentsFirst()  # topic, place
        for change in changes:
            identity = self._identities.get(change.namespace_id, change.key)
            if identity is None:
                self.counts.unidentified += 1
                continue
            topic = self.topic(change.namespace_id)
            if change.present:
                stored.add((topic, change.place), identity)
            else:
                medium, locality = change.place
                removals.setdefault((topic, medium, locality, identity.group_idx), []).extend(identity.block_hashes)
        # Removals first: a block one chunk took away and another (with the same blocks) brought
        # to the same place is held there after the batch, as it is on the node.
        for (topic, medium, locality, group_idx), hashes in removals.items():
            by_topic.setdefault(topic, []).append(removed_event(hashes, medium, locality, group_idx, self._s.encoding))
        for (topic, (medium, locality)), identity in stored:
            by_topic.setdefault(topic, []).append(stored_event(identity, medium, locality, self._s.encoding))
        now = time.time()
        for topic, events in by_topic.items():
            for first in range(0, len(events), _EVENTS_PER_BATCH):
                self._send(
                    topic, encode_batch(now, events[first : first + _EVENTS_PER_BATCH], self._s.data_parallel_rank)
                )
        self._forget_gone()

    def _forget_gone(self) -> None:
        """Forget the identities of the chunks touched this interval that the node holds no more
        (those stored and gone within it too, which made no change): the book stays as large as
        the node's holdings, and a key stored again later may bring other blocks."""
        for ns, key in self._touched:
            if not self._coalescer.holds(ns, key, PLACES):
                self._identities.forget(ns, key)
        self._touched.clear()

    def _send(self, topic: bytes, payload: bytes) -> None:
        seq = next(self._seq)
        self.last_seq = seq
        self.counts.batches += 1
        self._buffer.append((seq, topic, payload))
        frames = (topic, seq.to_bytes(8, "big"), payload)
        if not self._subscriptions:
            self._hold(frames)
        elif self._subscribed(topic):
            self._pub_send(frames)

    def _hold(self, frames: tuple[bytes, bytes, bytes]) -> None:
        self._held.append(frames)
        while len(self._held) > self._s.queue_batches:
            self._held.popleft()
            self.counts.held_dropped += 1

    def _send_held(self) -> None:
        """Once someone subscribes: the held batches of the topics subscribed, in order; the
        others were held for nobody (a subscriber's ZMQ filter would drop them anyway)."""
        if not self._subscriptions:
            return
        while self._held:
            frames = self._held.popleft()
            if self._subscribed(frames[0]):
                self._pub_send(frames)

    def _pub_send(self, frames: tuple[bytes, bytes, bytes]) -> None:
        assert self._pub is not None
        with contextlib.suppress(zmq.Again):  # past the high-water mark ZMQ drops, as vLLM's does
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)

    def _subscribed(self, topic: bytes) -> bool:
        return any(topic.startswith(prefix) for prefix in self._subscriptions)

    def _read_subscriptions(self) -> None:
        if self._pub is None:
            return
        while True:
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] == b"\x01":
                self._subscriptions.add(message[1:])
            elif message[:1] == b"\x00":
                self._subscriptions.discard(message[1:])

    # -- replay and resync ----------------------------------------------------------------------

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        # One request at a time: a resync is never built twice at once, however often asked.
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            if self._buffer and start_seq < self._buffer[0][0]:
                await self._resync(sock, client)
            else:
                for seq, topic, payload in list(self._buffer):
                    if seq >= start_seq:
                        await sock.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
            await sock.send_multipart((client, b"", b"", END_SEQ, b""))

    async def _resync(self, sock: zmq.asyncio.Socket, client: bytes) -> None:
        """The snapshot, a slice or a batch at a time between the loop's other work (a large
        node's would hold it for a second): intervals go on meanwhile, and a router applies
        their batches, of later seqs, after the snapshot."""
        self.flush()  # so that the snapshot is the state as of the last seq sent
        self.counts.resyncs += 1
        seq = max(self.last_seq, 0).to_bytes(8, "big")
        held = self._coalescer.held()
        order: ParentsFirst[int] = ParentsFirst()  # indexes into `held`
        namespaces: set[str] = set()
        for first in range(0, len(held), _SNAPSHOT_STEP):
            self._add_to_snapshot(order, held, first, first + _SNAPSHOT_STEP, namespaces)
            await asyncio.sleep(0)
        for batch in self._snapshot_batches(order, held, namespaces):
            if batch is not None:
                await sock.send_multipart((client, b"", batch[0], seq, batch[1]))
            await asyncio.sleep(0)  # (a send that need not wait does not let the loop run)

    def snapshot(self) -> Iterator[tuple[bytes, bytes]]:
        """(topic, batch) for AllBlocksCleared on each topic (_cleared_topics), then every
        identified block held, per topic, each after its parent, all at once (a resync goes a
        slice at a time)."""
        held = self._coalescer.held()
        order: ParentsFirst[int] = ParentsFirst()
        namespaces: set[str] = set()
        self._add_to_snapshot(order, held, 0, len(held), namespaces)
        return (batch for batch in self._snapshot_batches(order, held, namespaces) if batch is not None)

    def _add_to_snapshot(
        self, order: ParentsFirst[int], held: Held, first: int, end: int, namespaces: set[str]
    ) -> None:
        for i in range(first, min(end, len(held))):
            ns, key, _ = held[i]
            identity = self._identities.get(ns, key)
            if identity is not None:  # (else unidentified, or gone since the snapshot's seq)
                order.add(i, identity)
                namespaces.add(ns)

    def _snapshot_batches(
        self, order: ParentsFirst[int], held: Held, namespaces: Iterable[str]
    ) -> Iterator[tuple[bytes, bytes] | None]:
        """AllBlocksCleared on the node's topic and on every model's (the snapshot's models
        included), then `order`'s blocks stored, per topic, each batch sent as it fills: each
        batch is made only when it is asked for, and None comes every _SNAPSHOT_WALK_STEP
        blocks, whatever their topics (a resync lets the loop run there; with many models each
        under a batch's worth, no batch fills until the walk's end)."""
        now, rank = time.time(), self._s.data_parallel_rank
        cleared = encode_batch(now, [self._cleared], rank)
        for topic in self._cleared_topics(namespaces):
            yield topic, cleared
        pack = msgpack.Packer(use_bin_type=True).pack
        by_topic: dict[bytes, list[bytes]] = {}
        for walked, (i, identity) in enumerate(order, 1):
            ns, _, (medium, locality) = held[i]
            topic = self.topic(ns)
            events = by_topic.setdefault(topic, [])
            events.append(pack(stored_event(identity, medium, locality, self._s.encoding)))
            if len(events) == _EVENTS_PER_BATCH:
                yield topic, encode_packed_batch(now, events, rank)
                by_topic[topic] = []
            if walked % _SNAPSHOT_WALK_STEP == 0:
                yield None
        for topic, events in by_topic.items():
            if events:
                yield topic, encode_packed_batch(now, events, rank)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._pub is not None:
            self.flush()  # the last interval's changes, to whoever is subscribed
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._ctx.term()
        self._pub_ctx.term()


def _bind(sock: zmq.Socket, endpoint: str, option: str) -> None:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ListenError(f"cannot listen on {endpoint} ({option}): {exc}") from None
