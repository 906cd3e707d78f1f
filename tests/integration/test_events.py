# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""KV events: the WatchEvents gRPC stream (replay + live) and the ZMQ publisher in vLLM's format."""

from __future__ import annotations

import shutil
import threading

import grpc
import msgpack
import pytest

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from tests.support.daemon import short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.ports import free_port
from tests.support.rpc import raw, rpc_error
from tests.support.wait import wait_for
from tests.support.zmq_events import prompt_identities, replay

CHUNK = 64 << 10


def _collect(stub, from_seq: int, count: int) -> list[pb.KvEvent]:
    """Read `count` events from a WatchEvents stream, then cancel it."""
    call = stub.WatchEvents(pb.WatchEventsRequest(from_seq=from_seq), timeout=20)
    events = []
    for event in call:
        events.append(event)
        if len(events) == count:
            call.cancel()
            break
    return events


def test_watch_events_replays_stores_and_evictions_in_order(daemon_factory, ns_name):
    # 1 MiB of RAM = 16 chunks of 64 KiB: storing 24 evicts the 8 oldest.
    d = daemon_factory(cpu_bytes="1MiB")
    keys = make_keys("ev", 24)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, block_tokens=16)
        for i in range(0, 24, 8):
            assert kv.store(ns, keys[i : i + 8], payloads(keys[i : i + 8], CHUNK)).stored == 8
        assert kv.delete(ns, keys[-1:]) == 1
    with d.channel() as channel:
        events = _collect(pb_grpc.KVStoreStub(channel), from_seq=1, count=5)
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and seqs[0] == 1 and len(set(seqs)) == len(seqs)
    stored = [k for e in events if e.type == pb.EVENT_TYPE_STORED for k in e.keys]
    evicted = [
        k for e in events if e.type == pb.EVENT_TYPE_REMOVED and e.cause == pb.EVENT_CAUSE_EVICTED for k in e.keys
    ]
    deleted = [k for e in events if e.cause == pb.EVENT_CAUSE_DELETED for k in e.keys]
    assert stored == keys
    assert evicted == keys[:8]  # LRU order
    assert deleted == keys[-1:]
    assert all(
        e.tier == "ram" and e.tier_kind == pb.TIER_KIND_RAM and e.namespace_id == ns.namespace_id for e in events
    )


