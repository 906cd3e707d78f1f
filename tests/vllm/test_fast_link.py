# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The vLLM integrations' calls on the fast path: the tier's lookups and region copies
(StoreFromRegion/LoadToRegion) and the direct spec's Reserve/Commit/Acquire/Release travel over
the session socket (counted by the daemon), several
in flight at once; deadlines end the session, restarts are survived, oversized requests and the
KVSTORED_FAST_PATH=0 switch go over gRPC."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Iterator

import grpc

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.errors import Unavailable, UnknownSession
from kvstored_client.fast import ENV
from kvstored_client.ops import NamespaceSpec
from kvstored_client.protocol import MAX_PACKET
from kvstored_client.vllm.driver import DaemonLink, FastCall, GrpcCall, LinkState, Outcome, outcome
from tests.integration.test_fast_path import METRICS_PORT_0, calls
from tests.support.data import make_keys
from tests.vllm.harness import SETTLE_LIMIT_S, Engine, exact, kvstored_tier, offload_keys
from tests.vllm.test_direct import HIT, DirectEngine, same_blocks
from tests.vllm.test_tier import store_and_cascade

FAST = ("Lookup", "Reserve", "Commit", "Acquire", "Release")
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
CHUNK = 64 << 10


def wait_done(link: DaemonLink, futures) -> None:
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while not all(f.done() for f in futures):
        link.poll()
        assert time.monotonic() < deadline, "calls never finished"
        time.sleep(0.001)


def settled_link(daemon, name: str) -> tuple[DaemonLink, str]:
    link = DaemonLink(daemon.socket, name)
    spec = NamespaceSpec(model=f"test/{name}", dtype="uint8", chunk_bytes=CHUNK, layout="fast", key_bytes=32)
    ns = link.namespace(spec)
    assert link.settle(SETTLE_LIMIT_S, (ns,))
    return link, ns


def reconnect(link: DaemonLink, ns: str) -> None:
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while not (link.poll() and link.namespace_ready(ns)):
        link.reconnect_soon()
        assert time.monotonic() < deadline, "the link never came back"
        time.sleep(0.01)


def test_the_tiers_lookups_and_copies_are_fast_path_calls(own_daemon, monkeypatch):
    daemon = own_daemon().start(METRICS_PORT_0)
    keys = offload_keys("fast-tier", 3)
    with Engine([kvstored_tier(daemon)]) as engine:
        store_and_cascade(engine, keys)
        engine.evict_primary()
        ctx = engine.request()
        assert engine.lookup(ctx, keys) == [HIT] * 3
        assert exact(engine.load(ctx, keys), keys)
        engine.finish(ctx)
    handled, fast = calls(daemon)
    for method in ("Lookup", "StoreFromRegion", "LoadToRegion"):
        assert fast[method] >= 1, method
        assert handled[method] == fast[method], method  # none over gRPC (the gRPC series counts both)

    monkeypatch.setenv(ENV, "0")  # the switch: the same lookups over gRPC
    with Engine([kvstored_tier(daemon)]) as engine:
        ctx = engine.request()
        engine.lookup(ctx, keys)
        engine.finish(ctx)
    again_handled, again_fast = calls(daemon)
    assert again_fast["Lookup"] == fast["Lookup"]
    assert again_handled["Lookup"] > handled["Lookup"]


@contextlib.contextmanager
def region_link(daemon, name: str) -> Iterator[tuple[DaemonLink, str]]:
    """A link with a region of 8 chunks attached and a namespace registered: (link, namespace id)."""
    with tempfile.TemporaryDirectory(prefix="kvfastlink", dir="/dev/shm") as tmp:
        path = os.path.join(tmp, "region")
        with open(path, "wb") as fh:
            fh.truncate(8 * CHUNK)
        fd = os.open(path, os.O_RDWR)
        link = DaemonLink(daemon.socket, name, region_fd=fd, region_name=name)
        try:
            spec = NamespaceSpec(model=f"test/{name}", dtype="uint8", chunk_bytes=CHUNK, key_bytes=32)
            ns = link.namespace(spec)
            assert link.settle(SETTLE_LIMIT_S, (ns,))
            yield link, ns
        finally:
            link.close()
            os.close(fd)


