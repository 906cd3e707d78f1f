# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Tenant isolation down to the bytes: a tenant's chunks live in an arena only its sessions map;
every API named with its namespace id by anyone else sees nothing and changes nothing; its
events reach only its sessions (and ZMQ only when configured)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import grpc
import msgpack
import numpy as np
import pytest
import zmq

from kvstored_client import DropReason, ops
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.errors import NotFound
from kvstored_client.protocol import Handshake
from kvstored_client.session import PoolSession, connect
from tests.support.daemon import REPO_ROOT, clean_env, short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.wait import wait_for
from tests.support.zmq_events import events_of, prompt_identities, replay

CHUNK = 64 << 10
SALT_A = b"tenant-a-secret"


def run_intruder(daemon, model: str, victim_label: str, n: int, salt: str, overwrite: bool) -> dict:
    argv = [
        sys.executable,
        "-m",
        "tests.support.intruder",
        "--socket",
        str(daemon.socket),
        "--model",
        model,
        "--chunk",
        str(CHUNK),
        "--victim-label",
        victim_label,
        "--n",
        str(n),
        "--salt",
        salt,
    ]
    if overwrite:
        argv.append("--overwrite")
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT, env=clean_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_no_other_client_maps_a_byte_of_a_tenants_chunks(daemon, ns_name):
    """Another tenant's process, and one with no tenant, scan every byte of every kvstored
    mapping they can get (their own arenas, the pool, every arena id they ask for) for tenant
    A's chunks and then overwrite all of it: they find none, and A's next load is exact."""
    keys = make_keys("victim", 16)
    data = payloads(keys, CHUNK)
    with daemon.client() as a:
        ns = a.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=SALT_A)
        assert a.store(ns, keys, data).stored == 16
        a_arenas = set(a._session._arenas)  # what A's session mapped for its namespace's slots
        assert a_arenas, "tenant A's chunks are in an arena of its own"
        for salt in ("tenant-b", ""):
            seen = run_intruder(daemon, ns_name, "victim", 16, salt, overwrite=True)
            assert seen["found"] == 0, seen
            assert seen["scanned"] >= 16 << 20  # at least the pool (16 MiB) was read
            assert not a_arenas & set(seen["opened"]), seen  # A's arena was refused to them
        out = np.zeros_like(data)
        assert a.load(ns, keys, out) == 16
        assert np.array_equal(out, data)
        # The scan can find them: a process of tenant A itself does.
        assert run_intruder(daemon, ns_name, "victim", 16, SALT_A.decode(), overwrite=False)["found"] == 16


