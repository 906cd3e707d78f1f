# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Slots reserved ahead (ReserveRequest.ahead, CommitRequest.keys): a store copies into a slot its
session holds already and posts the Commit that names the key. They count against RAM and the
namespace's and tenant's quotas, are freed when the session ends (a killed client included), a
commit of a key RAM holds already only frees its slot, and a daemon with a tier below RAM
grants none."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket as sockets
import subprocess
import sys

import grpc
import numpy as np

from kvstored_client import StoreOutcome
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.ahead import TARGET
from tests.support.daemon import REPO_ROOT, clean_env
from tests.support.data import make_keys, payloads
from tests.support.rpc import raw, rpc_error
from tests.support.wait import wait_for

CHUNK = 64 << 10

# A client that stores one chunk with slots reserved ahead, says so, and waits to be killed.
HOLDER = """
import json, sys
import numpy as np
from kvstored_client import Client
c = Client(sys.argv[1], deadline_s=10.0, store_ahead=True)
ns = c.register_namespace(model=sys.argv[2], dtype="u8", chunk_bytes=int(sys.argv[3]))
r = c.store(ns, [b"k" * 32], np.full(int(sys.argv[3]), 9, np.uint8))
print(json.dumps({"stored": r.stored, "ahead": c._session.ahead.held(ns.namespace_id)}), flush=True)
sys.stdin.read()
"""


def test_slots_reserved_ahead_count_in_ram_and_go_with_a_killed_client(daemon_factory, ns_name):
    d = daemon_factory(cpu_bytes="32MiB")
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(d.socket), ns_name, str(CHUNK)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=clean_env(),
    )
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline()) == {"stored": 1, "ahead": TARGET}
        held = d.stats()
        assert (held.ahead_slots, held.reservations) == (TARGET, 0)
        assert held.tiers[0].used_bytes == (1 + TARGET) * CHUNK  # the slots' pages are RAM in use
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        for pipe in (proc.stdin, proc.stdout):
            assert pipe is not None
            pipe.close()
    assert wait_for(lambda: (d.stats().sessions, d.stats().ahead_slots) == (0, 0)), d.stats()
    assert d.stats().tiers[0].used_bytes == CHUNK  # the slots are free; the committed chunk stays
    with d.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        out = np.zeros(CHUNK, np.uint8)
        assert c.load(ns, [b"k" * 32], out) == 1 and (out == 9).all()


def test_slots_reserved_ahead_count_against_a_tenants_quota(daemon_factory, ns_name):
    # 16 MiB RAM, a tenant quota of 4 MiB: 64 chunks, of which a session may hold 64 / 32 = 2 ahead.
    d = daemon_factory(["--tenant-quota", "4MiB"], cpu_bytes="16MiB")
    with d.client(store_ahead=True) as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"t-ahead")
        keys = make_keys(ns_name, 70)
        assert kv.store(ns, keys[:1], payloads(keys[:1], CHUNK)).stored == 1
        assert kv._session is not None and kv._session.ahead.held(ns.namespace_id) == 2
        (info,) = kv._run(lambda s: _list(s), None, session=True).namespaces
        assert (info.ram_chunks, info.tenant_ram_bytes) == (1, 3 * CHUNK)  # 1 chunk + 2 slots ahead
        # Filling the quota evicts the tenant's own oldest chunks; the slots held ahead stay within it.
        for i in range(1, 70, 2):
            batch = keys[i : i + 2]
            assert kv.store(ns, batch, payloads(batch, CHUNK)).stored == len(batch)
        (info,) = kv._run(lambda s: _list(s), None, session=True).namespaces
        assert info.tenant_ram_bytes == 4 << 20 and info.ram_chunks == 64 - kv._session.ahead.held(ns.namespace_id)
        out = np.zeros((4, CHUNK), np.uint8)
        assert kv.load(ns, keys[-4:], out) == 4
        np.testing.assert_array_equal(out, payloads(keys[-4:], CHUNK))
    # The session ended: its slots are free, the tenant holds only its chunks.
    assert wait_for(lambda: d.stats().ahead_slots == 0)
    assert d.stats().tiers[0].used_bytes == (64 - 2) * CHUNK


def _list(session):
    from kvstored_client.ops import Call

    return (yield Call("ListNamespaces", pb.ListNamespacesRequest(session_id=session.session_id)))


