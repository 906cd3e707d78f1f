# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Structured fuzzing of every RPC against a real daemon (hypothesis), plus raw random bytes.

Requests are valid-shaped but carry hostile values: empty, NUL-laden and 16 KiB+ strings; ids
nobody registered; keys of every wrong length, duplicated, too many of them; handles never
granted, named twice; offsets and sizes at the int64/uint64 edges. After each call:
- the status is one a client can act on (never UNKNOWN, INTERNAL, UNAVAILABLE...), and every
  error is the daemon's own answer (it carries the error kind; no status made up by gRPC because
  a message overflowed its trailer), with a bounded message;
- every so often, and at the end, the daemon still serves and a canary chunk stored before the
  first call loads byte-exact;
- at the end, the daemon's log holds no traceback and no ERROR line.

Bounded and reproducible: derandomized, a fixed number of examples per RPC (a few thousand calls
in all, well under a minute here); the counts are printed.
"""

from __future__ import annotations

import collections
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstored_client.errors import ERROR_KIND_KEY
from tests.support.bad_input import MAX_DETAILS_BYTES, tracebacks
from tests.support.daemon import Daemon, stop_all
from tests.support.data import make_keys, payloads
from tests.support.rpc import RawConn, pb

CHUNK = 64 << 10
MAX_BATCH = 32
EXAMPLES_PER_RPC = 200
RAW_EXAMPLES_PER_RPC = 60
CANARY_EVERY = 250  # calls between canary checks
TIMEOUT_S = 10.0
WATCH_TIMEOUT_S = 0.05  # a live-only event stream never ends by itself
S = grpc.StatusCode
SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
ALLOWED = {
    S.OK,
    S.INVALID_ARGUMENT,
    S.NOT_FOUND,
    S.FAILED_PRECONDITION,
    S.RESOURCE_EXHAUSTED,
    S.PERMISSION_DENIED,
    S.DEADLINE_EXCEEDED,
    S.OUT_OF_RANGE,
}
FUZZ_SETTINGS = settings(
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.function_scoped_fixture,
    ],
)

# -- hostile values ----------------------------------------------------------------------------

U64_EDGES = [
    0,
    1,
    2,
    CHUNK - 1,
    CHUNK,
    CHUNK + 1,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
]
U32_EDGES = [v for v in U64_EDGES if v < 2**32]
HUGE = 16 * 1024 + 1
STRINGS = [
    "",
    "x",
    "\x00",
    "a\x00b",
    "é" * 40,
    "\u202e\ufeff",
    "x" * HUGE,
    "é" * HUGE,
    "../../etc/passwd",
    " ",
    "%s%n{}",
    "\n\r\t",
]


def u64() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(U64_EDGES), st.integers(0, 2**64 - 1))


def u32() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(U32_EDGES), st.integers(0, 2**32 - 1))


def text() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(STRINGS), st.text(max_size=24))


@dataclass
class Target:
    """The daemon under fuzz and what a request may name in it."""

    daemon: Daemon
    conn: RawConn  # a session of its own: granted handles are released after each call
    namespace_ids: list[str]
    known_keys: list[bytes]
    region_id: int
    region_path: str
    canary: tuple[str, bytes, np.ndarray]  # (namespace id, key, bytes)
    calls: collections.Counter = field(default_factory=collections.Counter)  # (method, status) -> count
    since_canary: int = 0


# Valid values most of the time, so that calls get past the first check to the hostile part.
def mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    return st.sampled_from([valid, valid, valid, valid, hostile]).flatmap(lambda chosen: chosen)


def ids(target: Target) -> st.SearchStrategy[str]:
    return mostly(st.sampled_from(target.namespace_ids), text())


def sessions(target: Target) -> st.SearchStrategy[str]:
    return mostly(st.just(target.conn.session_id), text())


def keys(target: Target) -> st.SearchStrategy[list[bytes]]:
    valid = st.one_of(st.binary(min_size=32, max_size=32), st.sampled_from(target.known_keys))
    hostile = st.sampled_from([b"", b"\x00" * 32, b"k" * 31, b"k" * 33, b"k" * 8, b"k" * 16, b"k" * 64, b"k" * HUGE])
    return st.one_of(
        mostly(st.lists(valid, max_size=8), st.lists(st.one_of(valid, hostile), max_size=8)),
        st.lists(valid, min_size=MAX_BATCH - 1, max_size=MAX_BATCH + 2),
        st.lists(st.sampled_from(target.known_keys[:2]), min_size=2, max_size=6),
    )


def handles() -> st.SearchStrategy[list[int]]:
    return st.one_of(
        st.lists(u64(), max_size=6),
        st.lists(st.just(7), min_size=2, max_size=3),
        st.lists(u64(), min_size=MAX_BATCH + 1, max_size=MAX_BATCH + 2),
    )


def offsets() -> st.SearchStrategy[list[int]]:
    inside = st.sampled_from([0, CHUNK, 2 * CHUNK, 3 * CHUNK])
    return st.lists(st.one_of(inside, u64()), max_size=MAX_BATCH + 2)


@st.composite
def transfers(draw, target: Target) -> pb.RegionTransferRequest:
    """Region transfers: one offset per key (inside the region) unless the offsets are the hostile part."""
    chosen = draw(keys(target))
    inside = st.sampled_from([0, CHUNK, 2 * CHUNK, 3 * CHUNK])
    places = draw(mostly(st.lists(inside, min_size=len(chosen), max_size=len(chosen)), offsets()))
    return pb.RegionTransferRequest(
        session_id=draw(sessions(target)),
        namespace_id=draw(ids(target)),
        region_id=draw(mostly(st.just(target.region_id), u64())),
        keys=chosen,
        offsets=places,
        start_within_ms=draw(mostly(st.sampled_from([0, 2000]), u32())),
    )


def requests(target: Target, method: str) -> st.SearchStrategy:
    """Valid-shaped requests of `method` with hostile values."""
    if method == "RegisterNamespace":
        spec = st.builds(
            pb.NamespaceSpec,
            model=mostly(st.just("fuzz"), text()),
            dtype=mostly(st.just("u8"), text()),
            chunk_bytes=mostly(st.sampled_from([1, CHUNK, 32 << 20]), u64()),
            layout=mostly(st.just(""), text()),
            tenant_salt=mostly(st.just(b""), st.one_of(st.binary(max_size=16), st.just(b"s" * HUGE))),
            key_bytes=mostly(st.sampled_from([0, 8, 32, 64]), u32()),
            block_tokens=u32(),
        )
        return st.builds(pb.RegisterNamespaceRequest, spec=spec, session_id=st.one_of(st.just(""), sessions(target)))
    if method in ("Lookup", "Delete", "Touch"):
        cls = {"Lookup": pb.LookupRequest, "Delete": pb.DeleteRequest, "Touch": pb.TouchRequest}[method]
        return st.builds(
            cls, namespace_id=ids(target), keys=keys(target), session_id=st.one_of(st.just(""), sessions(target))
        )
    if method == "Reserve":  # (with slots reserved ahead: `ahead`)
        return st.builds(
            pb.ReserveRequest,
            session_id=sessions(target),
            namespace_id=ids(target),
            keys=keys(target),
            ahead=mostly(st.sampled_from([0, 4]), u32()),
        )
    if method == "Acquire":
        return st.builds(pb.AcquireRequest, session_id=sessions(target), namespace_id=ids(target), keys=keys(target))
    if method == "Commit":  # of reserved slots, or of slots reserved ahead naming their keys
        return st.builds(
            pb.CommitRequest,
            session_id=sessions(target),
            handles=handles(),
            keys=st.one_of(st.just([]), keys(target)),
            namespace_id=st.one_of(st.just(""), ids(target)),
            ahead=mostly(st.sampled_from([0, 4]), u32()),
        )
    if method == "Release":
        return st.builds(pb.ReleaseRequest, session_id=sessions(target), handles=handles())
    if method == "RegisterRegion":
        paths = st.one_of(
            text(),
            st.sampled_from(
                [
                    target.region_path,
                    "/dev/shm",
                    "/dev/shm/",
                    "/etc/passwd",
                    "/dev/shm/../etc/passwd",
                    "/dev/shm/no-such-file",
                    target.region_path + "\x00",
                    "/proc/self/mem",
                    "relative",
                    "/dev/shm/" + "p" * 300,
                    "/dev/shm/" + "d/" * 3000,
                ]
            ),
        )
        return st.builds(pb.RegisterRegionRequest, session_id=sessions(target), path=paths)
    if method in ("StoreFromRegion", "LoadToRegion"):
        return transfers(target)
    if method == "ClearNamespace":
        return st.builds(
            pb.ClearNamespaceRequest, namespace_id=ids(target), session_id=st.one_of(st.just(""), sessions(target))
        )
    if method == "ListNamespaces":
        return st.builds(pb.ListNamespacesRequest, session_id=st.one_of(st.just(""), sessions(target)))
    if method == "Stats":
        return st.just(pb.StatsRequest())
    if method == "WatchEvents":
        return st.builds(pb.WatchEventsRequest, from_seq=u64())
    raise AssertionError(f"no request strategy for {method}: a new RPC needs one")


# -- running and checking one call ---------------------------------------------------------------


def send(target: Target, method: str, payload: bytes) -> tuple[grpc.StatusCode, str, str, bytes | None]:
    """Send raw request bytes; (code, details, error kind, response bytes)."""
    path = f"/{SERVICE.full_name}/{method}"
    channel = target.conn.channel
    try:
        if SERVICE.methods_by_name[method].server_streaming:
            stream = channel.unary_stream(path)(payload, timeout=WATCH_TIMEOUT_S)
            try:
                next(stream, None)
            finally:
                stream.cancel()
            code = stream.code()
            if code in (S.CANCELLED, None):  # we hung up after the first event: it answered
                return S.OK, "", "", None
            return code, stream.details() or "", _kind(stream.trailing_metadata()), None
        return S.OK, "", "", channel.unary_unary(path)(payload, timeout=TIMEOUT_S)
    except grpc.RpcError as err:
        return err.code(), err.details() or "", _kind(err.trailing_metadata()), None


def _kind(metadata) -> str:
    return dict(metadata or ()).get(ERROR_KIND_KEY, "")


def check(target: Target, method: str, payload: bytes) -> None:
    code, details, kind, response = send(target, method, payload)
    target.calls[(method, code.name)] += 1
    assert code in ALLOWED, (method, code, details[:300], payload[:200])
    assert len(details.encode()) <= MAX_DETAILS_BYTES, (method, code, len(details))
    client_deadline = code is S.DEADLINE_EXCEEDED and method == "WatchEvents" and not kind
    if code is not S.OK and not client_deadline and not (method == "WatchEvents" and code is S.OUT_OF_RANGE):
        assert kind, f"{method}: {code.name} ({details[:200]}) did not come from the daemon"
    if response is not None:
        give_back(target, method, response)
    target.since_canary += 1
    if target.since_canary >= CANARY_EVERY:
        check_canary(target)


def give_back(target: Target, method: str, response: bytes) -> None:
    """Release what a call granted the fuzz session, so the pool does not fill with it."""
    if method == "Reserve":
        held = [s.handle for s in pb.ReserveResponse.FromString(response).slots if s.state == pb.SLOT_STATE_RESERVED]
    elif method == "Acquire":
        held = [lease.handle for lease in pb.AcquireResponse.FromString(response).leases]
    else:
        return
    for i in range(0, len(held), MAX_BATCH):
        target.conn.release(held[i : i + MAX_BATCH])


def check_canary(target: Target) -> None:
    target.since_canary = 0
    assert target.daemon.running, f"the daemon died:\n{target.daemon.log[-3000:]}"
    namespace_id, key, data = target.canary
    leases = target.conn.acquire(namespace_id, [key])
    assert len(leases) == 1, "the canary chunk is gone"
    try:
        assert target.conn.read_extents(leases[0].extents) == data.tobytes(), "the canary chunk changed"
    finally:
        target.conn.release([lease.handle for lease in leases])


# -- the target ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    shm = Path(tempfile.mkdtemp(prefix="kvfuzz", dir="/dev/shm"))
    fs_root = Path(tempfile.mkdtemp(prefix="kvfuzzfs", dir="/tmp"))
    daemon = Daemon(cpu_bytes="32MiB")
    daemon.start(["--max-batch-keys", str(MAX_BATCH), "--tiers", f"kind=fs,root={fs_root},bytes=16MiB"])
    conn = None
    try:
        with daemon.client() as c:  # the canary, and a few chunks for requests to find
            canary_ns = c.register_namespace(model="fuzz/canary", dtype="uint8", chunk_bytes=CHUNK)
            canary = make_keys("fuzz/canary", 1)
            assert c.store(canary_ns, canary, payloads(canary, CHUNK)).stored == 1
            ns = c.register_namespace(model="fuzz", dtype="uint8", chunk_bytes=CHUNK)
            known = make_keys("fuzz/known", 8)
            assert c.store(ns, known, payloads(known, CHUNK)).stored == 8
        conn = RawConn(daemon.socket, client_name="fuzz")
        other = conn.register("fuzz/16", CHUNK, key_bytes=16)
        conn.register("fuzz/canary", CHUNK)
        # The canary stays pinned by a lease of a session of its own (a hostile Reserve may evict anything else).
        pin = RawConn(daemon.socket, client_name="canary-pin")
        assert len(pin.acquire(canary_ns.namespace_id, canary)) == 1
        region_path = shm / "region"
        region_path.write_bytes(bytes(4 * CHUNK))
        region_id = conn.call(
            "RegisterRegion", pb.RegisterRegionRequest(session_id=conn.session_id, path=str(region_path))
        ).region_id
        t = Target(
            daemon,
            conn,
            [ns.namespace_id, other],
            known,
            region_id,
            str(region_path),
            (canary_ns.namespace_id, canary[0], payloads(canary, CHUNK)[0]),
        )
        yield t
        check_canary(t)
        pin.close()
        total = sum(t.calls.values())
        by_status = collections.Counter()
        for (_, status), n in t.calls.items():
            by_status[status] += n
        print(f"\nfuzz: {total} calls over {len(SERVICE.methods)} RPCs; statuses {dict(by_status)}")
        for method in SERVICE.methods:
            print(
                f"  {method.name}: "
                + ", ".join(f"{status} {n}" for (m, status), n in sorted(t.calls.items()) if m == method.name)
            )
        assert tracebacks(daemon.log) == [], tracebacks(daemon.log)[:20]
    finally:
        if conn is not None:
            conn.close()
        errors = stop_all([daemon])
        for p in shm.iterdir():
            p.unlink()
        shm.rmdir()
        os.system(f"rm -rf {fs_root}")  # noqa: S605 - our own temp dir
        assert not errors, errors


@pytest.mark.parametrize("method", [m.name for m in SERVICE.methods])
def test_hostile_values_in_every_rpc(target, method):
    @settings(FUZZ_SETTINGS, max_examples=EXAMPLES_PER_RPC)
    @given(request=requests(target, method))
    def run(request) -> None:
        check(target, method, request.SerializeToString())

    run()


@pytest.mark.parametrize("method", [m.name for m in SERVICE.methods])
def test_raw_random_bytes_as_a_request(target, method):
    @settings(FUZZ_SETTINGS, max_examples=RAW_EXAMPLES_PER_RPC)
    @given(payload=st.one_of(st.binary(max_size=256), st.binary(min_size=1, max_size=8).map(lambda b: b * 512)))
    def run(payload: bytes) -> None:
        check(target, method, payload)

    run()