def test_a_region_copy_waiting_on_the_daemon_holds_up_no_other_call(own_daemon):
    """Region copies have no deadline in the tier: several in flight on one session, each
    matched to its answer, lookups answered meanwhile; a daemon gone mid-copy ends them."""
    daemon = own_daemon().start()
    with region_link(daemon, "fast-region") as (link, ns):
        seen: list[str] = []  # (the benches' per-call latency hook)
        link.observe = lambda method, seconds: seen.append(method)
        keys = make_keys("fast-region", 8)

        def copy(method: str, i: int):
            request = pb.RegionTransferRequest(
                session_id=link.session_id,
                namespace_id=ns,
                region_id=link.region_id,
                keys=keys[i : i + 2],
                offsets=[i * CHUNK, (i + 1) * CHUNK],
            )
            return link.call(method, request)

        stores = [copy("StoreFromRegion", i) for i in range(0, 8, 2)]
        lookup = link.call("Lookup", pb.LookupRequest(session_id=link.session_id, namespace_id=ns, keys=keys))
        assert all(isinstance(f, FastCall) for f in [*stores, lookup])
        wait_done(link, [*stores, lookup])
        assert [outcome(f).response.stored for f in stores] == [2] * 4
        loads = [copy("LoadToRegion", i) for i in range(0, 8, 2)]
        wait_done(link, loads)
        assert [outcome(f).response.loaded for f in loads] == [2] * 4
        assert sorted(seen) == ["LoadToRegion"] * 4 + ["Lookup"] + ["StoreFromRegion"] * 4

        os.kill(daemon.pid, signal.SIGSTOP)  # copies sent and not answered...
        try:
            waiting = copy("LoadToRegion", 0)
            link.poll()
            assert not waiting.done()
        finally:
            daemon.kill()  # ... end when the daemon goes (the session with it)
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while not waiting.done():
            link.poll()
            assert time.monotonic() < deadline, "the copy never ended"
            time.sleep(0.001)
        assert outcome(waiting).code is grpc.StatusCode.UNAVAILABLE


def test_a_region_copy_outlives_its_session_until_the_daemon_lets_go(own_daemon):
    """The link ends a session for its own reasons (an OpenIndex unanswered in time) while a
    region copy is unanswered: the copy stays unfinished (its slots are the daemon's) until the
    daemon has closed the session, which it does once its copies ended; an UNAVAILABLE answer to
    another call, the session socket being fine, ends nothing."""
    daemon = own_daemon().start()
    with region_link(daemon, "fast-linger") as (link, ns):
        epoch = link.epoch
        keys = make_keys("fast-linger", 2)

        def copy(method: str, offset: int) -> FastCall:
            request = pb.RegionTransferRequest(
                session_id=link.session_id,
                namespace_id=ns,
                region_id=link.region_id,
                keys=keys,
                offsets=[offset, offset + CHUNK],
            )
            call = link.call(method, request)
            assert isinstance(call, FastCall)
            return call

        stored = copy("StoreFromRegion", 0)
        wait_done(link, [stored])
        assert outcome(stored).response.stored == 2

        link.on_rpc_error(Outcome(error=Unavailable("RegisterNamespace: UNAVAILABLE"), code=UNAVAILABLE))
        assert link.state is LinkState.READY and link.epoch == epoch  # the session socket is fine

        os.kill(daemon.pid, signal.SIGSTOP)  # the load is sent and cannot be answered
        try:
            load = copy("LoadToRegion", 4 * CHUNK)
            link.fail(Unavailable("kvstored did not answer OpenIndex within 1.0s"))
            assert link.state is LinkState.DOWN
            for _ in range(3):
                link.poll()
                assert not load.done(), "a copy the daemon may be running was ended"
                time.sleep(0.01)
            assert link.closing == 1
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        wait_done(link, [load])  # its answer, or the daemon's end of the session once the copy ended
        result = outcome(load)
        assert result.stale and (result.ok or result.code is UNAVAILABLE), result
        assert link.closing == 0
        reconnect(link, ns)
        assert link.epoch > epoch
        again = copy("LoadToRegion", 6 * CHUNK)
        wait_done(link, [again])
        assert outcome(again).response.loaded == 2  # the new session is not the old one's


def test_the_direct_specs_calls_are_fast_path_calls(own_daemon):
    daemon = own_daemon(cpu_bytes="32MiB").start(METRICS_PORT_0)
    keys = offload_keys("fast-direct", 2)
    with DirectEngine(daemon, seed=21) as writer, DirectEngine(daemon, seed=22) as reader:
        ctx = writer.request()
        assert writer.store(ctx, keys, list(range(8))) == keys
        ctx = reader.request()
        assert reader.lookup(ctx, keys) == [HIT, HIT]
        reader.load(ctx, keys, list(range(8, 16)))
        assert same_blocks(writer, list(range(8)), reader, list(range(8, 16)))
        reader.manager.on_request_finished(ctx)
        reader.settle()
    handled, fast = calls(daemon)
    for method in ("Reserve", "Commit", "Acquire", "Release"):  # (its lookups are Acquires)
        assert fast[method] >= 1, method
        assert handled[method] == fast[method], method  # none over gRPC