@pytest.mark.parametrize("remove", ["Delete", "ClearNamespace"])
def test_a_reservation_deleted_before_its_commit_is_not_reported_stored(daemon_factory, ns_name, remove):
    """Reserve A and B, remove A (Delete) or both (ClearNamespace) while they are being written,
    commit both: the answer counts only what RAM holds, and no event says a removed one was
    stored (a router told so would route requests to a chunk that is not there)."""
    d = daemon_factory()
    a, b, marker = make_keys(ns_name, 3)
    with raw(d.socket) as conn:
        ns_id = conn.register(ns_name, CHUNK)

        def reserve(key: bytes) -> int:
            request = pb.ReserveRequest(session_id=conn.session_id, namespace_id=ns_id, keys=[key])
            return conn.call("Reserve", request).slots[0].handle

        def commit(handles: list[int]) -> int:
            return conn.call("Commit", pb.CommitRequest(session_id=conn.session_id, handles=handles)).committed

        handles = [reserve(a), reserve(b)]
        if remove == "Delete":
            assert conn.call("Delete", pb.DeleteRequest(namespace_id=ns_id, keys=[a])).deleted == 0  # not READY
        else:
            conn.call("ClearNamespace", pb.ClearNamespaceRequest(namespace_id=ns_id))
        committed = commit(handles)
        held = list(conn.call("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=[b])).tiers)
        assert commit([reserve(marker)]) == 1  # the last STORED event: read up to it
        events = []
        for event in conn.stub.WatchEvents(pb.WatchEventsRequest(from_seq=1), timeout=20):
            events.append(event)
            if marker in event.keys:
                break
    stored = [k for e in events if e.type == pb.EVENT_TYPE_STORED for k in e.keys]
    if remove == "Delete":
        assert (committed, held, stored) == (1, [pb.TIER_KIND_RAM], [b, marker])
    else:
        assert (committed, held, stored) == (0, [pb.TIER_KIND_UNSPECIFIED], [marker])


def test_watch_events_live_stream_sees_new_events(daemon, ns_name):
    keys = make_keys("live", 4)
    with daemon.channel() as channel:
        stub = pb_grpc.KVStoreStub(channel)
        got: list[pb.KvEvent] = []
        reader = threading.Thread(target=lambda: got.extend(_collect(stub, from_seq=0, count=1)))
        reader.start()
        with daemon.client() as kv:
            ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
            # keep storing until the watcher (which may subscribe late) has seen one event
            for i in range(50):
                kv.store(ns, [make_keys(f"live{i}", 1)[0]], payloads(keys[:1], CHUNK))
                reader.join(0.1)
                if not reader.is_alive():
                    break
        reader.join(10)
    assert len(got) == 1 and got[0].type == pb.EVENT_TYPE_STORED


@pytest.mark.vllm
def test_zmq_events_decode_with_vllm_classes_and_replay(daemon_factory, ns_name):
    try:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    except ImportError as exc:
        pytest.fail(f"vllm 0.33 is needed for this test: run tests/vllm/install_vllm.sh ({exc})")
    import msgspec as ms

    pub_port, replay_port = free_port(), free_port()
    d = daemon_factory(
        [
            "--events-zmq-endpoint",
            f"tcp://127.0.0.1:{pub_port}",
            "--events-zmq-replay-endpoint",
            f"tcp://127.0.0.1:{replay_port}",
            "--events-zmq-topic",
            "kv",
        ],
        cpu_bytes="1MiB",
    )
    keys = make_keys("zmq", 20)
    _, identities = prompt_identities("zmq", 20)
    decoder = ms.msgpack.Decoder(type=KVEventBatch)

    def blocks(kind) -> int:
        return sum(
            len(e.block_hashes)
            for _, _, p in replay(replay_port)
            for e in decoder.decode(p).events
            if isinstance(e, kind)
        )

    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, block_tokens=64)
        assert kv.store(ns, keys[:10], payloads(keys[:10], CHUNK), blocks=identities[:10]).stored == 10
        # Sent before the next store: changes within one interval are coalesced (a chunk stored
        # and evicted within it would never be published).
        assert wait_for(lambda: blocks(BlockStored) == 40)
        # 16 fit: the first 4 are evicted
        assert kv.store(ns, keys[10:], payloads(keys[10:], CHUNK), blocks=identities[10:]).stored == 10

    assert wait_for(lambda: blocks(BlockRemoved) == 16)
    batches = replay(replay_port)
    assert {topic for topic, _, _ in batches} == {b"kv"}
    assert [seq for _, seq, _ in batches] == list(range(len(batches)))  # from 0, no gaps
    decoded = [decoder.decode(p) for _, _, p in batches]
    assert all(b.data_parallel_rank == 0 for b in decoded)
    assert all(isinstance(msgpack.unpackb(p), list) and len(msgpack.unpackb(p)) == 3 for _, _, p in batches)
    assert decoded[0].events == [AllBlocksCleared()]  # seq 0: a fresh daemon holds nothing in RAM
    events = [e for b in decoded[1:] for e in b.events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [list(i.block_hashes) for i in identities]
    assert [e.parent_block_hash for e in stored] == [i.parent_block_hash for i in identities]
    assert [e.token_ids for e in stored] == [list(i.token_ids) for i in identities]
    assert all(e.block_size == 16 and e.group_idx == 0 and e.ownership is None for e in stored)
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [h for i in identities[:4] for h in i.block_hashes]
    assert all(e.medium == "CPU" and e.ownership is None for e in events)


def test_zmq_array_encoding_is_positional(daemon_factory, ns_name):
    pub_port, replay_port = free_port(), free_port()
    d = daemon_factory(
        [
            "--events-zmq-endpoint",
            f"tcp://127.0.0.1:{pub_port}",
            "--events-zmq-replay-endpoint",
            f"tcp://127.0.0.1:{replay_port}",
            "--events-encoding",
            "array",
        ]
    )
    key = make_keys("arr", 1)
    _, (identity,) = prompt_identities("arr", 1, block_size=8)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, block_tokens=32)
        kv.store(ns, key, payloads(key, CHUNK), blocks=[identity])
    assert wait_for(lambda: len(replay(replay_port)) == 2)
    (_, _, cleared), (_, _, payload) = replay(replay_port)
    assert msgpack.unpackb(cleared)[1] == [["AllBlocksCleared"]]
    ts, events, dp_rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and dp_rank == 0
    assert events == [["BlockStored", list(identity.block_hashes), None, list(identity.token_ids), 8, None, "CPU"]]


def test_watch_from_a_seq_past_the_newest_is_out_of_range(daemon_factory, ns_name):
    """A follower resuming from an earlier daemon's seq (before a restart) is told to read anew,
    not streamed live events only: it would miss what this daemon published before."""
    d = daemon_factory()
    keys = make_keys(ns_name, 2)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert kv.store(ns, keys, payloads(keys, CHUNK)).stored == 2
    with d.channel() as channel:
        stub = pb_grpc.KVStoreStub(channel)
        [stored] = _collect(stub, from_seq=1, count=1)
        # The next seq is a resume point like any other: nothing to replay, then live.
        call = stub.WatchEvents(pb.WatchEventsRequest(from_seq=stored.seq + 1), timeout=1)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for ahead in (stored.seq + 2, 10**9):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.WatchEvents(pb.WatchEventsRequest(from_seq=ahead), timeout=5))
            assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
            assert f"ahead of this daemon's newest (seq {stored.seq})" in err.value.details()
            assert dict(err.value.trailing_metadata())["kvstored-oldest-seq"] == "1"