def test_every_api_named_with_a_tenants_namespace_sees_and_changes_nothing(daemon, ns_name, tmp_path):
    keys = make_keys("victim-api", 4)
    data = payloads(keys, CHUNK)
    with daemon.client() as a, daemon.client() as b, daemon.channel() as channel:
        ns = a.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=SALT_A)
        assert a.store(ns, keys, data).stored == 4
        b.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"tenant-b")
        stub = pb_grpc.KVStoreStub(channel)
        sid_b = b._session.session_id
        nsid = ns.namespace_id
        # A's own handles: a reservation it has not committed yet.
        held = stub.Reserve(
            pb.ReserveRequest(session_id=a._session.session_id, namespace_id=nsid, keys=make_keys("victim-pending", 1)),
            timeout=10,
        )
        handle = held.slots[0].handle
        assert handle and held.slots[0].extents[0].arena != 0

        for sid in (sid_b, ""):
            lookup = stub.Lookup(pb.LookupRequest(namespace_id=nsid, keys=keys, session_id=sid), timeout=10)
            assert lookup.prefix_hits == 0 and set(lookup.tiers) == {pb.TIER_KIND_UNSPECIFIED}
            assert stub.Delete(pb.DeleteRequest(namespace_id=nsid, keys=keys, session_id=sid), timeout=10).deleted == 0
            assert (
                stub.ClearNamespace(pb.ClearNamespaceRequest(namespace_id=nsid, session_id=sid), timeout=10).removed
                == 0
            )
            listed = stub.ListNamespaces(pb.ListNamespacesRequest(session_id=sid), timeout=10)
            assert nsid not in {n.namespace_id for n in listed.namespaces}
        reserve = stub.Reserve(pb.ReserveRequest(session_id=sid_b, namespace_id=nsid, keys=keys), timeout=10)
        assert [s.state for s in reserve.slots] == [pb.SLOT_STATE_NO_SPACE] * 4 and not any(
            s.extents for s in reserve.slots
        )
        assert {s.drop_reason for s in reserve.slots} == {pb.DROP_REASON_NOT_VISIBLE}
        acquire = stub.Acquire(pb.AcquireRequest(session_id=sid_b, namespace_id=nsid, keys=keys), timeout=10)
        assert not acquire.leases
        for method, request in (
            ("Commit", pb.CommitRequest(session_id=sid_b, handles=[handle])),
            ("Release", pb.ReleaseRequest(session_id=sid_b, handles=[handle])),
            ("Commit", pb.CommitRequest(session_id=sid_b, handles=[handle + 1, handle - 1])),
        ):
            with pytest.raises(grpc.RpcError) as err:
                getattr(stub, method)(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # Region transfers with B's own region: nothing stored, nothing loaded, the region untouched.
        region_file = tmp_path / "region"
        region_file.write_bytes(b"\x5a" * (4 * CHUNK))
        region = b.register_region(str(region_file))
        offsets = [i * CHUNK for i in range(4)]
        stored = b._run(
            lambda s: ops.store_from_region(s, ns, region, make_keys("poison", 4), offsets), None, session=True
        )
        assert stored.stored == 0 and stored.dropped == 4
        assert stored.dropped_by_reason == {DropReason.NOT_VISIBLE: 4}
        assert b._run(lambda s: ops.load_to_region(s, ns, region, keys, offsets), -1, session=True) == 0
        assert region_file.read_bytes() == b"\x5a" * (4 * CHUNK)
        out = np.zeros_like(data)
        assert b._run(lambda s: ops.load(s, ns, keys, out), -1, session=True) == 0 and not out.any()
        assert b._run(lambda s: ops.store(s, ns, keys, np.full_like(data, 0xAB)), None, session=True).stored == 0
        with pytest.raises(NotFound):  # B may not open A's arena
            b._session.map_arena(held.slots[0].extents[0].arena)

        # A's reservation is still A's, and A's chunks are exactly A's.
        assert (
            stub.Release(pb.ReleaseRequest(session_id=a._session.session_id, handles=[handle]), timeout=10).released
            == 1
        )
        assert a.load(ns, keys, out) == 4 and np.array_equal(out, data)
        assert a.lookup(ns, keys).prefix_hits == 4


def test_a_client_that_maps_only_the_pool_gets_no_tenant_slots(daemon, ns_name):
    """A client that predates arenas (Hello without `arenas`) would copy a tenant's chunk into
    the public pool at the arena's offsets: it is refused the slots, with a message."""
    sock = connect(daemon.session_socket, 10)
    handshake = Handshake("old-client")
    handshake.hello = lambda: _old_hello(handshake)  # what a client of the previous release sends
    from kvstored_client.session import _exchange

    handshake.welcome_from(*_exchange(sock, handshake.hello()))
    session = PoolSession(sock, handshake, populate=False)
    try:
        with daemon.channel() as channel:
            stub = pb_grpc.KVStoreStub(channel)
            spec = ops.NamespaceSpec(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=SALT_A)
            stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(spec=spec.to_proto(), session_id=session.session_id), timeout=10
            )
            for call in (stub.Reserve, stub.Acquire):
                request_type = pb.ReserveRequest if call is stub.Reserve else pb.AcquireRequest
                with pytest.raises(grpc.RpcError) as err:
                    call(
                        request_type(
                            session_id=session.session_id, namespace_id=spec.namespace_id(), keys=make_keys("old", 1)
                        ),
                        timeout=10,
                    )
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "arena" in err.value.details()
    finally:
        session.close()


def _old_hello(handshake: Handshake):
    from kvstored_client.protocol import Awaiting, Packet

    handshake.awaiting = Awaiting.WELCOME
    return Packet(pb.SessionRequest(hello=pb.Hello(client_name="old-client")).SerializeToString())


