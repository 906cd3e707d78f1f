# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The client degrades instead of failing when the daemon is away, and recovers by itself when a
new daemon comes up on the same socket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvstored_client import AsyncClient, Client, LookupResult, StoreResult, Tier, Unavailable
from kvstored_client.keys import namespace_id_for
from tests.support.daemon import short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.wait import wait_for

CHUNK = 64 << 10


@pytest.fixture
def region_path():
    d = short_tmpdir("kvreg")
    path = d / "region"
    with open(path, "wb") as fh:
        fh.truncate(4 * CHUNK)
    yield path
    path.unlink()
    d.rmdir()


def check_degraded(c: Client, region_path, model: str) -> None:
    ns = c.register_namespace(model=model, dtype="uint8", chunk_bytes=CHUNK)
    assert ns.namespace_id == namespace_id_for(model, "uint8", CHUNK, "")  # computed locally
    keys = make_keys(model, 3)
    assert c.lookup(ns, keys) == LookupResult.miss(3)
    assert c.store(ns, keys, payloads(keys, CHUNK)) == StoreResult(dropped=3)
    out = np.full((3, CHUNK), 7, np.uint8)
    assert c.load(ns, keys, out) == 0
    assert (out == 7).all()  # untouched
    region = c.register_region(region_path)
    assert region.size == 4 * CHUNK
    assert c.store_from_region(ns, region, keys[:1], [0]) == StoreResult(dropped=1)
    assert c.load_to_region(ns, region, keys[:1], [0]) == 0
    with pytest.raises(Unavailable):
        c.stats()
    with pytest.raises(Unavailable):
        c.delete(ns, keys)


def test_no_daemon_at_all(region_path):
    sock = short_tmpdir() / "nobody.sock"
    with Client(sock, deadline_s=2.0) as c:
        check_degraded(c, region_path, "test/no-daemon")
        check_degraded(c, region_path, "test/no-daemon")  # and again: still no exception
    sock.parent.rmdir()


