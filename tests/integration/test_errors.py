# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Bad input gets the right gRPC status and a message naming what was wrong; afterwards the
daemon still serves and what was stored before is intact (checked after every test here)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstored_client import errors as client_errors
from kvstored_client.session import PoolSession
from tests.conftest import SHARED_MAX_BATCH_KEYS
from tests.support.data import make_keys, payloads
from tests.support.rpc import pb, raw, rpc_error

CHUNK = 64 << 10
SENTINEL_MODEL = "test/errors-sentinel"
S = grpc.StatusCode


@pytest.fixture(scope="module")
def sentinel(shared_daemon):
    """Chunks stored before the bad inputs; they must survive every one of them."""
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=SENTINEL_MODEL, dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys(SENTINEL_MODEL, 4)
        data = payloads(keys, CHUNK)
        res = c.store(ns, keys, data)
        assert res.stored + res.already_present == 4
    return keys, data


@pytest.fixture(autouse=True)
def still_serving_and_intact(shared_daemon, sentinel):
    yield
    assert shared_daemon.running, f"daemon died:\n{shared_daemon.log}"
    keys, data = sentinel
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=SENTINEL_MODEL, dtype="uint8", chunk_bytes=CHUNK)
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == len(keys)
        np.testing.assert_array_equal(out, data)
    # Every session of the test is closed: nothing it held may stay behind.
    deadline = time.monotonic() + 20
    while (shared_daemon.stats().leases, shared_daemon.stats().reservations) != (0, 0):
        assert time.monotonic() < deadline, shared_daemon.stats()
        time.sleep(0.02)


@pytest.fixture
def conn(shared_daemon):
    with raw(shared_daemon.socket) as r:
        yield r


@pytest.fixture
def ns_id(conn, ns_name) -> str:
    return conn.register(ns_name, CHUNK)


@pytest.fixture
def shm_dir():
    with tempfile.TemporaryDirectory(prefix="kverr", dir="/dev/shm") as d:
        yield Path(d)


def make_file(directory: Path, size: int, name: str = "region") -> Path:
    path = directory / name
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


@pytest.fixture
def region_id(conn, shm_dir) -> int:
    """A valid region (4 chunks) of the conn's session."""
    path = make_file(shm_dir, 4 * CHUNK, "valid-region")
    return conn.call("RegisterRegion", pb.RegisterRegionRequest(session_id=conn.session_id, path=str(path))).region_id


