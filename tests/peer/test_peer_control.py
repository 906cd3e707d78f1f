# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The peer control plane against one real daemon: the handshake's refusals (both ways, logged
once), Fetch's checks (namespace sizes, tenant namespaces, unknown links), the follower's resync
when the events it resumes from are gone (OUT_OF_RANGE), and a daemon without a peer tier."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from collections.abc import AsyncIterator
from concurrent import futures

import grpc
import pytest

from kvstored.io.breaker import CircuitBreaker
from kvstored.peer.control import ControlChannel
from kvstored.peer.follow import Follower
from kvstored.peer.handshake import LocalHello, hello_from_proto, namespace_fingerprint
from kvstored.peer.index import PeerIndex
from kvstored.peer.membership import PeerRecord
from kvstored.peer.transport import PeerAddress, TransportKind
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from tests.support.data import make_keys, payloads
from tests.support.ports import free_port
from tests.support.wait import wait_for

CHUNK = 64 << 10


class FakePeer(pb_grpc.PeerServicer):
    """A "peer" whose namespace ids are derived differently."""

    def __init__(self) -> None:
        self.hellos = 0
        self.lock = threading.Lock()

    def Hello(self, request, context):
        with self.lock:
            self.hellos += 1
        return pb.PeerHello(
            protocol_version=1,
            incarnation=7,
            chunk_format_version=1,
            namespace_fingerprint="not-the-same-derivation",
            transports=["tcp"],
            tcp_port=1,
        )


@pytest.fixture
def fake_peer():
    peer = FakePeer()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_PeerServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield peer, f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture
def node(daemon_factory, fake_peer):
    """A daemon with a peer tier whose only peer is the fake; small events buffer."""
    _, fake = fake_peer
    listen = f"127.0.0.1:{free_port()}"
    d = daemon_factory(
        [
            "--tcp-listen",
            listen,
            "--events-buffer",
            "16",
            "--tiers",
            f"kind=peer,peers={fake},transport=tcp,tcp_port=0,reconnect_s=0.1",
        ],
        cpu_bytes="16MiB",
    )
    d.listen = listen
    return d


def peer_stub(d):
    channel = grpc.insecure_channel(d.listen)
    return channel, pb_grpc.PeerStub(channel)


def test_a_peer_that_derives_namespace_ids_differently_is_refused_once_in_the_log(node, fake_peer):
    fake, address = fake_peer
    assert wait_for(lambda: fake.hellos >= 3)  # asked again and again...
    assert wait_for(lambda: any(p.state == pb.PEER_STATE_INCOMPATIBLE for p in _status(node).peers))
    (peer,) = _status(node).peers
    assert "namespace ids derived differently" in peer.detail and peer.indexed_chunks == 0
    assert node.log.count(f"peer {address} is incompatible") == 1  # ...and logged once


def test_an_incompatible_fetcher_is_refused_once_in_the_log(node):
    channel, stub = peer_stub(node)
    with channel:
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as err:
                stub.Hello(
                    pb.PeerHello(
                        protocol_version=1,
                        incarnation=42,
                        chunk_format_version=99,
                        namespace_fingerprint=namespace_fingerprint(),
                        address="10.9.9.9:7070",
                    ),
                    timeout=10,
                )
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "chunk format version 99" in err.value.details()
        good = stub.Hello(
            pb.PeerHello(
                protocol_version=1,
                incarnation=43,
                chunk_format_version=1,
                namespace_fingerprint=namespace_fingerprint(),
            ),
            timeout=10,
        )
        assert good.tcp_port and list(good.tiers) == ["ram"] and "tcp" in good.transports
    assert node.log.count("refusing peer 10.9.9.9:7070") == 1


