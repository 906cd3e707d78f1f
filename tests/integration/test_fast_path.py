# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fast path (Lookup, Reserve, Commit, Acquire, Release, Delete, StoreFromRegion and
LoadToRegion over the session socket) on a real daemon: it carries the clients' data path,
answers and fails exactly as gRPC does, serves only the connection's own session, holds
deadlines, survives restarts, frees what a killed client held (mid-copy too, and around a
posted Commit), and hands what does not fit a packet to gRPC."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstored_client import LookupResult, StoreResult, Tier
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.errors import KvstoredError, from_rpc_error
from kvstored_client.fast import ENV, fast_path_default
from kvstored_client.protocol import MAX_PACKET
from tests.support.data import make_keys, payloads
from tests.support.rpc import raw
from tests.support.wait import wait_for

CHUNK = 64 << 10
METRICS_PORT_0 = ["--metrics-addr", "127.0.0.1:0"]
FAST = ("Lookup", "Reserve", "Commit", "Acquire", "Release")
REGION = ("StoreFromRegion", "LoadToRegion")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvfast", dir="/dev/shm") as d:
        yield Path(d)


def region_file(directory: Path, data: np.ndarray, name: str = "region") -> Path:
    path = directory / name
    path.write_bytes(data.tobytes())
    return path


def calls(daemon) -> tuple[Counter, Counter]:
    """(KVStore calls by method in the gRPC series, fast-path calls by method), code OK."""
    port = next(line for line in daemon.log.splitlines() if "metrics on http://" in line).rsplit(":", 1)[1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port.split('/')[0]}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    handled: Counter[str] = Counter()
    fast: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("code") != "OK":
                continue
            if s.name == "kvstored_grpc_server_handled_total" and s.labels["service"] == "kvstored.v1.KVStore":
                handled[s.labels["method"]] += int(s.value)
            elif s.name == "kvstored_session_calls_total":
                fast[s.labels["method"]] += int(s.value)
    return handled, fast


def test_the_data_path_goes_over_the_session_socket_and_is_counted(daemon_factory, ns_name):
    d = daemon_factory(METRICS_PORT_0)
    keys = make_keys(ns_name, 4)
    data = payloads(keys, CHUNK)
    with d.client(fast_path=True) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert c.store(ns, keys, data) == StoreResult(stored=4)
        c.stats()  # (reads the posted Commit's answer: the daemon has published the chunks)
        assert c.lookup(ns, keys).tiers == [Tier.RAM] * 4  # RAM holds all: the key index answers
        assert c.lookup(ns, keys + [b"?" * 32]).tiers == [Tier.RAM] * 4 + [Tier.NONE]  # the daemon answers
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == 4
        np.testing.assert_array_equal(out, data)
        c.stats()  # (a gRPC call: the key index's hits are posted, and counted, first)
        handled, fast = calls(d)
        assert {m: fast[m] for m in (*FAST, "Touch")} == dict.fromkeys((*FAST, "Touch"), 1)
        assert {m: handled[m] for m in (*FAST, "Touch")} == dict.fromkeys((*FAST, "Touch"), 1)  # the gRPC series too

        # A lookup too large for one packet goes over gRPC, with the same answer.
        many = keys + make_keys(f"{ns_name}/absent", 3000)
        assert len(pb.LookupRequest(namespace_id=ns.namespace_id, keys=many).SerializeToString()) > MAX_PACKET
        assert c.lookup(ns, many) == LookupResult(4, [Tier.RAM] * 4 + [Tier.NONE] * 3000)
        handled, fast = calls(d)
        assert (handled["Lookup"], fast["Lookup"]) == (2, 1)

    with d.client(fast_path=False) as c:  # the switch: everything over gRPC
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert c.lookup(ns, keys).prefix_hits == 4
        assert c.load(ns, keys, np.zeros_like(data)) == 4
        handled, fast = calls(d)
        assert {m: fast[m] for m in FAST} == {"Lookup": 1, "Reserve": 1, "Commit": 1, "Acquire": 1, "Release": 1}
        assert (handled["Lookup"], handled["Acquire"], handled["Release"]) == (3, 2, 2)