@pytest.mark.vllm
def test_clear_namespace_reaches_zmq_routers_as_its_keys_removed_only(daemon_factory, ns_name):
    try:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    except ImportError as exc:
        pytest.fail(f"vllm 0.33 is needed for this test: run tests/vllm/install_vllm.sh ({exc})")
    import msgspec as ms

    root = short_tmpdir("kvfs")
    pub_port, replay_port = free_port(), free_port()
    d = daemon_factory(
        [
            "--events-zmq-endpoint",
            f"tcp://127.0.0.1:{pub_port}",
            "--events-zmq-replay-endpoint",
            f"tcp://127.0.0.1:{replay_port}",
            "--events-node",
            "node-1",
            "--tiers",
            f"kind=fs,root={root},bytes=64MiB",
            "--write-policy",
            "write-through",
        ]
    )
    a_keys, b_keys = make_keys("clear-a", 4), make_keys("clear-b", 4)
    (_, a_ids), (_, b_ids) = prompt_identities("clear-a", 4), prompt_identities("clear-b", 4)
    a_hashes = {h for i in a_ids for h in i.block_hashes}
    b_hashes = {h for i in b_ids for h in i.block_hashes}
    decoder = ms.msgpack.Decoder(type=KVEventBatch)

    def blocks(kind) -> int:
        return sum(
            len(e.block_hashes)
            for _, _, p in replay(replay_port)
            for e in decoder.decode(p).events
            if isinstance(e, kind)
        )

    try:
        with d.client() as kv:
            a = kv.register_namespace(model=ns_name + "/a", dtype="u8", chunk_bytes=CHUNK, block_tokens=16)
            b = kv.register_namespace(model=ns_name + "/b", dtype="u8", chunk_bytes=CHUNK, block_tokens=16)
            assert kv.store(a, a_keys, payloads(a_keys, CHUNK), blocks=a_ids).stored == 4
            assert kv.store(b, b_keys, payloads(b_keys, CHUNK), blocks=b_ids).stored == 4
            # both namespaces in RAM and on disk, so the clear removes A from two tiers
            assert wait_for(lambda: _fs_chunks(d) == 8)
            # published before the clear (changes within one interval are coalesced)
            assert wait_for(lambda: blocks(BlockStored) == 2 * (len(a_hashes) + len(b_hashes)))
            with d.channel() as channel:
                stub = pb_grpc.KVStoreStub(channel)
                cleared = stub.ClearNamespace(pb.ClearNamespaceRequest(namespace_id=a.namespace_id), timeout=20)
                assert cleared.removed == 8
                grpc_events = _collect_through_cleared(stub, "fs")  # the chain clears the fs tier last
            assert kv.lookup(b, b_keys).prefix_hits == 4
        assert wait_for(lambda: blocks(BlockRemoved) == 2 * len(a_hashes))  # from RAM and from disk
        batches = replay(replay_port)
        events = [e for _, _, p in batches for e in decoder.decode(p).events]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    # AllBlocksCleared only as seq 0 (the daemon's start), on the node's topic (no model): a fresh
    # daemon knows no model yet (one its tiers' records bring back gets its own, at seq 1 on)
    assert [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)] == [0]
    assert batches[0][:2] == (b"kv@node-1@", 0)
    batches, events = batches[1:], events[1:]
    removed = {(e.medium, h) for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed == {(medium, h) for medium in ("CPU", "STORAGE") for h in a_hashes}
    # One topic per model, in llm-d's shape.
    assert {t for t, _, _ in batches} == {f"kv@node-1@{ns_name}/a".encode(), f"kv@node-1@{ns_name}/b".encode()}
    # A router applying vLLM's semantics still knows every block of B, on both media.
    known = set()
    for e in events:
        if isinstance(e, BlockStored):
            known |= {(e.medium, h) for h in e.block_hashes}
        else:
            known -= {(e.medium, h) for h in e.block_hashes}
    assert known == {(medium, h) for medium in ("CPU", "STORAGE") for h in b_hashes}
    # gRPC watchers, which track namespaces, still get one CLEARED per tier for A.
    assert sorted((e.tier, e.namespace_id) for e in grpc_events if e.type == pb.EVENT_TYPE_CLEARED) == [
        ("fs", a.namespace_id),
        ("ram", a.namespace_id),
    ]


def _collect_through_cleared(stub, tier: str) -> list[pb.KvEvent]:
    """Every event from seq 1 through the first CLEARED of `tier`."""
    call = stub.WatchEvents(pb.WatchEventsRequest(from_seq=1), timeout=20)
    events = []
    for event in call:
        events.append(event)
        if event.type == pb.EVENT_TYPE_CLEARED and event.tier == tier:
            call.cancel()
            break
    return events


def _fs_chunks(d) -> int:
    return next(t.chunks for t in d.stats().tiers if t.name == "fs")


def test_watch_from_a_seq_no_longer_buffered_ends_out_of_range(daemon_factory, ns_name):
    d = daemon_factory(["--events-buffer", "4"])
    keys = make_keys("gone", 8)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        for key in keys:  # one STORED event each: seqs 1-8, only 5-8 still buffered
            assert kv.store(ns, [key], payloads([key], CHUNK)).stored == 1
    with d.channel() as channel:
        stub = pb_grpc.KVStoreStub(channel)
        call = stub.WatchEvents(pb.WatchEventsRequest(from_seq=4), timeout=20)
        with pytest.raises(grpc.RpcError) as err:
            next(call)  # instead of seq 5, silently past the lost seq 4
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "oldest available is seq 5" in err.value.details()
        events = _collect(stub, from_seq=5, count=4)  # the oldest still buffered: nothing lost
    assert [e.seq for e in events] == [5, 6, 7, 8]
    assert [k for e in events for k in e.keys] == keys[4:]


def test_a_store_with_a_malformed_block_identity_is_refused_and_stores_nothing(daemon_factory, ns_name):
    d = daemon_factory(["--events-zmq-endpoint", f"tcp://127.0.0.1:{free_port()}"])
    keys = make_keys("bad-identity", 2)
    _, identities = prompt_identities("bad-identity", 2)
    bad = identities[0].to_pb()
    del bad.token_ids[-1]  # one token short of block_size x blocks
    with raw(d.socket) as conn:
        ns_id = conn.register(ns_name, CHUNK)
        for blocks, problem in (([bad, identities[1].to_pb()], "token_ids"), ([bad], "one per key")):
            request = pb.ReserveRequest(session_id=conn.session_id, namespace_id=ns_id, keys=keys, blocks=blocks)
            err = rpc_error(conn.call, "Reserve", request)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert problem in err.details()
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert ns.namespace_id == ns_id
        assert kv.lookup(ns, keys).prefix_hits == 0
        assert kv.store(ns, keys, payloads(keys, CHUNK), blocks=identities).stored == 2  # still serving


def _keys(messages: list[pb.KvEvent], type_: int, cause: int | None = None) -> list[bytes]:
    """The keys of a coalesced stream's changes of that type (and cause)."""
    changes = [c for m in messages for c in m.changes]
    return [k for c in changes if c.type == type_ and (cause is None or c.cause == cause) for k in c.keys]


def test_a_coalesced_watch_replays_the_net_changes_as_one_interval_and_resumes_after_it(daemon_factory, ns_name):
    # 16 chunks of RAM: storing 24 one by one evicts the 8 oldest; the last is deleted.
    d = daemon_factory(cpu_bytes="1MiB")
    keys = make_keys("coalesced", 24)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, block_tokens=16)
        for key in keys:
            assert kv.store(ns, [key], payloads([key], CHUNK)).stored == 1
        assert kv.delete(ns, keys[-1:]) == 1
    with d.channel() as channel:
        stub = pb_grpc.KVStoreStub(channel)
        call = stub.WatchEvents(pb.WatchEventsRequest(from_seq=1, coalesce=True), timeout=20)
        replayed = []
        for event in call:  # one interval: read up to its end
            replayed.append(event)
            if not event.partial:
                call.cancel()
                break
        # 33 bus events (24 stores, 8 evictions, 1 delete) as one message of 3 changes, one per kind
        (message,) = replayed
        assert sorted((c.type, c.cause) for c in message.changes) == [
            (pb.EVENT_TYPE_STORED, pb.EVENT_CAUSE_STORED),
            (pb.EVENT_TYPE_REMOVED, pb.EVENT_CAUSE_EVICTED),
            (pb.EVENT_TYPE_REMOVED, pb.EVENT_CAUSE_DELETED),
        ]
        assert _keys(replayed, pb.EVENT_TYPE_STORED) == keys[8:23]
        assert _keys(replayed, pb.EVENT_TYPE_REMOVED, pb.EVENT_CAUSE_EVICTED) == keys[:8]
        assert _keys(replayed, pb.EVENT_TYPE_REMOVED, pb.EVENT_CAUSE_DELETED) == keys[23:]
        assert message.seq == 33 and not message.partial and not message.keys
        assert all(c.tier == "ram" and c.namespace_id == ns.namespace_id for c in message.changes)
        resume = replayed[-1].seq + 1
        more = make_keys("coalesced-more", 3)
        with d.client() as kv:
            ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, block_tokens=16)
            assert kv.store(ns, more, payloads(more, CHUNK)).stored == 3  # evicts 2 more
        got = []
        call = stub.WatchEvents(pb.WatchEventsRequest(from_seq=resume, coalesce=True), timeout=20)
        for event in call:
            got.append(event)
            if not event.partial:
                call.cancel()
                break
        assert _keys(got, pb.EVENT_TYPE_STORED) == more  # nothing of before the resume seq
        assert _keys(got, pb.EVENT_TYPE_REMOVED, pb.EVENT_CAUSE_EVICTED) == keys[8:10]  # the delete freed a slot