def test_calls_in_flight_end_with_a_restart_and_the_link_comes_back_fast(own_daemon):
    daemon = own_daemon().start()
    link, ns = settled_link(daemon, "fast-restart")
    keys = make_keys("fast-restart", 8)
    futures = [
        link.call("Lookup", pb.LookupRequest(session_id=link.session_id, namespace_id=ns, keys=keys[i : i + 1]))
        for i in range(8)
    ]
    assert all(isinstance(f, FastCall) for f in futures)
    wait_done(link, futures)  # several in flight, each matched to its own answer
    assert [outcome(f).response.prefix_hits for f in futures] == [0] * 8

    reserve = pb.ReserveRequest(session_id=link.session_id, namespace_id=ns, keys=keys)
    held = link.call("Reserve", reserve)
    daemon.kill()  # mid-job: answered or not, the session is gone
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while link.state is LinkState.READY:
        link.poll()
        assert time.monotonic() < deadline, "the link never noticed the daemon died"
        time.sleep(0.001)
    assert held.done()
    assert outcome(held).ok or outcome(held).code is grpc.StatusCode.UNAVAILABLE
    daemon.start()
    reconnect(link, ns)
    sent = link.counters.fast_calls
    again = link.call("Reserve", pb.ReserveRequest(session_id=link.session_id, namespace_id=ns, keys=keys))
    wait_done(link, [again])
    assert link.counters.fast_calls == sent + 1
    result = outcome(again)
    assert result.ok, result.error
    assert [s.state for s in result.response.slots] == [pb.SLOT_STATE_RESERVED] * 8
    link.close()


def test_a_grpc_call_of_an_earlier_session_failing_now_ends_no_later_one(own_daemon, monkeypatch):
    """A call that went over gRPC in one session and fails once the link is in the next (the
    daemon no longer knows the session it names) is stale: it leaves the new session alone. The
    same answer to a call of the current session ends it."""
    monkeypatch.setenv(ENV, "0")  # (every call over gRPC)
    daemon = own_daemon().start()
    link, ns = settled_link(daemon, "stale-grpc")
    old_session, old_epoch = link.session_id, link.epoch
    request = pb.AcquireRequest(session_id=old_session, namespace_id=ns, keys=make_keys("stale-grpc", 1))
    link.fail(Unavailable("a reset, for the test"), backoff=False)
    # Answered before the next session is open: stale too (the link is not polled meanwhile).
    during = GrpcCall(link, link._get_stub().Acquire.future(request, timeout=SETTLE_LIMIT_S), old_epoch)
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while not during.done():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    failures, result = link.counters.failures, outcome(during)
    assert isinstance(result.error, UnknownSession) and result.stale
    link.on_rpc_error(result)
    assert link.counters.failures == failures  # (no second failure: no longer backoff)
    reconnect(link, ns)
    new_epoch = link.epoch
    assert new_epoch != old_epoch and link.session_id != old_session
    late = GrpcCall(link, link._get_stub().Acquire.future(request, timeout=SETTLE_LIMIT_S), old_epoch)
    wait_done(link, [late])
    result = outcome(late)
    assert isinstance(result.error, UnknownSession) and result.stale
    link.on_rpc_error(result)
    assert link.ready and link.epoch == new_epoch  # the new session stands
    current = link.call("Acquire", request)
    assert isinstance(current, GrpcCall)
    wait_done(link, [current])
    result = outcome(current)
    assert isinstance(result.error, UnknownSession) and not result.stale
    link.on_rpc_error(result)
    assert not link.ready
    link.close()


def test_a_late_lookup_ends_alone_and_a_late_grant_ends_the_session(own_daemon):
    daemon = own_daemon().start()
    link, ns = settled_link(daemon, "fast-deadline")
    epoch = link.epoch
    keys = make_keys("fast-deadline", 2)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        request = pb.LookupRequest(session_id=link.session_id, namespace_id=ns, keys=keys)
        late = link.call("Lookup", request, timeout=0.2)
        wait_done(link, [late])
        assert outcome(late).code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert link.state is LinkState.READY  # a Lookup grants nothing: the session stays
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    # The late answer comes and is dropped; the next call gets its own answer.
    reserve = link.call("Reserve", pb.ReserveRequest(session_id=link.session_id, namespace_id=ns, keys=keys))
    wait_done(link, [reserve])
    assert [s.state for s in outcome(reserve).response.slots] == [pb.SLOT_STATE_RESERVED] * 2
    assert link.epoch == epoch

    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        request = pb.AcquireRequest(session_id=link.session_id, namespace_id=ns, keys=keys)
        grant = link.call("Acquire", request, timeout=0.2)
        wait_done(link, [grant])
        assert outcome(grant).code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert link.state is LinkState.DOWN  # its leases may still come: the session is not reused
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    reconnect(link, ns)
    assert link.epoch == epoch + 1
    link.close()


def test_oversized_requests_and_the_switch_go_over_grpc(own_daemon, monkeypatch):
    daemon = own_daemon().start()
    link, ns = settled_link(daemon, "fast-large")
    many = make_keys("fast-large", 3000)
    request = pb.LookupRequest(session_id=link.session_id, namespace_id=ns, keys=many)
    assert len(request.SerializeToString()) > MAX_PACKET
    call = link.call("Lookup", request, timeout=10)
    assert not isinstance(call, FastCall)
    assert outcome(call).response.prefix_hits == 0
    link.close()

    monkeypatch.setenv(ENV, "0")
    off, ns = settled_link(daemon, "fast-off")
    call = off.call("Lookup", pb.LookupRequest(session_id=off.session_id, namespace_id=ns, keys=many[:1]), timeout=10)
    assert not isinstance(call, FastCall)
    assert outcome(call).ok
    off.close()