@pytest.mark.parametrize("transport", ["fast", "gRPC"])
def test_region_copies_take_the_transport_asked_for_with_the_same_results(daemon_factory, ns_name, shm_dir, transport):
    d = daemon_factory(METRICS_PORT_0)
    keys = make_keys(ns_name, 4)
    data = payloads(keys, CHUNK)
    source = region_file(shm_dir, data, "source")
    target = region_file(shm_dir, np.zeros_like(data), "target")
    offsets = [i * CHUNK for i in range(4)]
    with d.client(fast_path=transport == "fast") as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        src, dst = c.register_region(source), c.register_region(target)
        assert c.store_from_region(ns, src, keys[:2], offsets[:2]) == StoreResult(stored=2)
        again = c.store_from_region(ns, src, keys, offsets)
        assert (again.stored, again.already_present, again.present_in[:2]) == (2, 2, (Tier.RAM, Tier.RAM))
        assert c.load_to_region(ns, dst, keys, offsets) == 4
        assert c.load_to_region(ns, dst, make_keys(f"{ns_name}/absent", 2), offsets[:2]) == 0
        np.testing.assert_array_equal(np.fromfile(target, np.uint8).reshape(data.shape), data)
        handled, fast = calls(d)
    over_fast = 2 if transport == "fast" else 0
    assert {m: fast[m] for m in REGION} == dict.fromkeys(REGION, over_fast)
    assert {m: handled[m] for m in REGION} == dict.fromkeys(REGION, 2)  # the gRPC series counts both


def _failure(fn) -> KvstoredError:
    try:
        result = fn()
    except KvstoredError as exc:
        return exc
    raise AssertionError(f"expected an error, got {result!r}")