def _events_until(stub, request: pb.WatchEventsRequest, marker_ns: str) -> list[pb.KvEvent]:
    """Events of a stream up to (and with) the first of `marker_ns`."""
    events = []
    call = stub.WatchEvents(request, timeout=20)
    for event in call:
        events.append(event)
        if event.namespace_id == marker_ns:
            call.cancel()
            break
    return events


def test_tenant_events_reach_only_its_sessions(daemon, ns_name):
    keys = make_keys("victim-events", 3)
    with daemon.client() as a, daemon.client() as b, daemon.channel() as channel:
        stub = pb_grpc.KVStoreStub(channel)
        ns = a.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=SALT_A)
        b.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"tenant-b")
        public = b.register_namespace(model=ns_name + "/public", dtype="u8", chunk_bytes=CHUNK)
        assert a.store(ns, keys, payloads(keys, CHUNK)).stored == 3
        assert a.delete(ns, keys[:1]) == 1
        marker = make_keys("marker", 1)
        b.store(public, marker, payloads(marker, CHUNK))

        for sid in ("", b._session.session_id):  # replayed from the start: A's events are skipped
            seen = _events_until(stub, pb.WatchEventsRequest(from_seq=1, session_id=sid), public.namespace_id)
            assert ns.namespace_id not in {e.namespace_id for e in seen}
            assert not set(keys) & {k for e in seen for k in e.keys}
        mine = _events_until(
            stub, pb.WatchEventsRequest(from_seq=1, session_id=a._session.session_id), public.namespace_id
        )
        assert [list(e.keys) for e in mine if e.namespace_id == ns.namespace_id] == [keys, keys[:1]]

        # Live (from the next seq on, so none falls before the stream starts): a watcher without a
        # session sees the next public event and none of A's.
        got: list[pb.KvEvent] = []
        next_seq = mine[-1].seq + 1
        reader = threading.Thread(
            target=lambda: got.extend(
                _events_until(stub, pb.WatchEventsRequest(from_seq=next_seq), public.namespace_id)
            )
        )
        reader.start()
        more, marker2 = make_keys("victim-events-live", 2), make_keys("marker-live", 1)
        a.store(ns, more, payloads(more, CHUNK))
        b.store(public, marker2, payloads(marker2, CHUNK))
        reader.join(30)
        assert [list(e.keys) for e in got] == [marker2]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("tenants_on_zmq", [False, True])
def test_zmq_publishes_tenant_events_only_when_asked(daemon_factory, ns_name, tenants_on_zmq):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)  # the router binds; the daemon's publisher connects to it
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(endpoint)
    args = ["--events-zmq-endpoint", endpoint]
    if tenants_on_zmq:
        args += ["--events-zmq-tenants", "true"]
    d = daemon_factory(args)
    try:
        with d.client() as kv:
            ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=SALT_A)
            public = kv.register_namespace(model=ns_name + "/public", dtype="u8", chunk_bytes=CHUNK)
            tenant_keys, marker = make_keys("zmq-tenant", 2), make_keys("zmq-marker", 1)
            _, tenant_ids = prompt_identities("zmq-tenant", 2)
            _, marker_ids = prompt_identities("zmq-marker", 1)
            kv.store(ns, tenant_keys, payloads(tenant_keys, CHUNK), blocks=tenant_ids)
            kv.store(public, marker, payloads(marker, CHUNK), blocks=marker_ids)
            hashes: set[int] = set()
            # batches are held until the router has subscribed: none is missed
            while marker_ids[0].block_hashes[0] not in hashes:
                assert sub.poll(20_000), "no ZMQ event"
                _topic, _seq, payload = sub.recv_multipart()
                for event in msgpack.unpackb(payload)[1]:
                    hashes.update(event.get("block_hashes", ()))  # (seq 0: AllBlocksCleared)
            assert bool({h for i in tenant_ids for h in i.block_hashes} & hashes) is tenants_on_zmq
    finally:
        sub.close(linger=0)


def _replayed_hashes(replay_port: int) -> set[int]:
    return {h for event in events_of(replay(replay_port)) for h in event.get("block_hashes", ())}