def keyed_requests(conn, ns_id, keys, region_id):
    """Every RPC that takes (namespace, keys), as (method, request); everything else is valid."""
    sid = conn.session_id
    offsets = [0] * len(keys)
    return [
        ("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=keys)),
        ("Reserve", pb.ReserveRequest(session_id=sid, namespace_id=ns_id, keys=keys)),
        ("Acquire", pb.AcquireRequest(session_id=sid, namespace_id=ns_id, keys=keys)),
        ("Delete", pb.DeleteRequest(namespace_id=ns_id, keys=keys)),
        (
            "StoreFromRegion",
            pb.RegionTransferRequest(
                session_id=sid, namespace_id=ns_id, region_id=region_id, keys=keys, offsets=offsets
            ),
        ),
        (
            "LoadToRegion",
            pb.RegionTransferRequest(
                session_id=sid, namespace_id=ns_id, region_id=region_id, keys=keys, offsets=offsets
            ),
        ),
    ]


def expect(conn, method, request, code, *fragments):
    err = rpc_error(conn.call, method, request)
    assert err.code() == code, (method, err.code(), err.details())
    for fragment in fragments:
        assert fragment in err.details(), (method, fragment, err.details())
    return err


# -- keys and namespaces -------------------------------------------------------------------------


@pytest.mark.parametrize("length", [0, 31, 33, 64])
def test_wrong_key_length_is_invalid_argument(conn, ns_id, region_id, length):
    good = make_keys("x", 1)[0]
    for method, request in keyed_requests(conn, ns_id, [good, b"k" * length], region_id):
        expect(conn, method, request, S.INVALID_ARGUMENT, "key 1", f"{length} bytes", "32-byte")
    assert conn.stats().reservations == 0  # nothing half-done


def test_key_length_follows_the_namespace(conn, ns_name):
    ns16 = conn.register(ns_name, CHUNK, key_bytes=16)
    ok = conn.call("Lookup", pb.LookupRequest(namespace_id=ns16, keys=[b"a" * 16]))
    assert ok.prefix_hits == 0
    expect(conn, "Lookup", pb.LookupRequest(namespace_id=ns16, keys=[b"a" * 32]), S.INVALID_ARGUMENT, "16-byte")


def test_unknown_namespace_is_not_found(conn, region_id):
    bogus = "0123456789abcdef0123456789abcdef"
    for method, request in keyed_requests(conn, bogus, make_keys("x", 1), region_id):
        err = expect(conn, method, request, S.NOT_FOUND, bogus)
        assert dict(err.trailing_metadata()).get("kvstored-error") == "UnknownNamespace"


def test_client_raises_for_wrong_key_length(shared_daemon, ns_name):
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        with pytest.raises(client_errors.InvalidArgument, match="31 bytes"):
            c.lookup(ns, [b"k" * 31])
        with pytest.raises(client_errors.InvalidArgument, match="31 bytes"):
            c.store(ns, [b"k" * 31], np.zeros(CHUNK, np.uint8))
        # The client still works afterwards.
        keys = make_keys(ns_name, 1)
        assert c.store(ns, keys, payloads(keys, CHUNK)).stored == 1


@pytest.mark.parametrize(
    "spec, fragment",
    [
        (dict(model="", dtype="u8", chunk_bytes=CHUNK), "model"),
        (dict(model="m", dtype="u8", chunk_bytes=0), "chunk_bytes"),
        (dict(model="m", dtype="u8", chunk_bytes=1 << 40), "chunk_bytes"),
        (dict(model="m", dtype="u8", chunk_bytes=CHUNK, key_bytes=4), "key_bytes"),
        (dict(model="m", dtype="u8", chunk_bytes=CHUNK, key_bytes=65), "key_bytes"),
    ],
)
def test_bad_namespace_spec_is_invalid_argument(conn, spec, fragment):
    before = conn.stats().namespaces
    request = pb.RegisterNamespaceRequest(spec=pb.NamespaceSpec(**spec))
    expect(conn, "RegisterNamespace", request, S.INVALID_ARGUMENT, fragment)
    assert conn.stats().namespaces == before


# -- chunk sizes and regions ---------------------------------------------------------------------


def test_wrong_size_buffer_is_a_client_value_error(shared_daemon, ns_name):
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys(ns_name, 2)
        with pytest.raises(ValueError, match=str(2 * CHUNK)):
            c.store(ns, keys, np.zeros(2 * CHUNK - 1, np.uint8))
        with pytest.raises(ValueError, match="buffer 1"):
            c.store(ns, keys, [np.zeros(CHUNK, np.uint8), np.zeros(CHUNK + 1, np.uint8)])
        with pytest.raises(ValueError, match="2 keys but 3 buffers"):
            c.store(ns, keys, [np.zeros(CHUNK, np.uint8)] * 3)
        with pytest.raises(ValueError):
            c.load(ns, keys, np.zeros(2 * CHUNK + 1, np.uint8))
        with pytest.raises(ValueError, match="read-only"):
            c.load(ns, keys, bytes(2 * CHUNK))
        assert c.lookup(ns, keys).prefix_hits == 0  # nothing was stored
        stats = shared_daemon.stats()
        assert stats.reservations == 0
        # The same client stores fine with the right sizes.
        assert c.store(ns, keys, payloads(keys, CHUNK)).stored == 2


def test_region_offsets_outside_the_region(conn, ns_id, shm_dir):
    path = make_file(shm_dir, 4 * CHUNK)
    reg = conn.call("RegisterRegion", pb.RegisterRegionRequest(session_id=conn.session_id, path=str(path)))
    keys = make_keys("outside", 2)
    for offsets in ([0, 3 * CHUNK + 1], [4 * CHUNK, 0], [2**63, 0], [2**64 - 1, 0]):
        for method in ("StoreFromRegion", "LoadToRegion"):
            request = pb.RegionTransferRequest(
                session_id=conn.session_id, namespace_id=ns_id, region_id=reg.region_id, keys=keys, offsets=offsets
            )
            expect(conn, method, request, S.INVALID_ARGUMENT, "outside region", str(4 * CHUNK))
    assert conn.call("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=keys)).prefix_hits == 0
    assert conn.stats().reservations == 0


def test_region_keys_and_offsets_must_pair_up(conn, ns_id, shm_dir):
    path = make_file(shm_dir, 4 * CHUNK)
    reg = conn.call("RegisterRegion", pb.RegisterRegionRequest(session_id=conn.session_id, path=str(path)))
    keys = make_keys("pairs", 2)
    for method in ("StoreFromRegion", "LoadToRegion"):
        request = pb.RegionTransferRequest(
            session_id=conn.session_id, namespace_id=ns_id, region_id=reg.region_id, keys=keys, offsets=[0]
        )
        expect(conn, method, request, S.INVALID_ARGUMENT, "2 keys but 1 offsets")


def test_region_too_small_for_a_chunk(conn, ns_id, shm_dir):
    path = make_file(shm_dir, CHUNK // 2)
    reg = conn.call("RegisterRegion", pb.RegisterRegionRequest(session_id=conn.session_id, path=str(path)))
    assert reg.size == CHUNK // 2
    keys = make_keys("small-region", 1)
    for method in ("StoreFromRegion", "LoadToRegion"):
        request = pb.RegionTransferRequest(
            session_id=conn.session_id, namespace_id=ns_id, region_id=reg.region_id, keys=keys, offsets=[0]
        )
        expect(conn, method, request, S.INVALID_ARGUMENT, "outside region", f"({CHUNK // 2} bytes)")


def test_client_region_offsets_outside_raise_invalid_argument(shared_daemon, ns_name, shm_dir):
    path = make_file(shm_dir, 2 * CHUNK)
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        region = c.register_region(path)
        keys = make_keys(ns_name, 1)
        with pytest.raises(client_errors.InvalidArgument, match="outside region"):
            c.store_from_region(ns, region, keys, [CHUNK + 1])
        with pytest.raises(client_errors.InvalidArgument, match="outside region"):
            c.load_to_region(ns, region, keys, [2 * CHUNK])
        assert c.store_from_region(ns, region, keys, [CHUNK]).stored == 1


def test_region_file_missing_is_not_found(conn, shm_dir):
    missing = shm_dir / "no-such-region"
    expect(
        conn,
        "RegisterRegion",
        pb.RegisterRegionRequest(session_id=conn.session_id, path=str(missing)),
        S.NOT_FOUND,
        str(missing),
    )


def test_client_register_region_missing_file(shared_daemon, shm_dir):
    with shared_daemon.client() as c:
        with pytest.raises(client_errors.RegionFileMissing, match="no-such"):
            c.register_region(shm_dir / "no-such")


@pytest.mark.parametrize("kind", ["empty-path", "directory", "empty-file"])
def test_unusable_region_is_invalid_argument(conn, shm_dir, kind):
    if kind == "empty-path":
        path, fragment = "", "path"
    elif kind == "directory":
        path, fragment = str(shm_dir), str(shm_dir)
    else:
        path, fragment = str(make_file(shm_dir, 0)), "empty"
    before = conn.stats().regions
    expect(
        conn,
        "RegisterRegion",
        pb.RegisterRegionRequest(session_id=conn.session_id, path=path),
        S.INVALID_ARGUMENT,
        fragment,
    )
    assert conn.stats().regions == before


def test_unknown_region_is_not_found(conn, ns_id):
    for method in ("StoreFromRegion", "LoadToRegion"):
        request = pb.RegionTransferRequest(
            session_id=conn.session_id, namespace_id=ns_id, region_id=987654321, keys=make_keys("r", 1), offsets=[0]
        )
        expect(conn, method, request, S.NOT_FOUND, "region 987654321")


def test_region_of_another_session_is_not_usable(shared_daemon, conn, ns_id, shm_dir):
    path = make_file(shm_dir, 2 * CHUNK)
    with raw(shared_daemon.socket) as other:
        reg = other.call("RegisterRegion", pb.RegisterRegionRequest(session_id=other.session_id, path=str(path)))
        request = pb.RegionTransferRequest(
            session_id=conn.session_id, namespace_id=ns_id, region_id=reg.region_id, keys=make_keys("r", 1), offsets=[0]
        )
        expect(conn, "LoadToRegion", request, S.NOT_FOUND, f"region {reg.region_id}")


# -- batches, sessions, handles ------------------------------------------------------------------


def test_oversized_batch_is_resource_exhausted(conn, ns_id, region_id):
    limit = SHARED_MAX_BATCH_KEYS
    ok = conn.call("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=make_keys("batch", limit)))
    assert len(ok.tiers) == limit
    too_many = make_keys("batch", limit + 1)
    for method, request in keyed_requests(conn, ns_id, too_many, region_id):
        expect(conn, method, request, S.RESOURCE_EXHAUSTED, str(limit + 1), f"max_batch_keys={limit}")
    handles = list(range(1, limit + 2))
    expect(
        conn,
        "Release",
        pb.ReleaseRequest(session_id=conn.session_id, handles=handles),
        S.RESOURCE_EXHAUSTED,
        f"max_batch_keys={limit}",
    )
    expect(
        conn,
        "Commit",
        pb.CommitRequest(session_id=conn.session_id, handles=handles),
        S.RESOURCE_EXHAUSTED,
        f"max_batch_keys={limit}",
    )
    assert conn.stats().reservations == 0


def test_unknown_session_is_not_found(conn, ns_id, shm_dir):
    bogus = "feedfacefeedfacefeedfacefeedface"
    keys = make_keys("sess", 1)
    requests = [
        ("Reserve", pb.ReserveRequest(session_id=bogus, namespace_id=ns_id, keys=keys)),
        ("Acquire", pb.AcquireRequest(session_id=bogus, namespace_id=ns_id, keys=keys)),
        ("Commit", pb.CommitRequest(session_id=bogus, handles=[1])),
        ("Release", pb.ReleaseRequest(session_id=bogus, handles=[1])),
        ("RegisterRegion", pb.RegisterRegionRequest(session_id=bogus, path=str(make_file(shm_dir, CHUNK)))),
        (
            "StoreFromRegion",
            pb.RegionTransferRequest(session_id=bogus, namespace_id=ns_id, region_id=1, keys=keys, offsets=[0]),
        ),
        (
            "LoadToRegion",
            pb.RegionTransferRequest(session_id=bogus, namespace_id=ns_id, region_id=1, keys=keys, offsets=[0]),
        ),
    ]
    for method, request in requests:
        err = expect(conn, method, request, S.NOT_FOUND, bogus, "session")
        assert dict(err.trailing_metadata()).get("kvstored-error") == "UnknownSession"


def test_session_id_dies_with_its_connection(shared_daemon, ns_name):
    with raw(shared_daemon.socket) as r:
        ns_id = r.register(ns_name, CHUNK)
        old = PoolSession.open(shared_daemon.socket, "short-lived", 10.0)
        sid = old.session_id
        old.close()
        request = pb.ReserveRequest(session_id=sid, namespace_id=ns_id, keys=make_keys("gone", 1))
        deadline = time.monotonic() + 20
        while True:  # the daemon notices the closed connection asynchronously
            try:
                r.call("Reserve", request)
            except grpc.RpcError as err:
                assert err.code() == S.NOT_FOUND and sid in err.details()
                break
            assert time.monotonic() < deadline, "closed session still accepted"
            time.sleep(0.02)


def test_releasing_a_lease_twice_is_failed_precondition(shared_daemon, conn, ns_name):
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys(ns_name, 2)
        c.store(ns, keys, payloads(keys, CHUNK))
    conn.register(ns_name, CHUNK)
    leases = conn.acquire(ns.namespace_id, keys)
    handles = [lease.handle for lease in leases]
    assert conn.stats().leases >= 2
    assert conn.release(handles[:1]) == 1
    err = expect(
        conn,
        "Release",
        pb.ReleaseRequest(session_id=conn.session_id, handles=handles[:1]),
        S.FAILED_PRECONDITION,
        f"handle {handles[0]}",
    )
    assert dict(err.trailing_metadata()).get("kvstored-error") == "HandleNotHeld"
    # All or nothing: a batch with one bad handle releases none of them.
    expect(
        conn,
        "Release",
        pb.ReleaseRequest(session_id=conn.session_id, handles=handles),
        S.FAILED_PRECONDITION,
        f"handle {handles[0]}",
    )
    assert conn.release(handles[1:]) == 1
    # The same handle twice in one request.
    again = conn.acquire(ns.namespace_id, keys[:1])
    expect(
        conn,
        "Release",
        pb.ReleaseRequest(session_id=conn.session_id, handles=[again[0].handle] * 2),
        S.INVALID_ARGUMENT,
        "twice",
    )
    assert conn.release([again[0].handle]) == 1


def test_commit_of_a_lease_or_a_stranger_handle_is_failed_precondition(shared_daemon, conn, ns_name):
    ns_id = conn.register(ns_name, CHUNK)
    keys = make_keys(ns_name, 1)
    slots = conn.call("Reserve", pb.ReserveRequest(session_id=conn.session_id, namespace_id=ns_id, keys=keys)).slots
    assert slots[0].state == pb.SLOT_STATE_RESERVED
    handle = slots[0].handle
    # Another session cannot commit or release our reservation.
    with raw(shared_daemon.socket) as other:
        expect(
            other,
            "Commit",
            pb.CommitRequest(session_id=other.session_id, handles=[handle]),
            S.FAILED_PRECONDITION,
            f"handle {handle}",
        )
        expect(
            other,
            "Release",
            pb.ReleaseRequest(session_id=other.session_id, handles=[handle]),
            S.FAILED_PRECONDITION,
            f"handle {handle}",
        )
    # A second writer of the same key is told another writer is in progress.
    again = conn.call("Reserve", pb.ReserveRequest(session_id=conn.session_id, namespace_id=ns_id, keys=keys)).slots
    assert again[0].state == pb.SLOT_STATE_IN_PROGRESS
    assert conn.call("Commit", pb.CommitRequest(session_id=conn.session_id, handles=[handle])).committed == 1
    expect(
        conn,
        "Commit",
        pb.CommitRequest(session_id=conn.session_id, handles=[handle]),
        S.FAILED_PRECONDITION,
        f"handle {handle}",
    )
    lease = conn.acquire(ns_id, keys)[0]
    expect(
        conn,
        "Commit",
        pb.CommitRequest(session_id=conn.session_id, handles=[lease.handle]),
        S.FAILED_PRECONDITION,
        f"handle {lease.handle}",
    )
    assert conn.release([lease.handle]) == 1


def test_released_reservation_is_abandoned(conn, ns_name):
    ns_id = conn.register(ns_name, CHUNK)
    keys = make_keys(ns_name, 1)
    slot = conn.call("Reserve", pb.ReserveRequest(session_id=conn.session_id, namespace_id=ns_id, keys=keys)).slots[0]
    assert conn.release([slot.handle]) == 1
    assert conn.call("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=keys)).prefix_hits == 0
    slot = conn.call("Reserve", pb.ReserveRequest(session_id=conn.session_id, namespace_id=ns_id, keys=keys)).slots[0]
    assert slot.state == pb.SLOT_STATE_RESERVED
    assert conn.release([slot.handle]) == 1


# -- the session socket --------------------------------------------------------------------------


def _session_exchange(sock: socket.socket, payload: bytes, fds=()) -> tuple[pb.SessionReply, list[int]]:
    socket.send_fds(sock, [payload], list(fds))
    data, got, _, _ = socket.recv_fds(sock, 1 << 16, 4)
    return pb.SessionReply.FromString(data), got


def test_session_socket_rejects_bad_messages_and_keeps_serving(shared_daemon, shm_dir):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(str(shared_daemon.session_socket))
        # Garbage instead of a protobuf message.
        reply, fds = _session_exchange(sock, b"\xff\xff\xff\xff")
        assert reply.WhichOneof("kind") == "error" and reply.error.code == "INVALID_ARGUMENT"
        # AttachRegion before Hello.
        attach = pb.SessionRequest(attach_region=pb.AttachRegion(name="early")).SerializeToString()
        reply, _ = _session_exchange(sock, attach)
        assert reply.error.code == "FAILED_PRECONDITION"
        # Hello works on the same connection afterwards and hands over the pool.
        hello = pb.SessionRequest(hello=pb.Hello(client_name="probe")).SerializeToString()
        reply, fds = _session_exchange(sock, hello)
        assert reply.WhichOneof("kind") == "welcome" and len(fds) == 1
        assert reply.welcome.pool_bytes == 64 << 20
        os.close(fds[0])
        # A second Hello is refused.
        reply, _ = _session_exchange(sock, hello)
        assert reply.error.code == "FAILED_PRECONDITION"
        # AttachRegion without an fd, or with a file that is not usable.
        reply, _ = _session_exchange(sock, attach)
        assert reply.error.code == "INVALID_ARGUMENT" and "one fd" in reply.error.message
        # ... or with more fds than a packet is read with (the kernel drops the rest).
        with open(os.devnull) as null:
            reply, _ = _session_exchange(sock, attach, [null.fileno()] * 6)
        assert reply.error.code == "INVALID_ARGUMENT"
        assert reply.error.message == "AttachRegion needs exactly one fd, got more than 4"
        empty = make_file(shm_dir, 0)
        fd = os.open(empty, os.O_RDWR)
        try:
            reply, _ = _session_exchange(sock, attach, [fd])
        finally:
            os.close(fd)
        assert reply.error.code == "INVALID_ARGUMENT" and "empty" in reply.error.message
        # An fd the daemon cannot map read-write: the message says what the fd must be.
        good = make_file(shm_dir, CHUNK, "good")
        for flags, said in (
            (os.O_RDONLY, "must be opened read-write (O_RDWR)"),
            (os.O_WRONLY, "must be opened read-write (O_RDWR)"),
            (os.O_PATH, "not open for reading and writing"),
        ):
            fd = os.open(good, flags)
            try:
                reply, _ = _session_exchange(sock, attach, [fd])
            finally:
                os.close(fd)
            assert reply.error.code == "INVALID_ARGUMENT" and said in reply.error.message, reply.error.message
            assert "malformed" not in reply.error.message
        fd = os.open(good, os.O_RDWR)
        try:
            reply, _ = _session_exchange(sock, attach, [fd])
        finally:
            os.close(fd)
        assert reply.WhichOneof("kind") == "region_attached" and reply.region_attached.size == CHUNK


# -- a misbehaving client must not take the daemon down ------------------------------------------


def test_region_truncated_after_registration_does_not_crash_the_daemon(daemon, ns_name, shm_dir):
    """A client shrinks its region file after registering it. The daemon maps regions, so copying
    from (or to) the now-missing pages raises SIGBUS; that must fail the request, not kill the
    daemon that every other client on the node depends on."""
    chunk = 256 << 10
    keys = make_keys(ns_name, 3)
    data = payloads(keys, chunk)
    path = make_file(shm_dir, 4 * chunk)
    with daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=chunk)
        assert c.store(ns, keys[:1], data[:1]).stored == 1  # data that must survive
        region = c.register_region(path)
        os.truncate(path, 0)  # the region's pages are gone now
        with pytest.raises(client_errors.RegionShrunk, match=f"shrank from {4 * chunk} to 0 bytes"):
            c.store_from_region(ns, region, keys[1:2], [chunk])
        assert daemon.running, f"kvstored died (exit {daemon.proc.poll()}):\n{daemon.log}"
        with pytest.raises(client_errors.RegionShrunk, match="register it again"):
            c.load_to_region(ns, region, keys[:1], [chunk])
        assert daemon.running, f"kvstored died (exit {daemon.proc.poll()}):\n{daemon.log}"
        # Registered again at its new size, the file works.
        os.truncate(path, 2 * chunk)
        again = c.register_region(path)
        assert again.size == 2 * chunk
        assert c.load_to_region(ns, again, keys[:1], [chunk]) == 1
    with daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=chunk)
        out = np.zeros_like(data[:1])
        assert c.load(ns, keys[:1], out) == 1
        np.testing.assert_array_equal(out, data[:1])
        assert c.lookup(ns, keys[1:2]).prefix_hits == 0  # nothing half-copied was published


def test_region_shrinking_while_a_copy_runs_does_not_crash_the_daemon(daemon_factory, ns_name, shm_dir):
    """Checking the region's size before a copy is not enough: another process of the client can
    shrink the file while the daemon's copy thread is reading or writing the mapping (SIGBUS).
    A separate process keeps cutting the file to 0 bytes and growing it back while large region
    transfers run; every request may fail or succeed, but the daemon must survive."""
    d = daemon_factory(cpu_bytes="64MiB")
    chunk, n = 4 << 20, 8
    size = n * chunk
    path = make_file(shm_dir, size)
    flip = (
        "import os, sys, time\n"
        "path, size = sys.argv[1], int(sys.argv[2])\n"
        "print('flipping', flush=True)\n"
        "while True:\n"
        "    time.sleep(0.002)\n"
        "    os.truncate(path, 0)\n"
        "    os.truncate(path, size)\n"
    )
    with d.client(deadline_s=2.0) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=chunk)
        region = c.register_region(path)  # registered at full size, before the flipping starts
        assert region.size == size
        offsets = [i * chunk for i in range(n)]
        flipper = subprocess.Popen(
            [sys.executable, "-c", flip, str(path), str(size)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert flipper.stdout.readline().strip() == "flipping"
            for i in range(20):
                keys = make_keys(f"{ns_name}/{i}", n)
                for call in (
                    lambda keys=keys: c.store_from_region(ns, region, keys, offsets),
                    lambda keys=keys: c.load_to_region(ns, region, keys, offsets),
                ):
                    try:
                        call()
                    except client_errors.KvstoredError:
                        pass  # refusing is fine
                    assert d.running, f"kvstored died (exit {d.proc.poll()}) in round {i}:\n{d.log}"
        finally:
            flipper.kill()
            flipper.communicate()
    # Still serving (the transfers above churned the whole pool, so check with fresh data).
    with d.client() as c:
        ns = c.register_namespace(model=ns_name + "/after", dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys(ns_name + "/after", 2)
        data = payloads(keys, CHUNK)
        assert c.store(ns, keys, data).stored == 2
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == 2
        np.testing.assert_array_equal(out, data)


def test_clients_cannot_resize_the_pool(daemon):
    """Every client gets the pool's memfd read-write; shrinking it would make the daemon's next
    copy SIGBUS. The fd must refuse any size change."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(str(daemon.session_socket))
        hello = pb.SessionRequest(hello=pb.Hello(client_name="resizer")).SerializeToString()
        reply, fds = _session_exchange(sock, hello)
        assert len(fds) == 1
        pool_fd = fds[0]
        try:
            size = os.fstat(pool_fd).st_size
            assert size == reply.welcome.pool_bytes
            for new_size in (0, size // 2, size * 2):
                with pytest.raises(PermissionError):
                    os.ftruncate(pool_fd, new_size)
            assert os.fstat(pool_fd).st_size == size
        finally:
            os.close(pool_fd)
    with daemon.client() as c:
        ns = c.register_namespace(model="test/resize", dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys("resize", 4)
        data = payloads(keys, CHUNK)
        assert c.store(ns, keys, data).stored == 4
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == 4
        np.testing.assert_array_equal(out, data)
