# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""KV events: the WatchEvents gRPC stream (replay + live) and the ZMQ publisher in vLLM's format."""

from __future__ import annotations

import shutil
import socket
import threading

import grpc
import msgpack
import pytest
import zmq

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from tests.support.daemon import short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.wait import wait_for

CHUNK = 64 << 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
    except ImportError as exc:
        pytest.fail(f"vllm 0.33 is needed for this test: run tests/vllm/install_vllm.sh ({exc})")
    import msgspec as ms

    pub_port, replay_port = _free_port(), _free_port()
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
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, block_tokens=16)
        for part in (keys[:10], keys[10:]):  # 16 fit: the first 4 are evicted
            assert kv.store(ns, part, payloads(part, CHUNK)).stored == len(part)

    ctx = zmq.Context()
    try:
        replay = ctx.socket(zmq.DEALER)
        replay.RCVTIMEO = 10_000
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", (1).to_bytes(8, "big")])
        decoder = ms.msgpack.Decoder(type=KVEventBatch)
        batches = []
        while True:
            frames = replay.recv_multipart()
            _, topic, seq, payload = frames
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            assert topic == b"kv"
            batches.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
    finally:
        ctx.destroy(linger=0)

    assert [s for s, _ in batches] == sorted(s for s, _ in batches)
    events = [e for _, b in batches for e in b.events]
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert stored == keys
    assert removed == keys[:4]
    assert all(e.medium == "CPU" for e in events)
    assert all(e.block_size == 16 for e in events if isinstance(e, BlockStored))


def test_zmq_array_encoding_is_positional(daemon_factory, ns_name):
    pub_port, replay_port = _free_port(), _free_port()
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
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, block_tokens=32)
        kv.store(ns, key, payloads(key, CHUNK))
    ctx = zmq.Context()
    try:
        replay = ctx.socket(zmq.DEALER)
        replay.RCVTIMEO = 10_000
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        _, _, _, payload = replay.recv_multipart()
    finally:
        ctx.destroy(linger=0)
    ts, events = msgpack.unpackb(payload)
    assert isinstance(ts, float)
    assert events == [["BlockStored", key, None, [], 32, None, "CPU"]]


def test_watch_from_a_future_seq_waits_for_live_events(daemon):
    with daemon.channel() as channel:
        stub = pb_grpc.KVStoreStub(channel)
        call = stub.WatchEvents(pb.WatchEventsRequest(from_seq=10**9), timeout=1)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # nothing to replay, still live
        assert stub.Stats(pb.StatsRequest(), timeout=5).version


def _zmq_replay(replay_port: int) -> list[bytes]:
    """Every buffered batch's payload, by vLLM's replay protocol (from seq 0 to the end marker)."""
    ctx = zmq.Context()
    try:
        replay = ctx.socket(zmq.DEALER)
        replay.RCVTIMEO = 10_000
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        payloads_: list[bytes] = []
        while True:
            _, _, seq, payload = replay.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return payloads_
            payloads_.append(payload)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.vllm
def test_clear_namespace_reaches_zmq_routers_as_its_keys_removed_only(daemon_factory, ns_name):
    try:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    except ImportError as exc:
        pytest.fail(f"vllm 0.33 is needed for this test: run tests/vllm/install_vllm.sh ({exc})")
    import msgspec as ms

    root = short_tmpdir("kvfs")
    pub_port, replay_port = _free_port(), _free_port()
    d = daemon_factory(
        [
            "--events-zmq-endpoint",
            f"tcp://127.0.0.1:{pub_port}",
            "--events-zmq-replay-endpoint",
            f"tcp://127.0.0.1:{replay_port}",
            "--tiers",
            f"kind=fs,root={root},bytes=64MiB",
            "--write-policy",
            "write-through",
        ]
    )
    a_keys, b_keys = make_keys("clear-a", 4), make_keys("clear-b", 4)
    try:
        with d.client() as kv:
            a = kv.register_namespace(model=ns_name + "/a", dtype="u8", chunk_bytes=CHUNK, block_tokens=16)
            b = kv.register_namespace(model=ns_name + "/b", dtype="u8", chunk_bytes=CHUNK, block_tokens=16)
            assert kv.store(a, a_keys, payloads(a_keys, CHUNK)).stored == 4
            assert kv.store(b, b_keys, payloads(b_keys, CHUNK)).stored == 4
            # both namespaces in RAM and on disk, so the clear removes A from two tiers
            assert wait_for(lambda: _fs_chunks(d) == 8)
            with d.channel() as channel:
                stub = pb_grpc.KVStoreStub(channel)
                cleared = stub.ClearNamespace(pb.ClearNamespaceRequest(namespace_id=a.namespace_id), timeout=20)
                assert cleared.removed == 8
                grpc_events = _collect_through_cleared(stub, "fs")  # the chain clears the fs tier last
            assert kv.lookup(b, b_keys).prefix_hits == 4
        decoder = ms.msgpack.Decoder(type=KVEventBatch)
        events = [e for p in _zmq_replay(replay_port) for e in decoder.decode(p).events]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    assert not [e for e in events if isinstance(e, AllBlocksCleared)]
    removed = {(e.medium, h) for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed == {(medium, k) for medium in ("CPU", "STORAGE") for k in a_keys}
    # A router applying vLLM's semantics still knows every block of B, on both media.
    known = set()
    for e in events:
        if isinstance(e, BlockStored):
            known |= {(e.medium, h) for h in e.block_hashes}
        else:
            known -= {(e.medium, h) for h in e.block_hashes}
    assert known == {(medium, k) for medium in ("CPU", "STORAGE") for k in b_keys}
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