def test_a_commit_of_a_key_ram_holds_already_only_frees_its_slot(daemon_factory, ns_name):
    """Over gRPC (the complete API): Reserve with ahead, then Commit naming the keys."""
    d = daemon_factory(cpu_bytes="32MiB")
    keys = make_keys(ns_name, 3)
    with raw(d.socket) as conn:
        nsid = conn.register(ns_name, CHUNK)
        first = conn.call(
            "Reserve", pb.ReserveRequest(session_id=conn.session_id, namespace_id=nsid, keys=keys[:1], ahead=3)
        )
        assert len(first.ahead) == 3 and all(s.state == pb.SLOT_STATE_RESERVED for s in first.ahead)
        assert conn.stats().ahead_slots == 3 and conn.stats().reservations == 1
        # Each key's bytes into a slot: key 0 into its own reservation and into an ahead slot, key 1
        # into another ahead slot.
        pool = conn.session.pool
        assert pool is not None
        for slot, key in zip([first.slots[0], *first.ahead[:2]], [keys[0], keys[0], keys[1]]):
            (extent,) = slot.extents
            pool[extent.offset : extent.offset + CHUNK] = payloads([key], CHUNK)[0]
        handles = [s.handle for s in first.ahead[:2]]
        done = conn.call(
            "Commit",
            pb.CommitRequest(session_id=conn.session_id, handles=handles, keys=keys[:2], namespace_id=nsid, ahead=1),
        )
        # keys[0] has a reservation of its own (IN_PROGRESS): its ahead slot is freed; keys[1] is stored.
        assert list(done.states) == [pb.SLOT_STATE_IN_PROGRESS, pb.SLOT_STATE_RESERVED] and done.committed == 1
        assert len(done.ahead) == 1
        assert conn.call("Commit", pb.CommitRequest(session_id=conn.session_id, handles=[first.slots[0].handle]))
        stats = conn.stats()
        assert (stats.ahead_slots, stats.reservations) == (2, 0)
        assert stats.tiers[0].used_bytes == 4 * CHUNK  # 2 chunks + 2 slots ahead
        # A commit of a key RAM holds (READY) frees the slot and changes nothing.
        again = conn.call(
            "Commit",
            pb.CommitRequest(
                session_id=conn.session_id, handles=[done.ahead[0].handle], keys=[keys[0]], namespace_id=nsid
            ),
        )
        assert list(again.states) == [pb.SLOT_STATE_ALREADY_PRESENT] and again.committed == 0
        assert conn.stats().tiers[0].used_bytes == 3 * CHUNK
        leases = conn.acquire(nsid, keys[:2])
        assert [conn.read_extents(lease.extents) for lease in leases] == [
            p.tobytes() for p in payloads(keys[:2], CHUNK)
        ]
        conn.release([lease.handle for lease in leases])
        # Ahead handles are named with their namespace and one key each.
        for named in ([], keys[:2]):  # no key, or two, for one handle: refused, the handle stays held
            error = rpc_error(
                conn.call,
                "Commit",
                pb.CommitRequest(
                    session_id=conn.session_id, handles=[first.ahead[2].handle], keys=named, namespace_id=nsid
                ),
            )
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "one key per handle" in error.details()
            assert conn.stats().ahead_slots == 1
        assert conn.release([first.ahead[2].handle]) == 1
        assert conn.stats().ahead_slots == 0


def test_a_store_into_slots_reserved_ahead_round_trips_every_byte(daemon, ns_name):
    with daemon.client(store_ahead=True) as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        keys = make_keys(ns_name, 40)
        first = kv.store(ns, keys[:1], payloads(keys[:1], CHUNK))  # Reserve: the session gets its slots
        assert first.stored == 1
        for key in keys[1:]:
            result = kv.store(ns, [key], payloads([key], CHUNK))
            assert result.outcomes == (StoreOutcome.STORED,)
        out = np.zeros((len(keys), CHUNK), np.uint8)
        assert kv.load(ns, keys, out) == len(keys)
        np.testing.assert_array_equal(out, payloads(keys, CHUNK))
        assert kv.stats().ahead_slots == TARGET  # each posted Commit reserved its slot again


def test_a_daemon_with_a_tier_below_ram_grants_no_slots_ahead(daemon_factory, ns_name, tmp_path):
    d = daemon_factory(["--tiers", f"kind=fs,root={tmp_path / 'fs'},bytes=64MiB"], cpu_bytes="32MiB")
    with raw(d.socket) as conn:
        nsid = conn.register(ns_name, CHUNK)
        reply = conn.call(
            "Reserve",
            pb.ReserveRequest(session_id=conn.session_id, namespace_id=nsid, keys=make_keys(ns_name, 1), ahead=4),
        )
        assert len(reply.slots) == 1 and len(reply.ahead) == 0
        # A keyed Commit names slots reserved ahead only: Reserve's own handle is not one.
        error = rpc_error(
            conn.call,
            "Commit",
            pb.CommitRequest(
                session_id=conn.session_id, handles=[reply.slots[0].handle], keys=[b"x" * 32], namespace_id=nsid
            ),
        )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error


