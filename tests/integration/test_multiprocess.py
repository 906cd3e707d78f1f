# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Several client processes on one daemon, and a client killed while it holds leases."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from kvstored_client import StoreResult, Tier
from tests.support import worker
from tests.support.data import make_keys, payloads
from tests.support.wait import wait_for

CHUNK = 256 << 10
PAGE = 64 << 10


def test_one_process_stores_another_loads_while_both_connected(shared_daemon, ns_name):
    n = 12
    writer = worker.spawn("store", shared_daemon.socket, ns_name, CHUNK, "handoff", n, "--wait")
    try:
        assert worker.read_result(writer) == {"stored": n, "already_present": 0, "dropped": 0}
        reader = worker.spawn("verify", shared_daemon.socket, ns_name, CHUNK, "handoff", n)
        assert worker.read_result(reader) == {"loaded": n, "mismatched": []}
        worker.finish(reader)
        assert shared_daemon.stats().sessions >= 1  # the writer's session is still open
    finally:
        worker.finish(writer)


@pytest.mark.parametrize("ahead", [False, True], ids=["reserve-per-call", "slots-ahead"])
def test_two_processes_store_concurrently(shared_daemon, ns_name, ahead):
    """Disjoint and overlapping keys from two processes at once: every key ends up stored exactly
    once, and each process reads back the other's bytes. Reserving per call, the two results
    count each key once; through slots reserved ahead, a key both stored at the same instant
    counts as stored in both (their Commits are posted, not awaited: docs/client.md)."""
    n = 24
    flags = [] if ahead else ["--no-store-ahead"]
    # a stores keys 0..23 of "both", b stores keys 12..35: 12 keys overlap.
    a = worker.spawn("store", shared_daemon.socket, ns_name, CHUNK, "both", n, "--batch", "4", *flags)
    b = worker.spawn(
        "store", shared_daemon.socket, ns_name, CHUNK, "both", n, "--start", str(n // 2), "--batch", "4", *flags
    )
    ra, rb = worker.read_result(a), worker.read_result(b)
    worker.finish(a)
    worker.finish(b)
    distinct = n + n // 2
    if ahead:
        assert distinct <= ra["stored"] + rb["stored"] <= 2 * n, (ra, rb)
    else:
        assert ra["stored"] + rb["stored"] == distinct, (ra, rb)
    for r in (ra, rb):
        assert r["stored"] + r["already_present"] + r["dropped"] == n

    # Whatever a writer dropped (another writer in progress) was stored by the other one.
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys("both", distinct)
        assert c.lookup(ns, keys).tiers == [Tier.RAM] * distinct
        out = np.zeros((distinct, CHUNK), np.uint8)
        assert c.load(ns, keys, out) == distinct
        np.testing.assert_array_equal(out, payloads(keys, CHUNK))

    # Cross-check from two processes at once.
    va = worker.spawn("verify", shared_daemon.socket, ns_name, CHUNK, "both", distinct)
    vb = worker.spawn("verify", shared_daemon.socket, ns_name, CHUNK, "both", distinct, "--batch", "5")
    for v in (va, vb):
        assert worker.read_result(v) == {"loaded": distinct, "mismatched": []}
        worker.finish(v)


def test_killed_client_leases_and_reservations_are_freed(daemon_factory, ns_name):
    """A client leases the whole pool but one page, reserves that page, and is SIGKILLed: the
    daemon must give everything back, so the pool is usable again."""
    d = daemon_factory(cpu_bytes="1MiB")  # 16 pages
    held = 15
    proc = worker.spawn("hold", d.socket, ns_name, PAGE, "held", held, "--reserve", "1")
    try:
        info = worker.read_result(proc)
        assert info["stored"] == held
        assert len(info["leases"]) == held and len(info["reserved"]) == 1
        s = d.stats()
        assert (s.sessions, s.leases, s.reservations) == (1, held, 1)
        assert s.tiers[0].used_bytes == s.tiers[0].capacity_bytes
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdin.close()
        proc.stdout.close()
        proc.stderr.close()

    assert wait_for(lambda: d.stats().sessions == 0), d.stats()
    s = d.stats()
    assert (s.leases, s.reservations) == (0, 0)
    assert s.tiers[0].used_bytes == held * PAGE  # the leased chunks stay cached; the reservation is gone
    assert s.tiers[0].chunks == held

    with d.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=PAGE)
        # The killed client's chunks are intact and readable.
        held_keys = make_keys("held", held)
        out = np.zeros((held, PAGE), np.uint8)
        assert c.load(ns, held_keys, out) == held
        np.testing.assert_array_equal(out, payloads(held_keys, PAGE))
        # Its reserved (never committed) key is free to store, not "in progress" forever.
        rkey = make_keys("held/reserved", 1)
        assert c.store(ns, rkey, payloads(rkey, PAGE)) == StoreResult(stored=1)
        # And the formerly leased space can be reused: a full pool of new chunks fits.
        fresh = make_keys(ns_name + "/fresh", 16)
        data = payloads(fresh, PAGE)
        assert c.store(ns, fresh, data) == StoreResult(stored=16)
        out = np.zeros((16, PAGE), np.uint8)
        assert c.load(ns, fresh, out) == 16
        np.testing.assert_array_equal(out, data)