def test_a_restart_does_not_publish_what_the_disk_holds_of_a_tenant(daemon_factory, ns_name):
    """With events_zmq_tenants off, a restarted daemon re-announcing its fs tier's chunks left
    the tenant's out only while it ran: its identity records were read back and published (and
    their eviction, filtered, never took them back)."""
    root = short_tmpdir("kvfs")
    replay_port = _free_port()
    args = [
        "--events-zmq-endpoint",
        f"tcp://127.0.0.1:{_free_port()}",
        "--events-zmq-replay-endpoint",
        f"tcp://127.0.0.1:{replay_port}",
        "--tiers",
        f"kind=fs,root={root},bytes=64MiB",
        "--write-policy",
        "write-through",
    ]
    d = daemon_factory(args)
    keys, public_keys = make_keys("tenant-restore", 4), make_keys("public-restore", 1)
    _, ids = prompt_identities("tenant-restore", 4)
    _, public_ids = prompt_identities("public-restore", 1)
    tenant_hashes = {h for i in ids for h in i.block_hashes}
    marker = public_ids[0].block_hashes[0]
    try:
        with d.client() as kv:
            ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=SALT_A)
            public = kv.register_namespace(model=ns_name + "/public", dtype="u8", chunk_bytes=CHUNK)
            assert kv.store(ns, keys, payloads(keys, CHUNK), blocks=ids).stored == 4
            assert kv.store(public, public_keys, payloads(public_keys, CHUNK), blocks=public_ids).stored == 1
            assert wait_for(lambda: next(t.chunks for t in d.stats().tiers if t.name == "fs") == 5)
            assert wait_for(lambda: marker in _replayed_hashes(replay_port))
            assert not _replayed_hashes(replay_port) & tenant_hashes
        d.stop()
        d.start(args)
        assert wait_for(lambda: marker in _replayed_hashes(replay_port), timeout=20)  # the disk read back
        assert not _replayed_hashes(replay_port) & tenant_hashes
        # From seq 0, AllBlocksCleared on the node's topic and on the topic of each model known
        # again (llm-d takes the model from the topic), never on the tenant's
        cleared = [
            (seq, topic.rsplit(b"@", 1)[1])
            for topic, seq, payload in replay(replay_port)
            if msgpack.unpackb(payload)[1] == [{"type": "AllBlocksCleared"}]
        ]
        assert cleared == [(0, b""), (1, f"{ns_name}/public".encode())]
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- quotas ---------------------------------------------------------------------------------------


def _list(daemon, session_id: str = "") -> pb.ListNamespacesResponse:
    with daemon.channel() as channel:
        return pb_grpc.KVStoreStub(channel).ListNamespaces(pb.ListNamespacesRequest(session_id=session_id), timeout=10)


def test_a_noisy_tenant_cannot_push_a_quiet_tenant_below_its_share(daemon_factory, ns_name):
    """16 MiB of RAM, each tenant at most half: a quiet tenant keeps its 4 MiB while a noisy one
    stores 12 times its own share; the noisy one's own oldest chunks make its room."""
    d = daemon_factory(["--tenant-quota", "50%"], cpu_bytes="16MiB")
    quiet_keys, noisy_keys = make_keys("quiet", 64), make_keys("noisy", 1536)  # 4 MiB, 96 MiB
    quiet_data = payloads(quiet_keys, CHUNK)
    # (No slots reserved ahead: they would count in the quotas beside the chunks counted here.)
    with d.client(store_ahead=False) as quiet, d.client(store_ahead=False) as noisy:
        q = quiet.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"quiet")
        n = noisy.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"noisy")
        assert quiet.store(q, quiet_keys, quiet_data).stored == 64
        for i in range(0, len(noisy_keys), 64):
            batch = noisy_keys[i : i + 64]
            assert noisy.store(n, batch, payloads(batch, CHUNK)).stored == 64
        out = np.zeros_like(quiet_data)
        assert quiet.load(q, quiet_keys, out) == 64
        assert np.array_equal(out, quiet_data)
        # The noisy tenant holds its quota's worth: its newest chunks.
        assert noisy.lookup(n, noisy_keys[-128:]).prefix_hits == 128
        assert noisy.lookup(n, noisy_keys[:1]).prefix_hits == 0
        mine = {i.namespace_id: i for i in _list(d, noisy._session.session_id).namespaces}[n.namespace_id]
        assert (mine.tenant_quota_bytes, mine.tenant_ram_bytes, mine.ram_chunks) == (8 << 20, 8 << 20, 128)
        listed = _list(d)
        assert (listed.tenants, listed.tenant_ram_bytes, listed.tenant_quota_bytes) == (2, 12 << 20, 8 << 20)