def test_a_store_a_closed_client_reported_is_there_for_the_next_connection(daemon, ns_name):
    """A store into a slot reserved ahead posts its Commit; the client's close reads its answer,
    so once close() returns, another connection (here gRPC only) finds the chunk, every time."""
    keys = make_keys(ns_name, 60)
    for first, posted in zip(keys[::2], keys[1::2], strict=True):
        with daemon.client(store_ahead=True) as kv:
            ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
            assert kv.store(ns, [first], payloads([first], CHUNK)).stored == 1
            assert kv.store(ns, [posted], payloads([posted], CHUNK)).stored == 1  # into a slot ahead
        with daemon.client(fast_path=False, key_index=False) as other:
            ns = other.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
            assert other.lookup(ns, [first, posted]).prefix_hits == 2


def test_all_sessions_together_hold_at_most_an_eighth_of_ram_ahead(daemon_factory, ns_name):
    # 32 MiB RAM of 64 KiB chunks: a session may hold 16 ahead (1/32 of RAM), all sessions 64 (1/8).
    d = daemon_factory(cpu_bytes="32MiB")
    keys = make_keys(ns_name, 8)
    with contextlib.ExitStack() as stack:
        conns = [stack.enter_context(raw(d.socket)) for _ in range(5)]
        nsid = conns[0].register(ns_name, CHUNK)

        def reserve(conn, key: bytes, ahead: int):
            request = pb.ReserveRequest(session_id=conn.session_id, namespace_id=nsid, keys=[key], ahead=ahead)
            return conn.call("Reserve", request)

        granted = [reserve(conn, keys[i], 16) for i, conn in enumerate(conns)]
        assert [len(g.ahead) for g in granted] == [16, 16, 16, 16, 0]
        assert d.stats().ahead_slots == 64
        # Slots committed under their keys are no longer held ahead: room for others again.
        first = granted[0]
        pool = conns[0].session.pool
        assert pool is not None
        for slot, key in zip(first.ahead[:4], keys[5:]):
            (extent,) = slot.extents
            pool[extent.offset : extent.offset + CHUNK] = payloads([key], CHUNK)[0]
        done = conns[0].call(
            "Commit",
            pb.CommitRequest(
                session_id=conns[0].session_id,
                handles=[s.handle for s in first.ahead[:3]],
                keys=keys[5:8],
                namespace_id=nsid,
            ),
        )
        assert done.committed == 3
        assert len(reserve(conns[4], keys[4], 16).ahead) == 3
        # A session that ends gives its slots back to the others.
        conns[1].close()
        assert wait_for(lambda: d.stats().ahead_slots == 48)
        assert len(reserve(conns[4], keys[4], 16).ahead) == 13  # up to its own 16
        leases = conns[0].acquire(nsid, keys[5:8])
        assert [conns[0].read_extents(lease.extents) for lease in leases] == [
            p.tobytes() for p in payloads(keys[5:8], CHUNK)
        ]
        conns[0].release([lease.handle for lease in leases])
    assert wait_for(lambda: d.stats().ahead_slots == 0)


def test_a_client_that_maps_no_arenas_gets_no_tenant_slots_ahead_from_a_commit(daemon, ns_name):
    """Reserve refuses such a client a tenant's slots (it would copy into the public pool at the
    arena's offsets); a Commit asking for slots ahead is refused the same way."""
    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_SEQPACKET) as sock, raw(daemon.socket, session=False) as conn:
        sock.connect(str(daemon.session_socket))
        hello = pb.SessionRequest(hello=pb.Hello(client_name="no-arenas", arenas=False)).SerializeToString()
        sockets.send_fds(sock, [hello], [])
        data, fds, _, _ = sockets.recv_fds(sock, 1 << 16, 4)
        for fd in fds:
            os.close(fd)
        session_id = pb.SessionReply.FromString(data).welcome.session_id
        spec = pb.NamespaceSpec(model=ns_name, dtype="uint8", chunk_bytes=CHUNK, tenant_salt=b"no-arenas")
        nsid = conn.call(
            "RegisterNamespace", pb.RegisterNamespaceRequest(spec=spec, session_id=session_id)
        ).namespace_id
        for method, request in (
            (
                "Reserve",
                pb.ReserveRequest(session_id=session_id, namespace_id=nsid, keys=make_keys(ns_name, 1), ahead=2),
            ),
            ("Commit", pb.CommitRequest(session_id=session_id, namespace_id=nsid, ahead=2)),
        ):
            error = rpc_error(conn.call, method, request)
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, (method, error.details())
            assert "maps only the public pool" in error.details()
        assert conn.stats().ahead_slots == 0