def test_fetch_checks_the_namespace_and_never_serves_a_tenants_chunks(node):
    keys = make_keys("fetch-checks", 2)
    with node.client() as kv:
        public = kv.register_namespace(model="fetch-checks", dtype="u8", chunk_bytes=CHUNK)
        tenant = kv.register_namespace(model="fetch-checks", dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"s")
        kv.store(public, keys, payloads(keys, CHUNK))
        kv.store(tenant, keys, payloads(keys, CHUNK))
        channel, stub = peer_stub(node)
        with channel:

            def fetch(ns_id: str, chunk_bytes: int = CHUNK) -> pb.FetchResponse:
                return stub.Fetch(
                    pb.FetchRequest(
                        incarnation=5,
                        namespace_id=ns_id,
                        chunk_bytes=chunk_bytes,
                        key_bytes=32,
                        keys=keys,
                        transport="tcp",
                        link_id=12345,
                        timeout_ms=1000,
                        transfers=[
                            pb.PeerTransfer(transfer_id=i + 1, size=chunk_bytes, segments=[chunk_bytes])
                            for i in range(2)
                        ],
                    ),
                    timeout=10,
                )

            with pytest.raises(grpc.RpcError) as err:
                fetch(public.namespace_id, chunk_bytes=2 * CHUNK)
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert f"chunk_bytes {CHUNK}" in err.value.details()
            # no data connection of that id here: nothing is sent, and nothing stays leased
            assert fetch(public.namespace_id).outcome == pb.SEND_OUTCOME_NO_LINK
            before = node.stats().tiers[0].loaded_chunks
            assert fetch(tenant.namespace_id).outcome == pb.SEND_OUTCOME_NO_LINK
            assert node.stats().tiers[0].loaded_chunks == before  # the tenant's chunks were not even leased
            status = stub.Status(pb.PeerStatusRequest(), timeout=10)
            assert status.served_chunks == 0 and status.refused_chunks == 2 and status.leases == 0
    assert node.stats().peer_leases == 0