def test_a_live_coalesced_watch_sees_every_change_in_whole_intervals(daemon_factory, ns_name):
    d = daemon_factory(extra_args=["--events-interval", "0.05"])
    keys = make_keys("coalesced-live", 40)
    with d.channel() as channel:
        stub = pb_grpc.KVStoreStub(channel)
        got: list[pb.KvEvent] = []

        def read() -> None:
            call = stub.WatchEvents(pb.WatchEventsRequest(from_seq=1, coalesce=True), timeout=30)
            for event in call:
                got.append(event)
                if not event.partial and set(_keys(got, pb.EVENT_TYPE_STORED)) >= set(keys):
                    call.cancel()
                    return

        reader = threading.Thread(target=read)
        reader.start()
        with d.client() as kv:
            ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
            for key in keys:  # one event each; a reader subscribing late gets the first ones replayed
                kv.store(ns, [key], payloads([key], CHUNK))
        reader.join(30)
        assert not reader.is_alive()
    assert got and not any(m.partial for m in got)  # small intervals: one message each
    assert [m.seq for m in got] == sorted({m.seq for m in got})  # increasing
    stored = _keys(got, pb.EVENT_TYPE_STORED)
    assert len(stored) == len(set(stored))  # each stored chunk once


class _Reader:
    """A coalesced WatchEvents stream read in a thread until a message has `until` stored."""

    def __init__(self, stub, from_seq: int, until: bytes) -> None:
        self.messages: list[pb.KvEvent] = []
        self._call = stub.WatchEvents(pb.WatchEventsRequest(from_seq=from_seq, coalesce=True), timeout=60)
        self._until = until
        self._thread = threading.Thread(target=self._read)
        self._thread.start()

    def _read(self) -> None:
        for event in self._call:
            self.messages.append(event)
            if not event.partial and self._until in _keys(self.messages, pb.EVENT_TYPE_STORED):
                self._call.cancel()
                return

    def join(self) -> list[pb.KvEvent]:
        self._thread.join(60)
        assert not self._thread.is_alive()
        return self.messages


