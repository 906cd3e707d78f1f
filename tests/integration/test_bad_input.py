# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Hostile input on the wire: bytes that are no request at all, NULs, ids and paths far too long.
Each gets INVALID_ARGUMENT or NOT_FOUND with a short message naming the problem (never UNKNOWN,
INTERNAL, or a message so long the client's gRPC refuses it), the daemon logs no traceback and
at most one line per kind of mistake per interval, and it keeps serving."""

from __future__ import annotations

import re

import grpc
import pytest

from kvstored_client.errors import ERROR_KIND_KEY
from tests.support.bad_input import MAX_DETAILS_BYTES, UNDECODABLE, raw_unary, tracebacks
from tests.support.data import make_keys
from tests.support.rpc import pb, raw, rpc_error

S = grpc.StatusCode
CHUNK = 64 << 10
HUGE = 20 << 10  # past gRPC's 8 KiB metadata limit if echoed whole
KVSTORE = pb.DESCRIPTOR.services_by_name["KVStore"]


def bounded(err: grpc.RpcError) -> str:
    details = err.details() or ""
    assert len(details.encode()) <= MAX_DETAILS_BYTES, (err.code(), len(details))
    return details


@pytest.fixture
def fresh(daemon):
    """A daemon whose log holds only what this test caused."""
    return daemon


def test_undecodable_requests_are_invalid_argument_for_every_method(fresh):
    with grpc.insecure_channel(fresh.target) as channel:
        for method in KVSTORE.methods:
            for payload in UNDECODABLE:
                err = rpc_error(
                    raw_unary(channel, f"/{KVSTORE.full_name}/{method.name}", method.server_streaming), payload
                )
                assert err.code() == S.INVALID_ARGUMENT, (method.name, payload, err.code(), err.details())
                details = bounded(err)
                assert method.input_type.name in details, details
                assert dict(err.trailing_metadata() or ()).get(ERROR_KIND_KEY) == "InvalidRequest"
        # The services beside ours too: health (unary) and reflection (a bidirectional stream).
        err = rpc_error(raw_unary(channel, "/grpc.health.v1.Health/Check", False), b"\xff\xff")
        assert err.code() == S.INVALID_ARGUMENT, err.details()
        reflect = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        err = rpc_error(lambda: list(reflect(iter([b"\xff\xff"]), timeout=10)))
        assert err.code() == S.INVALID_ARGUMENT, err.details()
    assert fresh.stats().sessions == 0
    assert tracebacks(fresh.log) == []


def test_a_flood_of_garbage_logs_a_few_lines_not_one_per_request(fresh):
    requests = 300
    with grpc.insecure_channel(fresh.target) as channel:
        call = raw_unary(channel, f"/{KVSTORE.full_name}/Lookup", False)
        for _ in range(requests):
            assert rpc_error(call, b"\xff\xff\xff").code() == S.INVALID_ARGUMENT
    lines = [line for line in fresh.log.splitlines() if "undecodable" in line]
    assert 1 <= len(lines) <= requests // 10, lines
    assert tracebacks(fresh.log) == []


def test_nul_in_a_region_path_is_invalid_argument(fresh):
    with raw(fresh.socket) as conn:
        for path in ("/dev/shm/a\x00b", "\x00", "/dev/shm/\x00" + "x" * HUGE):
            err = rpc_error(
                conn.call, "RegisterRegion", pb.RegisterRegionRequest(session_id=conn.session_id, path=path)
            )
            assert err.code() == S.INVALID_ARGUMENT, (err.code(), err.details()[:200])
            assert "NUL" in bounded(err)
    assert tracebacks(fresh.log) == []


def test_huge_ids_are_not_found_with_a_short_message(fresh):
    with raw(fresh.socket) as conn:
        ns_id = conn.register("test/huge-ids", CHUNK)
        keys = make_keys("huge", 1)
        for huge in ("s" * HUGE, "é" * HUGE, "\x00" * HUGE):
            cases = [
                (pb.ReserveRequest(session_id=huge, namespace_id=ns_id, keys=keys), "Reserve", "session"),
                (pb.LookupRequest(namespace_id=huge, keys=keys), "Lookup", "namespace"),
                (pb.ClearNamespaceRequest(namespace_id=huge), "ClearNamespace", "namespace"),
                (pb.ListNamespacesRequest(session_id=huge), "ListNamespaces", "session"),
            ]
            for request, method, what in cases:
                err = rpc_error(conn.call, method, request)
                assert err.code() == S.NOT_FOUND, (method, err.code(), err.details()[:200])
                details = bounded(err)
                assert what in details and "..." in details, details
        region = pb.RegionTransferRequest(
            session_id=conn.session_id, namespace_id="n" * HUGE, region_id=1, keys=keys, offsets=[0]
        )
        err = rpc_error(conn.call, "LoadToRegion", region)
        assert err.code() == S.NOT_FOUND and "..." in bounded(err)
    assert tracebacks(fresh.log) == []


def test_huge_region_paths_are_invalid_argument_with_a_short_message(fresh):
    with raw(fresh.socket) as conn:
        for path in ("/dev/shm/" + "p" * HUGE, "/dev/shm/" + "d/" * (HUGE // 2), "/tmp/" + "é" * HUGE):
            err = rpc_error(
                conn.call, "RegisterRegion", pb.RegisterRegionRequest(session_id=conn.session_id, path=path)
            )
            assert err.code() == S.INVALID_ARGUMENT, (err.code(), err.details()[:200])
            assert re.search(r"\d+ bytes", bounded(err)), err.details()
    assert tracebacks(fresh.log) == []


@pytest.mark.parametrize("field", ["model", "dtype", "layout", "tenant_salt"])
def test_namespace_names_past_their_limit_are_invalid_argument(fresh, field):
    spec = {"model": "m", "dtype": "u8", "chunk_bytes": CHUNK, field: ("x" if field != "tenant_salt" else b"x") * HUGE}
    with raw(fresh.socket) as conn:
        before = conn.stats().namespaces
        request = pb.RegisterNamespaceRequest(spec=pb.NamespaceSpec(**spec), session_id=conn.session_id)
        err = rpc_error(conn.call, "RegisterNamespace", request)
        assert err.code() == S.INVALID_ARGUMENT, err.details()[:200]
        assert field in bounded(err)
        assert conn.stats().namespaces == before


def test_health_watch_streams_through_the_interceptors(fresh):
    """The interceptors wrap every handler: the health service's Watch, which writes its stream
    itself instead of yielding it, must come through them as it is."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(fresh.target) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
    assert tracebacks(fresh.log) == []


def test_a_touch_standing_for_impossible_lookups_is_invalid_argument(fresh):
    """A Touch names the lookups its keys answered; one naming 2**64 - 1 twice used to push the
    RAM counters past uint64, and every Stats after it failed with INTERNAL."""
    keys = make_keys("touch", 2)
    with fresh.client() as kv, raw(fresh.socket) as conn:
        ns = kv.register_namespace(model="test/touch", dtype="uint8", chunk_bytes=CHUNK)
        assert kv.store(ns, keys, [bytes(CHUNK)] * 2).stored == 2
        before = conn.stats().tiers[0]
        for lookups in ((1 << 64) - 1, (1 << 20) + 1, 1):
            request = pb.TouchRequest(namespace_id=ns.namespace_id, keys=keys, lookups=lookups)
            err = rpc_error(conn.call, "Touch", request)
            assert err.code() == S.INVALID_ARGUMENT, (lookups, err.code(), err.details())
            assert f"lookups={lookups}" in bounded(err)
        after = conn.stats().tiers[0]  # Stats still answers, and nothing was counted
        assert (after.lookups, after.hits) == (before.lookups, before.hits)
        assert conn.call("Touch", pb.TouchRequest(namespace_id=ns.namespace_id, keys=keys, lookups=5)).hits == 2
        after = conn.stats().tiers[0]
        assert (after.lookups - before.lookups, after.hits - before.hits) == (5, 5)
    assert tracebacks(fresh.log) == []


def test_namespaces_past_max_namespaces_are_resource_exhausted(daemon_factory):
    d = daemon_factory(["--max-namespaces", "3"])
    with raw(d.socket) as conn:
        ids = [conn.register(f"test/many-{i}", CHUNK) for i in range(3)]
        request = pb.RegisterNamespaceRequest(
            spec=pb.NamespaceSpec(model="test/many-3", dtype="uint8", chunk_bytes=CHUNK)
        )
        err = rpc_error(conn.call, "RegisterNamespace", request)
        assert err.code() == S.RESOURCE_EXHAUSTED and "max_namespaces=3" in bounded(err)
        assert conn.register("test/many-0", CHUNK) == ids[0]  # registering a known one again is fine
        assert conn.stats().namespaces == 3
    assert tracebacks(d.log) == []