def test_malformed_peer_requests_get_a_status_and_the_daemon_serves_on(node):
    with node.client() as kv:
        ns = kv.register_namespace(model="malformed", dtype="u8", chunk_bytes=CHUNK)
        keys = make_keys("malformed", 1)
        kv.store(ns, keys, payloads(keys, CHUNK))
    channel, stub = peer_stub(node)

    def fetch(**fields) -> grpc.StatusCode | int:
        base = dict(
            incarnation=5,
            namespace_id=ns.namespace_id,
            chunk_bytes=CHUNK,
            key_bytes=32,
            keys=keys,
            transport="tcp",
            link_id=1,
            timeout_ms=500,
            transfers=[pb.PeerTransfer(transfer_id=1, size=CHUNK, segments=[CHUNK])],
        )
        try:
            return stub.Fetch(pb.FetchRequest(**{**base, **fields}), timeout=10).outcome
        except grpc.RpcError as exc:
            return exc.code()

    with channel:
        assert fetch(transport="rdma") is grpc.StatusCode.INVALID_ARGUMENT
        assert fetch(transport="ucx") == pb.SEND_OUTCOME_INVALID  # this daemon serves over TCP only
        assert fetch(keys=keys * 2) is grpc.StatusCode.INVALID_ARGUMENT
        assert fetch(keys=[b"short"]) is grpc.StatusCode.INVALID_ARGUMENT
        assert (
            fetch(
                keys=keys * 2000,
                transfers=[pb.PeerTransfer(transfer_id=i, size=CHUNK, segments=[CHUNK]) for i in range(2000)],
            )
            is grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert fetch(namespace_id="nope") == pb.SEND_OUTCOME_NO_LINK  # unknown namespace: not here
        assert fetch(transfers=[pb.PeerTransfer(transfer_id=1, size=CHUNK, segments=[1])]) == pb.SEND_OUTCOME_INVALID
        assert fetch(timeout_ms=0) == pb.SEND_OUTCOME_NO_LINK
    assert node.stats().peer_leases == 0 and "Traceback" not in node.log


async def test_a_follower_whose_events_are_gone_reads_the_peer_whole_again(node):
    """Resuming from a seq the peer no longer buffers (events_buffer 16) ends in OUT_OF_RANGE:
    the follower takes a snapshot into a fresh slot, then follows from there."""
    keys = make_keys("resync", 24)
    with node.client() as kv:
        ns = kv.register_namespace(model="resync", dtype="u8", chunk_bytes=CHUNK)
        for key in keys:  # 24 events: the first ones leave the buffer
            kv.store(ns, [key], payloads([key], CHUNK))
    async with _following(node.listen) as (record, index):
        await _until(lambda: record.counters.resyncs == 1 and index.count(record.slot) == len(keys))
        more = make_keys("resync-more", 1)
        with node.client() as kv:
            ns = kv.register_namespace(model="resync", dtype="u8", chunk_bytes=CHUNK)
            kv.store(ns, more, payloads(more, CHUNK))
        await _until(lambda: index.count(record.slot) == len(keys) + 1)  # followed after the snapshot
        assert [h.tier_bit for h in index.holders((ns.namespace_id, more[0]))] == [0]  # in its RAM


@contextlib.asynccontextmanager
async def _following(listen: str, coalesce: bool = True) -> AsyncIterator[tuple[PeerRecord, PeerIndex]]:
    """A Follower of the daemon at `listen`, as if it had followed it up to seq 1, running."""
    host, port = listen.rsplit(":", 1)
    channel = ControlChannel(PeerAddress(host, int(port)), None, 0.5)
    try:
        me = LocalHello(secrets.randbits(62) + 1, frozenset({TransportKind.TCP}), 0, 0, ("ram",), "test")
        record = PeerRecord(PeerAddress(host, int(port)), "test", CircuitBreaker(3, 5))
        record.hello = hello_from_proto(await channel.hello(me.to_proto(), 10))
        index = PeerIndex(1000)
        record.slot = index.add_peer()
        record.last_seq = 1
        follower = Follower(channel, record, index, me.incarnation, lambda: None, coalesce=coalesce)
        task = asyncio.create_task(follower.run())
        try:
            yield record, index
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        await channel.close()


@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesced", "each-event"])
async def test_a_follower_applies_what_it_missed_as_net_changes_or_event_by_event(daemon_factory, fake_peer, coalesce):
    """A follower resuming after 40 events (39 single-key stores, one delete of 9 of them) gets
    them replayed as one interval of net changes (one message), or one message per event; either
    way its index ends the same and it resumes after the last."""
    _, fake = fake_peer
    listen = f"127.0.0.1:{free_port()}"
    node = daemon_factory(
        ["--tcp-listen", listen, "--tiers", f"kind=peer,peers={fake},transport=tcp,tcp_port=0,reconnect_s=0.1"]
    )
    first, keys = make_keys("net-first", 1), make_keys("net", 39)
    with node.client() as kv:
        ns = kv.register_namespace(model="net", dtype="u8", chunk_bytes=CHUNK)
        kv.store(ns, first, payloads(first, CHUNK))  # seq 1: followed already
        for key in keys:
            kv.store(ns, [key], payloads([key], CHUNK))
        assert kv.delete(ns, keys[:9]) == 9
    async with _following(listen, coalesce) as (record, index):
        await _until(lambda: record.last_seq == 41)
        assert record.counters.events == (1 if coalesce else 40)
        assert index.count(record.slot) == 30 and record.counters.resyncs == 0
        assert [index.holders((ns.namespace_id, k)) for k in keys[:9]] == [[]] * 9
        assert all(index.holders((ns.namespace_id, k)) for k in keys[9:])


def test_a_daemon_without_a_peer_tier_says_so(shared_daemon):
    with shared_daemon.channel() as channel:
        stub = pb_grpc.PeerStub(channel)
        assert not stub.Status(pb.PeerStatusRequest(), timeout=10).enabled
        with pytest.raises(grpc.RpcError) as err:
            stub.Hello(pb.PeerHello(), timeout=10)
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "no peer tier" in err.value.details()


def _status(d) -> pb.PeerStatusResponse:
    with d.channel() as channel:
        return pb_grpc.PeerStub(channel).Status(pb.PeerStatusRequest(), timeout=10)


async def _until(predicate, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "condition never held"
        await asyncio.sleep(0.02)