def test_coalesced_watchers_share_each_interval_and_a_late_one_resumes_without_gaps(daemon_factory, ns_name):
    d = daemon_factory(extra_args=["--events-interval", "0.05"])
    nudges, keys = make_keys("shared-nudge", 50), make_keys("shared", 30)
    final = keys[-1]
    with d.channel() as channel, d.client() as kv:
        stub = pb_grpc.KVStoreStub(channel)
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        a, b = _Reader(stub, 0, final), _Reader(stub, 0, final)
        for nudge in nudges:  # until both streams are live
            kv.store(ns, [nudge], payloads([nudge], CHUNK))
            if wait_for(lambda: bool(a.messages and b.messages), timeout=0.2):
                break
        assert a.messages and b.messages
        for key in keys:
            kv.store(ns, [key], payloads([key], CHUNK))
        got_a, got_b = a.join(), b.join()
        # Past the interval both had joined by, they got the same messages (seq, changes, bytes).
        joined = max(got_a[0].seq, got_b[0].seq)
        tail_a = [m.SerializeToString() for m in got_a if m.seq > joined]
        tail_b = [m.SerializeToString() for m in got_b if m.seq > joined]
        assert tail_a == tail_b and tail_a
        assert set(keys) <= set(_keys(got_a, pb.EVENT_TYPE_STORED))
        # A late watcher resuming after the first message: the rest, each chunk once, nothing before.
        resume = got_a[0].seq + 1
        late = _Reader(stub, resume, final).join()
        stored = _keys(late, pb.EVENT_TYPE_STORED)
        assert len(stored) == len(set(stored))
        assert set(keys) <= set(stored)
        assert not set(_keys(got_a[:1], pb.EVENT_TYPE_STORED)) & set(stored)
        assert [m.seq for m in late] == sorted({m.seq for m in late})