def test_both_transports_give_the_same_answers_and_the_same_errors(daemon_factory, ns_name, shm_dir):
    d = daemon_factory(["--max-batch-keys", "8"])
    with raw(d.socket) as conn:
        assert conn.session is not None and conn.session.fast is not None
        ns_id = conn.register(ns_name, CHUNK, key_bytes=32)
        keys = make_keys(ns_name, 2)
        sid = conn.session_id
        path = region_file(shm_dir, payloads(keys, CHUNK))
        region = conn.call("RegisterRegion", pb.RegisterRegionRequest(session_id=sid, path=str(path))).region_id

        def copy(keys=keys, offsets=(0, CHUNK), region=region, namespace=ns_id) -> pb.RegionTransferRequest:
            return pb.RegionTransferRequest(
                session_id=sid, namespace_id=namespace, region_id=region, keys=keys, offsets=offsets
            )

        requests = {
            "a load of nothing stored": ("LoadToRegion", copy()),
            "a lookup": ("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=keys, session_id=sid)),
            "an unknown namespace": ("Lookup", pb.LookupRequest(namespace_id="nope", keys=keys, session_id=sid)),
            "a short key": ("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=[b"short"], session_id=sid)),
            "a bad load_into": ("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=keys, load_into=77)),
            "too many keys": ("Acquire", pb.AcquireRequest(namespace_id=ns_id, keys=keys * 5, session_id=sid)),
            "an unknown handle": ("Release", pb.ReleaseRequest(handles=[12345], session_id=sid)),
            "a handle twice": ("Commit", pb.CommitRequest(handles=[7, 7], session_id=sid)),
            "nothing reserved": ("Acquire", pb.AcquireRequest(namespace_id=ns_id, keys=keys, session_id=sid)),
            "a store": ("StoreFromRegion", copy()),  # (before the loop, over gRPC: both see them present)
            "a load": ("LoadToRegion", copy()),
            "an unknown region": ("LoadToRegion", copy(region=region + 99)),
            "an unknown region to store from": ("StoreFromRegion", copy(region=region + 99)),
            "keys without offsets": ("StoreFromRegion", copy(offsets=[0])),
            "an offset outside the region": ("LoadToRegion", copy(offsets=[0, 2 * CHUNK])),
            "a region copy of a short key": ("StoreFromRegion", copy(keys=[b"short"], offsets=[0])),
            "a region copy of too many keys": ("LoadToRegion", copy(keys=keys * 5, offsets=[0] * 10)),
            "a region copy in an unknown namespace": ("LoadToRegion", copy(namespace="nope")),
        }
        for what, (method, request) in requests.items():
            if what == "a store":
                assert conn.call(method, request).stored == 2
            try:
                expected = ("answer", conn.call(method, request))
            except Exception as exc:  # noqa: BLE001 - a grpc.RpcError
                error = from_rpc_error(exc)
                expected = ("error", (type(error), str(error)))
            try:
                got = ("answer", conn.session.fast.call(method, request, 10.0))
            except KvstoredError as exc:
                got = ("error", (type(exc), str(exc)))
            assert got == expected, what
        assert conn.stats().leases == conn.stats().reservations == 0


def test_a_fast_call_serves_only_the_connections_own_session(daemon, ns_name):
    """Over gRPC a session id is a bearer secret; on the session socket the connection is the
    session: naming another session's id there reads nothing of that session's tenant."""
    keys = make_keys(ns_name, 2)
    with daemon.client() as owner, raw(daemon.socket) as other:
        ns = owner.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK, tenant_salt=b"secret")
        assert owner.store(ns, keys, payloads(keys, CHUNK)).stored == 2
        assert owner._session is not None and other.session is not None and other.session.fast is not None
        owners = owner._session.session_id
        lookup = pb.LookupRequest(namespace_id=ns.namespace_id, keys=keys, session_id=owners)
        assert other.call("Lookup", lookup).prefix_hits == 2  # gRPC believes the id it is given
        assert other.session.fast.call("Lookup", lookup, 10.0).prefix_hits == 0
        acquire = pb.AcquireRequest(namespace_id=ns.namespace_id, keys=keys, session_id=owners)
        assert list(other.session.fast.call("Acquire", acquire, 10.0).leases) == []
        assert owner.lookup(ns, keys).prefix_hits == 2


def test_the_first_call_after_a_restart_works(daemon, ns_name):
    keys = make_keys(ns_name, 2)
    data = payloads(keys, CHUNK)
    with daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert c.store(ns, keys[:1], data[:1]).stored == 1
        daemon.stop()
        daemon.start()
        # The old session's socket is closed: seen as a restart, set up again, sent once more.
        assert c.store(ns, keys, data) == StoreResult(stored=2)
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == 2
        np.testing.assert_array_equal(out, data)
        assert daemon.stats().sessions == 1


def test_a_stopped_daemon_costs_a_deadline_then_a_new_session(daemon, ns_name):
    keys = make_keys(ns_name, 2)
    data = payloads(keys, CHUNK)
    with daemon.client(deadline_s=0.5) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert c.store(ns, keys, data).stored == 2
        c.stats()  # (reads the posted Commit's answer: the daemon has published the chunks)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            assert c.lookup(ns, keys).prefix_hits == 2  # RAM holds them: the key index answers, asking nothing
            absent = make_keys(f"{ns_name}/absent", 1)
            assert c.lookup(ns, keys + absent) == LookupResult.miss(3)  # the daemon's to answer: no answer, a miss
            assert c.load(ns, keys, np.zeros_like(data)) == 0
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        c.deadline_s = 10.0
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == 2  # late answers went with the old session
        np.testing.assert_array_equal(out, data)
        assert wait_for(lambda: daemon.stats().sessions == 1 and daemon.stats().leases == 0), daemon.stats()


@pytest.mark.parametrize("call", ["store", "lookup"])
def test_mapping_a_namespaces_key_index_keeps_the_calls_deadline(daemon, ns_name, call, caplog):
    """A store or a lookup of a namespace whose key index the session has not mapped yet asks
    the daemon for it first; with the daemon not answering, that exchange ends within the call's
    one deadline (not the session socket's 5 s bound on settling, nor a second deadline for
    asking the daemon after the index), the call degrades (a dropped store, a miss) and the
    session goes; the daemon is slow, not reported unreachable."""
    deadline_s = 1.0
    keys = make_keys(ns_name, 2)
    later = make_keys(f"{ns_name}/later", 2)
    data = payloads(keys, CHUNK)
    with daemon.client(deadline_s=deadline_s) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert c.store(ns, keys, data) == StoreResult(stored=2)
        other = c.register_namespace(model=f"{ns_name}/later", dtype="uint8", chunk_bytes=CHUNK)
        session = c._session
        assert session is not None and not session.index_tried(other.namespace_id)
        c.stats()  # (the posted Commit's answer read: nothing is owed when the daemon stops)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            if call == "store":
                assert c.store(other, later, payloads(later, CHUNK)).stored == 0
            else:
                assert c.lookup(other, later) == LookupResult.miss(2)
            took = time.monotonic() - started
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert took < 1.8 * deadline_s, f"the {call} took {took:.1f} s with a {deadline_s} s deadline"
        assert c._session is not session  # (its answer may still come: never used again)
        assert not [r for r in caplog.records if "unreachable" in r.getMessage()]
        c.deadline_s = 10.0
        assert c.store(other, later, payloads(later, CHUNK)) == StoreResult(stored=2)  # a new session


HOLDER = textwrap.dedent(
    """
    import sys, time
    from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
    from kvstored_client.session import PoolSession
    session = PoolSession.open(sys.argv[1], "holder", 10.0)
    keys = [bytes.fromhex(k) for k in sys.argv[3:]]
    leases = session.fast.call("Acquire", pb.AcquireRequest(namespace_id=sys.argv[2], keys=keys), 10.0).leases
    print(len(leases), flush=True)
    time.sleep(600)
    """
)


def test_a_killed_client_gives_back_its_fast_path_leases(daemon, ns_name):
    keys = make_keys(ns_name, 3)
    with daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert c.store(ns, keys, payloads(keys, CHUNK)).stored == 3
    argv = [sys.executable, "-c", HOLDER, str(daemon.socket), ns.namespace_id, *(k.hex() for k in keys)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "3"
            assert daemon.stats().leases == 3
        finally:
            holder.kill()
    assert wait_for(lambda: daemon.stats().leases == 0 and daemon.stats().sessions == 0), daemon.stats()


COPIER = textwrap.dedent(
    """
    import sys
    from kvstored_client import Client
    from tests.support.data import make_keys
    method, socket_path, ns_name, chunk, n, path = sys.argv[1:7]
    chunk, n = int(chunk), int(n)
    with Client(socket_path, deadline_s=60.0, fast_path=True) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=chunk)
        region = c.register_region(path)
        print("ready", flush=True)
        sys.stdin.readline()
        result = getattr(c, method)(ns, region, make_keys(ns_name, n), [i * chunk for i in range(n)])
        print("answered", result, flush=True)
    """
)
COPY_CHUNK = 1 << 20
COPY_N = 128  # a 128 MiB batch: the copy takes some ms, much longer than a kill takes to land


def _kill_when_changed(view: np.ndarray, pid: int) -> threading.Thread:
    """Kills `pid` as soon as `view` (the copy's first destination bytes) changes."""
    initial = view.copy()

    def watch() -> None:
        while np.array_equal(view, initial):
            os.sched_yield()
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("method", ["load_to_region", "store_from_region"])
def test_a_client_killed_mid_copy_gives_back_what_it_held(daemon_factory, ns_name, shm_dir, method):
    """Killed while the daemon copies its fast-path region transfer: the daemon ends the session
    and gives back the copy's leases and reservations, and keeps serving right bytes."""
    keys = make_keys(ns_name, COPY_N)
    data = payloads(keys, COPY_CHUNK)
    loading = method == "load_to_region"
    for attempt in range(4):  # until the kill lands before the answer (bounded)
        d = daemon_factory(cpu_bytes="160MiB")
        path = region_file(shm_dir, np.zeros_like(data) if loading else data, f"region-{attempt}")
        with raw(d.socket) as conn:
            assert conn.session is not None and conn.session.pool is not None
            if loading:
                with d.client() as c:
                    ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=COPY_CHUNK)
                    assert c.store(ns, keys, data).stored == COPY_N
            # A load's first bytes land in the region; a store's at the start of a fresh pool.
            view = np.memmap(path, dtype=np.uint8, mode="r")[:8] if loading else conn.session.pool[:8]
            argv = [
                sys.executable,
                "-c",
                COPIER,
                method,
                str(d.socket),
                ns_name,
                str(COPY_CHUNK),
                str(COPY_N),
                str(path),
            ]
            with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as copier:
                assert copier.stdin is not None and copier.stdout is not None
                assert copier.stdout.readline().strip() == "ready"
                watcher = _kill_when_changed(view, copier.pid)
                copier.stdin.write("go\n")
                copier.stdin.flush()
                watcher.join(60)
                assert not watcher.is_alive(), "the copy never began"
                answered = copier.stdout.read()
            del view
        assert wait_for(lambda d=d: (d.stats().sessions, d.stats().leases, d.stats().reservations) == (0, 0, 0)), (
            d.stats()
        )
        with d.client() as c:  # it keeps serving: whatever it holds reads back right
            ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=COPY_CHUNK)
            out = np.zeros_like(data)
            loaded = c.load(ns, keys, out)
            assert loaded == (COPY_N if loading else loaded)
            np.testing.assert_array_equal(out[:loaded], data[:loaded])
        path.unlink()
        if "answered" not in answered:
            return
    raise AssertionError(f"no kill landed before the answer in 4 attempts (last: {answered!r})")


def _exchange(sock: socket.socket, request: pb.SessionRequest | bytes) -> pb.SessionReply:
    sock.send(request if isinstance(request, bytes) else request.SerializeToString())
    data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
    for fd in fds:
        os.close(fd)
    return pb.SessionReply.FromString(data)


def test_session_socket_refuses_fast_calls_before_hello_and_oversized_packets(daemon, ns_name):
    lookup = pb.SessionRequest(lookup=pb.LookupRequest(namespace_id="x", keys=[b"k" * 32]))
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(str(daemon.session_socket))
        assert _exchange(s, lookup).error.code == "FAILED_PRECONDITION"  # no session yet
        welcome = _exchange(s, pb.SessionRequest(hello=pb.Hello(client_name="probe")))
        assert welcome.welcome.fast_path
        reply = _exchange(s, lookup)
        assert (reply.error.code, reply.error.kind) == ("NOT_FOUND", "UnknownNamespace")
        # Cut to the daemon's packet size, it could parse as a shorter request: refused whole.
        big = pb.SessionRequest(lookup=pb.LookupRequest(namespace_id="x", keys=[b"k" * 32] * 3000))
        reply = _exchange(s, big)
        assert reply.error.code == "INVALID_ARGUMENT" and "exceeds" in reply.error.message
        assert _exchange(s, lookup).error.kind == "UnknownNamespace"  # the session still serves


@pytest.mark.parametrize(("value", "expected"), [("", True), ("1", True), ("on", True), ("0", False), ("off", False)])
def test_the_environment_switch(monkeypatch, value, expected):
    monkeypatch.setenv(ENV, value)
    assert fast_path_default() is expected


def test_a_bad_switch_value_is_named(monkeypatch):
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(ValueError, match=f"{ENV}='maybe'"):
        fast_path_default()


async def test_the_async_client_takes_the_fast_path_too(daemon_factory, ns_name, shm_dir):
    d = daemon_factory(METRICS_PORT_0)
    keys = make_keys(ns_name, 3)
    data = payloads(keys, CHUNK)
    async with d.async_client(fast_path=True) as c:
        ns = await c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert await c.store(ns, keys, data) == StoreResult(stored=3)
        assert (await c.lookup(ns, keys)).tiers == [Tier.RAM] * 3
        out = np.zeros_like(data)
        assert await c.load(ns, keys, out) == 3
        np.testing.assert_array_equal(out, data)
        target = region_file(shm_dir, np.zeros_like(data))
        region = await c.register_region(target)
        offsets = [i * CHUNK for i in range(3)]
        assert await c.load_to_region(ns, region, keys, offsets) == 3
        assert (await c.store_from_region(ns, region, keys, offsets)).already_present == 3
        np.testing.assert_array_equal(np.fromfile(target, np.uint8).reshape(data.shape), data)
        _, fast = calls(d)
        assert {m: fast[m] for m in FAST + REGION} == dict.fromkeys(FAST + REGION, 1)
        with pytest.raises(KvstoredError, match="not held"):  # a daemon error comes through, mapped
            session = c._session
            assert session is not None and session.fast is not None
            await session.fast.call_async("Release", pb.ReleaseRequest(handles=[5]), 10.0)
        # Cancelled while the daemon cannot answer: the session goes, with whatever it held.
        os.kill(d.pid, signal.SIGSTOP)
        try:
            task = asyncio.create_task(c.load(ns, keys, out))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            os.kill(d.pid, signal.SIGCONT)
        assert await c.load(ns, keys, out) == 3  # a new session
        np.testing.assert_array_equal(out, data)
    assert wait_for(lambda: d.stats().sessions == 0 and d.stats().leases == 0), d.stats()


def test_posted_commits_and_releases_are_done_before_the_clients_next_call(daemon_factory, ns_name):
    """A store's Commit and a load's Release are posted (their answers read with the next call's):
    whatever the client does next, over either transport, finds them done."""
    d = daemon_factory(METRICS_PORT_0)
    keys = make_keys(ns_name, 2)
    data = payloads(keys, CHUNK)
    with d.client(fast_path=True) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        for _ in range(3):
            assert c.store(ns, keys, data) == StoreResult(stored=2)
            assert c.lookup(ns, keys).tiers == [Tier.RAM] * 2  # the fast path, behind the Commit
            assert c.delete(ns, keys) == 2  # the fast path too (fast_delete)
        assert c.store(ns, keys, data) == StoreResult(stored=2)
        assert c.stats().reservations == 0  # gRPC: the posted answers are read first
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == 2
        np.testing.assert_array_equal(out, data)
        assert c.stats().leases == 0
        handled, fast = calls(d)
    assert (fast["Commit"], fast["Release"], fast["Delete"]) == (4, 1, 3)
    assert handled["Delete"] == 3  # counted in the gRPC series, as every fast call is


KILLED_AROUND_COMMIT = textwrap.dedent(
    """
    import os, signal, sys
    from kvstored_client import Client
    from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
    from kvstored_client.session import PoolSession
    from tests.support.data import make_keys, payloads
    how, socket_path, ns_name, chunk = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    keys = make_keys(ns_name, 2)
    data = payloads(keys, chunk)
    c = Client(socket_path, deadline_s=30.0, fast_path=True)
    ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=chunk)
    if how == "posted":  # its Commit sent, its answer never read
        assert c.store(ns, keys, data).stored == 2
    else:  # reserved, half of one chunk written, the Commit never sent
        session = PoolSession.open(socket_path, "lost", 30.0)
        request = pb.ReserveRequest(namespace_id=ns.namespace_id, keys=keys)
        slots = session.fast.call("Reserve", request, 30.0).slots
        extent = slots[0].extents[0]
        half = extent.length // 2
        session.pool[extent.offset : extent.offset + half] = data[0][:half]
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("how", ["posted", "lost"])
def test_a_client_killed_around_its_commit_leaks_nothing_and_exposes_no_unwritten_bytes(daemon, ns_name, how):
    """Killed right after a store posted its Commit: the daemon reads the Commit before the
    connection's end, so the chunks are stored, whole. Killed before the Commit left: the
    reservations are aborted and the half-written chunk is never a hit."""
    argv = [sys.executable, "-c", KILLED_AROUND_COMMIT, how, str(daemon.socket), ns_name, str(CHUNK)]
    assert subprocess.run(argv, timeout=60).returncode == -signal.SIGKILL
    assert wait_for(lambda: (daemon.stats().sessions, daemon.stats().reservations, daemon.stats().leases) == (0, 0, 0))
    keys = make_keys(ns_name, 2)
    data = payloads(keys, CHUNK)
    with daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        out = np.zeros_like(data)
        if how == "posted":
            assert c.lookup(ns, keys).tiers == [Tier.RAM] * 2
            assert c.load(ns, keys, out) == 2
            np.testing.assert_array_equal(out, data)
        else:
            assert c.lookup(ns, keys) == LookupResult.miss(2)
            assert c.load(ns, keys, out) == 0
            assert c.store(ns, keys, data) == StoreResult(stored=2)  # the keys are free to store
