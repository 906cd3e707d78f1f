# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Clients killed (SIGKILL) while they hold leases and reservations, with half-written chunks in
their reserved slots, while another client keeps loading and verifying its own chunks.

The daemon must give back everything they held (Stats: 0 leases, 0 reservations), publish none
of their uncommitted bytes, keep their committed chunks intact, and the pool they pinned must be
usable again in full. The bystander never sees a wrong byte.
"""

from __future__ import annotations

import signal

import numpy as np

from tests.support import worker
from tests.support.data import make_keys, payloads
from tests.support.loader import VerifyingLoader
from tests.support.wait import wait_for

CHUNK = 64 << 10  # one page
POOL_CHUNKS = 128  # an 8 MiB pool
VICTIMS, HELD, RESERVED = 2, 24, 24
BYSTANDER = 32  # 32 + 2 x (24 + 24) = the whole pool pinned or in use
# (Its clients hold no slots reserved ahead, which would take pool pages of their own:
# test_store_ahead.py shows those freed with a killed client.)


def test_clients_killed_holding_leases_and_reservations_give_everything_back(daemon_factory, ns_name):
    d = daemon_factory(cpu_bytes="8MiB")
    bystander = make_keys(f"{ns_name}/bystander", BYSTANDER)
    with d.client(store_ahead=False) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert c.store(ns, bystander, payloads(bystander, CHUNK)).stored == BYSTANDER
    loader = VerifyingLoader(d, ns_name, CHUNK, bystander)
    procs = []
    try:
        for i in range(VICTIMS):
            proc = worker.spawn(
                "hold",
                d.socket,
                ns_name,
                CHUNK,
                f"{ns_name}/victim{i}",
                HELD,
                "--reserve",
                str(RESERVED),
                "--scribble",
                "--no-store-ahead",
            )
            procs.append(proc)
            info = worker.read_result(proc)
            assert (info["stored"], len(info["leases"]), len(info["reserved"])) == (HELD, HELD, RESERVED), info
        held = d.stats()
        assert held.leases >= VICTIMS * HELD and held.reservations == VICTIMS * RESERVED, held
        ram = held.tiers[0]
        assert ram.used_bytes == ram.capacity_bytes  # the whole pool is in use
        loads_before_kill = loader.counts.loads
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        for proc in procs:
            proc.wait(30)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                pipe.close()

    assert wait_for(lambda: d.stats().sessions == 1), d.stats()  # only the bystander's is left
    loads_after_kill = loader.counts.loads
    assert wait_for(lambda: loader.counts.loads > loads_after_kill), "the bystander stopped getting answers"
    counts = loader.stop()
    after = d.stats()
    assert (after.leases, after.reservations) == (0, 0), after
    assert after.tiers[0].used_bytes == (BYSTANDER + VICTIMS * HELD) * CHUNK  # the reservations' pages are free

    with d.client(store_ahead=False) as c:  # (a whole pool of chunks below: no slot of its own ahead)
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        for i in range(VICTIMS):
            # Committed chunks of the killed clients stay, intact; their scribbled reservations were never published.
            kept = make_keys(f"{ns_name}/victim{i}", HELD)
            out = np.zeros((HELD, CHUNK), np.uint8)
            assert c.load(ns, kept, out) == HELD
            np.testing.assert_array_equal(out, payloads(kept, CHUNK))
            assert c.lookup(ns, make_keys(f"{ns_name}/victim{i}/reserved", RESERVED)).prefix_hits == 0
        # Everything the killed clients pinned is usable again: a whole pool of new chunks fits.
        fresh = make_keys(f"{ns_name}/fresh", POOL_CHUNKS)
        stored = sum(
            c.store(ns, fresh[i : i + 16], payloads(fresh[i : i + 16], CHUNK)).stored for i in range(0, POOL_CHUNKS, 16)
        )
        assert stored == POOL_CHUNKS
        out = np.zeros((POOL_CHUNKS, CHUNK), np.uint8)
        assert c.load(ns, fresh, out) == POOL_CHUNKS
        np.testing.assert_array_equal(out, payloads(fresh, CHUNK))
    print(f"bystander: {counts} ({loads_before_kill} loads before the kill)")
    assert counts.wrong_bytes == 0 and counts.short == 0, counts