async def test_async_client_without_daemon(region_path):
    sock = short_tmpdir() / "nobody.sock"
    async with AsyncClient(sock, deadline_s=2.0) as c:
        ns = await c.register_namespace(model="test/async-down", dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys("async-down", 2)
        assert await c.lookup(ns, keys) == LookupResult.miss(2)
        assert await c.store(ns, keys, payloads(keys, CHUNK)) == StoreResult(dropped=2)
        assert await c.load(ns, keys, np.zeros((2, CHUNK), np.uint8)) == 0
        region = await c.register_region(region_path)
        assert await c.load_to_region(ns, region, keys, [0, CHUNK]) == 0
        with pytest.raises(Unavailable):
            await c.stats()
    sock.parent.rmdir()


def test_daemon_going_away_mid_life(daemon, region_path, ns_name):
    """A client that worked degrades (no exception) once its daemon is gone."""
    c = daemon.client(deadline_s=2.0)
    try:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys(ns_name, 2)
        assert c.store(ns, keys, payloads(keys, CHUNK)).stored == 2
        daemon.stop()
        check_degraded(c, region_path, ns_name)
    finally:
        c.close()


def test_client_reconnects_to_a_restarted_daemon(daemon, region_path, ns_name):
    """The same Client object survives two daemon restarts on its socket: one while it was idle
    (it still holds the old daemon's session), one while it kept calling (it saw the daemon down)."""
    keys = make_keys(ns_name, 4)
    data = payloads(keys, CHUNK)
    with daemon.client(deadline_s=5.0) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        region = c.register_region(region_path)
        assert c.store(ns, keys[:2], data[:2]).stored == 2

        offsets = [i * CHUNK for i in range(4)]

        # Restart 1, quiet: a new process on the same socket, empty, no sessions, no namespaces.
        daemon.stop()
        daemon.start()
        # The first calls just work: new session, namespace registered again.
        assert c.lookup(ns, keys) == LookupResult.miss(4)
        assert c.store(ns, keys, data) == StoreResult(stored=4)
        assert c.lookup(ns, keys).tiers == [Tier.RAM] * 4
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == 4
        np.testing.assert_array_equal(out, data)
        # The region registered before the restart is attached again by itself.
        assert c.load_to_region(ns, region, keys, [i * CHUNK for i in range(4)]) == 4
        with open(region_path, "rb") as fh:
            assert fh.read() == data.tobytes()
        assert daemon.stats().sessions == 1

        # Restart 2, with calls while the daemon is down: the client has seen it gone (its gRPC
        # channel is in reconnect backoff), and the first call afterwards needs a session.
        daemon.stop()
        assert c.lookup(ns, keys).prefix_hits == 0
        assert c.store(ns, keys, data).dropped == 4
        daemon.start()
        assert c.store_from_region(ns, region, keys, offsets) == StoreResult(stored=4)
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == 4
        np.testing.assert_array_equal(out, data)
        assert daemon.stats().sessions == 1


async def test_async_client_reconnects(daemon, ns_name):
    keys = make_keys(ns_name, 2)
    data = payloads(keys, CHUNK)
    async with daemon.async_client(deadline_s=5.0) as c:
        ns = await c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert (await c.store(ns, keys, data)).stored == 2
        daemon.stop()
        daemon.start()
        assert (await c.store(ns, keys, data)).stored == 2
        out = np.zeros_like(data)
        assert await c.load(ns, keys, out) == 2
        np.testing.assert_array_equal(out, data)


def test_forked_child_gets_its_own_session(shared_daemon, ns_name):
    """A client used across fork(): the child must not share the parent's session."""
    keys = make_keys(ns_name, 2)
    data = payloads(keys, CHUNK)
    with shared_daemon.client(deadline_s=5.0) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert c.store(ns, keys[:1], data[:1]).stored == 1
        pid = os.fork()
        if pid == 0:  # child: store the second key, verify the first, exit with a verdict
            code = 1
            signal.alarm(60)  # a hung child fails the test instead of hanging the suite
            try:
                ok = c.store(ns, keys[1:], data[1:]).stored == 1
                out = np.zeros_like(data[:1])
                ok = ok and c.load(ns, keys[:1], out) == 1 and np.array_equal(out, data[:1])
                code = 0 if ok else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == 2  # the parent's session still works
        np.testing.assert_array_equal(out, data)


async def test_cancelled_async_calls_leak_no_reservations_or_leases(daemon, ns_name):
    """A task cancelled while the daemon's answer is on its way back must not leave handles it
    never learned of: the client gives up its session, which frees them."""
    import asyncio
    import random

    rng = random.Random(7)
    async with daemon.async_client() as c:
        ns = await c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        for i in range(60):
            keys = make_keys(f"{ns_name}-{i}", 4)
            task = asyncio.ensure_future(c.store(ns, keys, payloads(keys, CHUNK)))
            await asyncio.sleep(rng.uniform(0, 0.003))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            out = np.zeros((4, CHUNK), np.uint8)
            task = asyncio.ensure_future(c.load(ns, keys, out))
            await asyncio.sleep(rng.uniform(0, 0.003))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        stats = daemon.stats()
        assert stats.reservations == 0 and stats.leases == 0
        keys = make_keys(f"{ns_name}-after", 4)
        assert (await c.store(ns, keys, payloads(keys, CHUNK))).stored == 4  # and it still works


def test_a_refused_region_is_forgotten_and_the_client_keeps_working(daemon, ns_name, tmp_path):
    from kvstored_client.errors import InvalidArgument

    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    keys = make_keys(ns_name, 2)
    with daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        with pytest.raises(InvalidArgument, match="empty"):
            c.register_region(empty)
        assert c.store(ns, keys, payloads(keys, CHUNK)).stored == 2
        assert c.load(ns, keys, np.zeros((2, CHUNK), np.uint8)) == 2


FORK_SCRIPT = """
import os, sys, time
from kvstored_client import Client
from tests.support.data import make_keys, payloads

socket, model, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
keys = make_keys(model, 2)
with Client(socket) as c:
    ns = c.register_namespace(model=model, dtype="uint8", chunk_bytes=chunk)
    assert c.store(ns, keys, payloads(keys, chunk)).stored == 2
    with c._lock:  # as if another thread were in the middle of a call at fork time
        pid = os.fork()
        if pid == 0:
            ok = False
            try:
                ok = c.lookup(ns, keys).prefix_hits == 2
            finally:
                os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        sys.exit("the forked child hung on the lock its parent's thread held")
    print("child", os.waitstatus_to_exitcode(done[1]), "parent hits", c.lookup(ns, keys).prefix_hits)
"""


def test_a_child_forked_while_another_thread_holds_the_client_works(daemon, ns_name):
    """In a fresh interpreter: gRPC objects other tests left in this one (their threads inside
    gRPC at fork time make gRPC skip its fork handlers) are not the client's to mend."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, str(daemon.socket), ns_name, str(CHUNK)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["child", "0", "parent", "hits", "2"], out.stderr


async def test_async_client_copies_large_batches_off_its_loop_and_waits_for_them_when_cancelled(
    daemon, ns_name, monkeypatch
):
    """A large store copies in a thread (the event loop keeps serving); a task cancelled during
    that copy ends only after the copy did (its slots are given back right after), and leaves no
    reservation behind."""
    import asyncio
    import threading

    from kvstored_client.buffers import ChunkCopier

    copying, release = threading.Event(), threading.Event()
    seen: list[tuple[int, bool]] = []
    real_copy = ChunkCopier.copy

    def gated_copy(self, session, pairs, to_pool):
        seen.append((threading.get_ident(), to_pool))
        if len(seen) == 1:
            copying.set()
            release.wait(10)
        real_copy(self, session, pairs, to_pool)
        seen.append((threading.get_ident(), None))  # finished

    monkeypatch.setattr(ChunkCopier, "copy", gated_copy)
    chunk = 4 << 20  # 4 chunks = 16 MiB: copied off the loop
    keys = make_keys(ns_name, 4)
    async with daemon.async_client(deadline_s=10.0) as c:
        ns = await c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=chunk)
        task = asyncio.ensure_future(c.store(ns, keys, payloads(keys, chunk)))
        await asyncio.to_thread(copying.wait, 10)
        assert seen[0][0] != threading.get_ident()  # not on the loop's thread
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done(), "the cancelled store returned while its copy was still running"
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen[-1][1] is None  # the copy had finished
        stats = daemon.stats()
        assert stats.reservations == 0 and stats.leases == 0

        data = payloads(keys, chunk)
        assert (await c.store(ns, keys, data)).stored == 4
        out = np.zeros_like(data)
        assert await c.load(ns, keys, out) == 4
        np.testing.assert_array_equal(out, data)


def test_an_interrupt_inside_the_plan_itself_leaks_no_reservation(daemon, ns_name, monkeypatch):
    """KeyboardInterrupt landing in the op's own code (between Reserve's answer and the copy)
    must not leave the reservations held by a session that stays open."""
    import types

    from kvstored_client import ops
    from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

    class InterruptOn(types.ModuleType):
        def __getattr__(self, name):
            if name == "SLOT_STATE_ALREADY_PRESENT":  # read by ops.store right after Reserve
                raise KeyboardInterrupt
            return getattr(pb, name)

    keys = make_keys(ns_name, 4)
    with daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        monkeypatch.setattr(ops, "pb", InterruptOn("pb"))
        with pytest.raises(KeyboardInterrupt):
            c.store(ns, keys, payloads(keys, CHUNK))
        monkeypatch.setattr(ops, "pb", pb)
        assert wait_for(lambda: daemon.stats().reservations == 0)
        assert c.store(ns, keys, payloads(keys, CHUNK)).stored == 4


def test_a_missed_deadline_keeps_a_healthy_session(daemon, ns_name):
    keys = make_keys(ns_name, 2)
    with daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert c.store(ns, keys, payloads(keys, CHUNK)).stored == 2
        opened = daemon.stats().sessions
        c.deadline_s = 1e-9  # every call misses its deadline before it is sent
        assert c.lookup(ns, keys) == LookupResult.miss(2)
        assert c.store(ns, keys, payloads(keys, CHUNK)).dropped == 2
        assert daemon.stats().sessions == opened  # not dropped (and re-populated) for a slow call
        c.deadline_s = 10.0
        assert c.load(ns, keys, np.zeros((2, CHUNK), np.uint8)) == 2


def test_a_region_refused_after_a_restart_fails_only_its_own_calls(daemon, ns_name, tmp_path):
    from kvstored_client.errors import InvalidArgument

    path = tmp_path / "region"
    path.write_bytes(bytes(4 * CHUNK))
    keys = make_keys(ns_name, 2)
    with daemon.client(deadline_s=5.0) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        region = c.register_region(path)
        daemon.stop()
        path.write_bytes(b"")  # the file is emptied while the daemon is away
        daemon.start()
        with pytest.raises(InvalidArgument, match="register it again"):  # the first call after it
            c.load_to_region(ns, region, keys, [0, CHUNK])
        assert c.store(ns, keys, payloads(keys, CHUNK)).stored == 2  # other calls work
        with pytest.raises(InvalidArgument, match="register it again"):
            c.store_from_region(ns, region, keys, [0, CHUNK])
        assert c.load(ns, keys, np.zeros((2, CHUNK), np.uint8)) == 2


def test_a_listener_that_never_accepts_does_not_hang_calls(tmp_path, ns_name):
    """gRPC fails fast on a socket whose backlog is full; the client's is-anyone-listening probe
    must not then block forever in connect()."""
    import socket
    import threading

    from kvstored_client import Client

    path = tmp_path / "s.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    queued = []
    for _ in range(4):  # fill the backlog: further connects would block
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(str(path))
        except (BlockingIOError, OSError):
            pass
        queued.append(s)
    results = []

    def calls():
        with Client(path, deadline_s=0.3) as c:
            ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
            for _ in range(3):
                results.append(c.lookup(ns, make_keys(ns_name, 1)))

    worker = threading.Thread(target=calls, daemon=True)
    worker.start()
    worker.join(60)  # a hang guard, not a timing assertion
    try:
        assert not worker.is_alive(), "a call hung on a socket that never accepts"
        assert results == [LookupResult.miss(1)] * 3
    finally:
        for s in queued:
            s.close()
        listener.close()


def test_load_to_region_never_writes_the_region_after_reporting_nothing_loaded(daemon_factory, ns_name, tmp_path):
    """A region load that misses its deadline either loaded (and says so) or copied nothing: the
    daemon starts a copy only within the deadline and the client waits for a started one."""
    daemon = daemon_factory(cpu_bytes="192MiB")
    chunk = 2 << 20
    n = 64  # 128 MiB
    path = tmp_path / "region"
    path.write_bytes(bytes(n * chunk))
    keys = make_keys(ns_name, n)
    data = payloads(keys, chunk)
    with daemon.client(deadline_s=10.0) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=chunk)
        region = c.register_region(path)
        assert c.store(ns, keys, data).stored == n
        offsets = [i * chunk for i in range(n)]
        for deadline in (1e-4, 1e-3, 5e-3, 2e-2):  # shorter than the copy: it may start, then outlast it
            c.deadline_s = deadline
            loaded = c.load_to_region(ns, region, keys, offsets)
            c.deadline_s = 10.0
            mm = np.memmap(path, dtype=np.uint8, mode="r+")
            if loaded:
                assert np.array_equal(mm[: loaded * chunk].reshape(loaded, chunk), data[:loaded])
            mm[:] = 0xAB  # the caller reuses its region
            mm.flush()
            assert c.lookup(ns, keys[:1]).prefix_hits == 1  # a round trip: a late copy would be under way
            time.sleep(0.2)
            assert (np.memmap(path, dtype=np.uint8, mode="r") == 0xAB).all(), f"overwritten (deadline {deadline})"
            del mm


def test_ctrl_c_during_a_region_transfer_waits_for_the_daemons_answer(daemon, ns_name, tmp_path):
    """Once a region transfer is sent the daemon may be copying into the region: a
    KeyboardInterrupt is raised only after the daemon has answered."""
    import threading

    path = tmp_path / "region"
    path.write_bytes(bytes(2 * CHUNK))
    keys = make_keys(ns_name, 2)
    with daemon.client(deadline_s=5.0) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        region = c.register_region(path)
        assert c.store(ns, keys, payloads(keys, CHUNK)).stored == 2
        resumed = threading.Event()
        previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))

        def resume_later():
            time.sleep(0.5)
            resumed.set()  # set before SIGCONT: no answer can come before it
            os.kill(daemon.pid, signal.SIGCONT)

        os.kill(daemon.pid, signal.SIGSTOP)
        threading.Thread(target=resume_later, daemon=True).start()
        signal.setitimer(signal.ITIMER_REAL, 0.2)  # Ctrl-C while the daemon cannot answer
        try:
            with pytest.raises(KeyboardInterrupt):
                c.load_to_region(ns, region, keys, [0, CHUNK])
            assert resumed.is_set(), "the interrupt was raised before the daemon answered"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            os.kill(daemon.pid, signal.SIGCONT)