def test_a_namespace_quota_evicts_only_its_own_chunks(daemon_factory, ns_name):
    d = daemon_factory(cpu_bytes="16MiB")
    kept, churn = make_keys("kept", 32), make_keys("churn", 256)
    with d.client() as kv:
        plain = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        capped = kv.register_namespace(model=ns_name + "/capped", dtype="u8", chunk_bytes=CHUNK, quota_bytes=1 << 20)
        assert kv.store(plain, kept, payloads(kept, CHUNK)).stored == 32
        for i in range(0, 256, 8):
            assert kv.store(capped, churn[i : i + 8], payloads(churn[i : i + 8], CHUNK)).stored == 8
        assert kv.lookup(plain, kept).prefix_hits == 32
        assert kv.lookup(capped, churn[-16:]).prefix_hits == 16 and kv.lookup(capped, churn[-17:]).prefix_hits == 0
        # One batch larger than the quota: its own reservations cannot be evicted, the rest is dropped.
        big = make_keys("churn-big", 32)
        result = kv.store(capped, big, payloads(big, CHUNK))
        assert (result.stored, result.dropped) == (16, 16)
        info = {i.namespace_id: i for i in _list(d).namespaces}
        assert (info[capped.namespace_id].quota_bytes, info[capped.namespace_id].ram_bytes) == (1 << 20, 1 << 20)
        assert (info[plain.namespace_id].quota_bytes, info[plain.namespace_id].ram_bytes) == (0, 2 << 20)
        with pytest.raises(Exception, match="less than one chunk"):
            kv.register_namespace(model=ns_name + "/tiny", dtype="u8", chunk_bytes=CHUNK, quota_bytes=1000)


def _memfd_bytes(pid: int) -> dict[str, int]:
    """Memory each of a process's kvstored pool and arena memfds holds (allocated blocks), by name."""
    import os

    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if "memfd:kvstored-pool" in target or "memfd:kvstored-arena" in target:  # (not key indexes)
                out[target] = os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512
        except OSError:
            continue
    return out


def test_arenas_together_stay_within_the_ram_tier(daemon_factory, ns_name):
    """The pool is populated (16 MiB); a tenant then stores 8 MiB into its sparse arena: the pool
    gives free pages back so both together hold no more than the RAM tier (plus a slack). Once
    the tenant's chunks are gone and public ones fill the pool again, the tenant's arena gives
    its memory back."""
    d = daemon_factory(["--tenant-quota", "50%"], cpu_bytes="16MiB")
    capacity, slack = 16 << 20, (16 << 20) // 64  # the RAM tier keeps 1/64 of itself (at most 16 MiB) for reuse
    keys = make_keys("resident", 128)
    with d.client() as kv:
        assert sum(_memfd_bytes(d.pid).values()) == capacity
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"resident")
        assert kv.store(ns, keys, payloads(keys, CHUNK)).stored == 128
        held = _memfd_bytes(d.pid)
        assert any("arena" in name and size >= 8 << 20 for name, size in held.items()), held
        assert wait_for(lambda: sum(_memfd_bytes(d.pid).values()) <= capacity + slack), _memfd_bytes(d.pid)
        assert kv.delete(ns, keys) == 128
        public = kv.register_namespace(model=ns_name + "/public", dtype="u8", chunk_bytes=CHUNK)
        fill = make_keys("resident-public", 256)  # the whole RAM tier
        for i in range(0, 256, 64):
            assert kv.store(public, fill[i : i + 64], payloads(fill[i : i + 64], CHUNK)).stored == 64
        assert wait_for(lambda: max(size for name, size in _memfd_bytes(d.pid).items() if "arena" in name) <= slack)
        assert wait_for(lambda: sum(_memfd_bytes(d.pid).values()) <= capacity + slack), _memfd_bytes(d.pid)


def test_quotas_are_counted_in_metrics_and_shown_by_kvstoredctl(daemon_factory, ns_name):
    from tests.integration.test_ctl import ok
    from tests.integration.test_metrics import METRICS_PORT_0, Scrape, scrape

    d = daemon_factory(["--tenant-quota", "4MiB", *METRICS_PORT_0], cpu_bytes="16MiB")
    tenant_keys, capped_keys = make_keys("metrics-tenant", 96), make_keys("metrics-capped", 32)
    with d.client(store_ahead=False) as kv:  # (slots reserved ahead would count in the quotas too)
        ns = kv.register_namespace(
            model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=SALT_A, quota_bytes=8 << 20
        )  # capped by the tenant's quota
        capped = kv.register_namespace(model=ns_name + "/capped", dtype="u8", chunk_bytes=CHUNK, quota_bytes=1 << 20)
        for i in range(0, 96, 16):
            kv.store(ns, tenant_keys[i : i + 16], payloads(tenant_keys[i : i + 16], CHUNK))
        for i in range(0, 32, 8):
            kv.store(capped, capped_keys[i : i + 8], payloads(capped_keys[i : i + 8], CHUNK))
        scraped = Scrape(scrape(d))
        assert scraped.value("kvstored_tenants") == 1
        [tenant] = [dict(labels)["tenant"] for labels in scraped.series("kvstored_tenant_ram_bytes")]
        assert scraped.value("kvstored_tenant_quota_bytes", tenant=tenant) == 4 << 20
        assert scraped.value("kvstored_tenant_ram_bytes", tenant=tenant) == 4 << 20
        assert scraped.value("kvstored_tenant_quota_evictions_total", tenant=tenant) == 96 - 64
        nsid = capped.namespace_id
        assert scraped.value("kvstored_namespace_quota_bytes", namespace=nsid) == 1 << 20
        assert scraped.value("kvstored_namespace_ram_bytes", namespace=nsid) == 1 << 20
        assert scraped.value("kvstored_namespace_quota_evictions_total", namespace=nsid) == 32 - 16
        assert set(scraped.series("kvstored_namespace_ram_bytes")) == {frozenset({("namespace", nsid)})}
        assert SALT_A.decode() not in scraped.text and ns.namespace_id not in scraped.text

        listed = {n["namespace_id"]: n for n in json.loads(ok("namespaces", "--json", socket_path=d.socket))}
        assert set(listed) == {nsid}  # the tenant's namespace is not shown
        assert (listed[nsid]["quota_bytes"], listed[nsid]["ram_bytes"], listed[nsid]["ram_chunks"]) == (
            1 << 20,
            1 << 20,
            16,
        )
        text = ok("namespaces", socket_path=d.socket)
        assert "QUOTA" in text and "1.0 MiB" in text
        assert "1 tenant(s)" in text and "4.0 MiB" in text


def test_a_tenant_over_its_quota_writes_its_own_oldest_chunks_down_first(daemon_factory, ns_name, tmp_path):
    """With a tier below RAM, a tenant at its quota does not drop its oldest chunks: they are
    written down (write-back within the quota), and come back (into its arena) on a load."""
    from tests.support.daemon import short_tmpdir

    root = short_tmpdir("kvfs")
    d = daemon_factory(["--tenant-quota", "2MiB", "--tiers", f"kind=fs,root={root},bytes=64MiB"], cpu_bytes="16MiB")
    keys = make_keys("spill", 96)  # 6 MiB: three times the quota
    data = payloads(keys, CHUNK)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=SALT_A)
        for i in range(0, 96, 8):
            assert kv.store(ns, keys[i : i + 8], data[i : i + 8]).stored == 8
        [ram] = [t for t in d.stats().tiers if t.kind == pb.TIER_KIND_RAM]
        assert ram.dropped_dirty == 0 and ram.writedowns >= 64
        out = np.zeros_like(data)
        for i in range(0, 96, 8):
            assert kv.load(ns, keys[i : i + 8], out[i : i + 8]) == 8
        assert np.array_equal(out, data)
        mine = {n.namespace_id: n for n in _list(d, kv._session.session_id).namespaces}[ns.namespace_id]
        assert mine.tenant_ram_bytes <= 2 << 20
