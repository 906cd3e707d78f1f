# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Held pages (kvstored/server/held_writes.py): the slots of a session a hand-over ended stay out
of use until its client is done with them, exits, or HOLD_MAX_S passes; they travel in the
hand-over state; and a client closes a session only once its copies into it have ended."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from kvstored.namespaces import Namespace
from kvstored.server import handover
from kvstored.server.held_writes import HeldRecord, HeldWrites, leases_as_pages, pid_namespace, unique_pages
from kvstored.shm.allocator import PageRun
from kvstored.tiers.ram import EntryState, HeldPages, Placement, QuotaScope, RamTier, ReserveOutcome
from kvstored_client.errors import Unavailable
from kvstored_client.session import CopyGate

PAGE = 4096


def reserved(tier: RamTier, n: int, unkeyed: bool = False) -> list:
    entries = []
    for i in range(n):
        r = tier.reserve_unkeyed("ns", PAGE) if unkeyed else tier.reserve(("ns", b"k%d" % i), PAGE)
        assert r.outcome is ReserveOutcome.RESERVED
        entries.append(r.entry)
    return entries


def test_held_pages_stay_used_and_their_keys_free():
    tier = RamTier(4 * PAGE, PAGE)
    keyed, ahead = reserved(tier, 1), reserved(tier, 1, unkeyed=True)
    for entry in keyed + ahead:
        tier.hold(entry)
    assert tier.held_bytes == tier.used_bytes == 2 * PAGE and tier.unkeyed_bytes == 0
    assert tier.reserve(("ns", b"k0"), PAGE).outcome is ReserveOutcome.RESERVED  # another writer may store it
    assert tier.reserve(("ns", b"x"), PAGE).outcome is ReserveOutcome.RESERVED
    assert tier.reserve(("ns", b"y"), PAGE).outcome is ReserveOutcome.NO_SPACE  # the held pages are not free
    for entry in keyed + ahead:
        tier.free_held(entry)
    assert tier.held_bytes == 0 and tier.used_bytes == 2 * PAGE
    with pytest.raises(ValueError):
        tier.free_held(keyed[0])


async def test_released_by_the_same_process_only():
    tier = RamTier(4 * PAGE, PAGE)
    held = HeldWrites(tier)
    held.hold("s1", os.getpid(), reserved(tier, 2))
    assert held.release(os.getpid() + 1, ["s1"]) == 0 and tier.held_bytes == 2 * PAGE
    assert held.release(os.getpid(), ["unknown", "s1"]) == 1
    assert tier.held_bytes == 0 and held.sessions == 0


async def test_freed_when_the_client_exits():
    tier = RamTier(4 * PAGE, PAGE)
    held = HeldWrites(tier)
    client = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        held.hold("s1", client.pid, reserved(tier, 1))
        await asyncio.sleep(0.1)
        assert tier.held_bytes == PAGE  # (alive: still held)
    finally:
        client.kill()
        client.wait()
    for _ in range(100):
        if tier.held_bytes == 0:
            break
        await asyncio.sleep(0.02)
    assert tier.held_bytes == 0 and held.sessions == 0


async def test_freed_after_the_longest_hold():
    tier = RamTier(4 * PAGE, PAGE)
    held = HeldWrites(tier, max_s=0.05)
    held.hold("s1", 0, reserved(tier, 1))  # (a pid it cannot watch)
    held.hold("s2", os.getpid(), reserved(tier, 1), seconds=10.0)  # (capped by max_s too)
    await asyncio.sleep(0.2)
    assert tier.held_bytes == 0 and held.sessions == 0


async def test_the_hand_over_state_carries_them_to_the_next_tier():
    old = RamTier(8 * PAGE, PAGE)
    held = HeldWrites(old)
    entries = reserved(old, 3)
    held.hold("s1", os.getpid(), entries)
    layout = handover.Layout(8 * PAGE, PAGE, "4k", 0)
    state = handover.PoolState("test", layout, [], {}, old.snapshot(), held.records(), pid_namespace())
    decoded = handover.decode_state(handover.encode_state(state))
    assert decoded.pid_ns == pid_namespace() != 0  # (the pids mean the same processes where it matches)
    [record] = decoded.held
    assert (record.session_id, record.pid) == ("s1", os.getpid()) and 0 < record.seconds_left <= 60
    assert record.pages == tuple(HeldPages.of(e) for e in entries)
    held.close()

    new = RamTier(8 * PAGE, PAGE)
    adopted = new.adopt(decoded.ram, held=list(record.pages))
    assert adopted.chunks == 0 and new.held_bytes == 3 * PAGE
    assert all(e.state is EntryState.HELD for e in adopted.held)
    # Every other page is free; the held ones are not.
    got = [new.reserve(("ns", b"n%d" % i), PAGE) for i in range(6)]
    assert [g.outcome for g in got].count(ReserveOutcome.RESERVED) == 5
    taken = {run.start for g in got if g.entry for run in g.entry.runs}
    assert not taken & {run.start for e in entries for run in e.runs}
    new_held = HeldWrites(new)
    new_held.hold(record.session_id, record.pid, adopted.held, record.seconds_left)
    assert new_held.release(os.getpid(), ["s1"]) == 1 and new.held_bytes == 0


async def test_leased_chunks_go_over_leased_and_are_never_evicted_meanwhile():
    """A hand-over's held leases: the chunks stay READY and readable in the next tier, out of its
    LRU, so that filling it evicts none of them and reuses none of their pages; a release gives
    them back to the LRU."""
    old = RamTier(4 * PAGE, PAGE)
    for i in range(3):
        entry = old.reserve(("ns", b"c%d" % i), PAGE).entry
        assert entry is not None
        old.commit(entry)
    leased = [old.acquire(("ns", b"c%d" % i)) for i in (0, 2)]
    held = HeldWrites(old)
    held.hold("s1", os.getpid(), [], leased=leased)
    layout = handover.Layout(4 * PAGE, PAGE, "4k", 0)
    namespaces = [(Namespace("ns", "m", "uint8", PAGE, "", 32), ())]
    state = handover.PoolState("test", layout, namespaces, {}, old.snapshot(), held.records(), pid_namespace())
    decoded = handover.decode_state(handover.encode_state(state))
    [record] = decoded.held
    assert record.pages == () and record.leased == (("ns", b"c0"), ("ns", b"c2"))
    held.close()

    new = RamTier(4 * PAGE, PAGE)
    assert new.adopt(decoded.ram).chunks == 3
    new_held = HeldWrites(new)
    kept = [e for e in map(new.keep, record.leased) if e is not None]
    new_held.hold(record.session_id, record.pid, [], record.seconds_left, leased=kept)
    assert [e.runs for e in kept] == [e.runs for e in leased] and new.counters.loaded == 0
    assert new.held_bytes == 2 * PAGE  # (what /metrics shows held)
    for i in range(3, 6):  # the pool is full: only c1 may go
        entry = new.reserve(("ns", b"n%d" % i), PAGE).entry
        if entry is not None:
            new.commit(entry)
    assert new.is_ready(("ns", b"c0")) and new.is_ready(("ns", b"c2")) and not new.is_ready(("ns", b"c1"))
    taken = {run.start for e in map(new.acquire, [("ns", b"n3"), ("ns", b"n4")]) if e for run in e.runs}
    assert not taken & {run.start for e in leased for run in e.runs}
    assert new_held.release(os.getpid(), ["s1"]) == 1 and all(e.leases == 0 for e in kept)
    assert new.held_bytes == 0
    assert {("ns", b"c0"), ("ns", b"c2")} <= {e.chunk for e in new.lru_newest_first()}  # (evictable again)


def test_where_the_index_is_refused_leased_chunks_are_held_as_pages():
    """A tier that refused the chunks' index takes their pages as free: a held lease's chunk then
    goes over as held pages, so no new chunk gets them while its reader may still copy."""
    old = RamTier(4 * PAGE, PAGE)
    entry = old.reserve(("ns", b"c"), PAGE).entry
    assert entry is not None
    old.commit(entry)
    leased = old.acquire(("ns", b"c"))
    assert leased is not None
    slot = reserved(old, 1)[0]
    twice = (("ns", b"c"), ("ns", b"c"), ("ns", b"gone"))  # (two requests sharing a prefix: two leases)
    record = HeldRecord("s1", 7, (HeldPages.of(slot),), 30.0, twice)
    other = HeldRecord("s2", 8, (), 10.0, (("ns", b"c"),))  # another session, leasing it too
    as_pages, other_pages = leases_as_pages([record, other], old.snapshot().chunks)
    chunk_pages = HeldPages(0, tuple(leased.runs), "ns")
    assert as_pages.leased == () and (as_pages.session_id, as_pages.pid, as_pages.seconds_left) == ("s1", 7, 30.0)
    assert as_pages.pages == (HeldPages.of(slot), chunk_pages)  # (once; "gone": not in it)
    assert other_pages.pages == (chunk_pages,) and other_pages.leased == ()
    new = RamTier(4 * PAGE, PAGE)
    snapshot = old.snapshot()
    adopted = new.adopt(replace(snapshot, chunks=[]), held=unique_pages([as_pages, other_pages]))
    assert adopted.chunks == 0 and new.held_bytes == 2 * PAGE  # (the slot, and the chunk once)


async def test_a_leased_chunk_deleted_before_the_hand_over_goes_over_as_held_pages():
    """A chunk deleted while leased (Delete, ClearNamespace, a failed check) is in no snapshot,
    but its readers may still read it: its pages go over held, with each session that leased it,
    adopted once, and free only when the last of them is done."""
    old = RamTier(4 * PAGE, PAGE)
    entry = old.reserve(("ns", b"c"), PAGE).entry
    assert entry is not None
    old.commit(entry)
    first, second = old.acquire(("ns", b"c")), old.acquire(("ns", b"c"))
    assert old.delete(("ns", b"c")) and first is second
    held = HeldWrites(old)
    held.hold("short", 0, [], seconds=5.0, leased=[first])
    held.hold("long", 0, [], seconds=30.0, leased=[second])
    assert old.held_bytes == PAGE  # (one chunk, however many held leases)
    records = held.records()
    held.close()
    assert [(r.session_id, r.pages, r.leased) for r in records] == [
        ("short", (HeldPages.of(entry),), ()),
        ("long", (HeldPages.of(entry),), ()),
    ]
    assert old.snapshot().chunks == []  # (held pages are all that carries them)
    new = RamTier(4 * PAGE, PAGE)
    adopted = new.adopt(old.snapshot(), held=unique_pages(records))
    assert new.held_bytes == PAGE and [e.runs for e in adopted.held] == [entry.runs]
    new_held = HeldWrites(new)
    for r in records:  # (as the daemon holds them again)
        new_held.hold(r.session_id, os.getpid(), adopted.held, r.seconds_left)
    assert new_held.release(os.getpid(), ["long"]) == 1 and new.held_bytes == PAGE  # ("short" still reads)
    fresh = new.reserve(("ns", b"n"), PAGE).entry
    assert fresh is not None and fresh.runs != entry.runs
    assert new_held.release(os.getpid(), ["short"]) == 1 and new.held_bytes == 0


async def test_pages_shared_with_an_exited_client_stay_held_for_the_others():
    """Sessions are held again one by one; one whose client has exited is freed, but only once
    the caller has counted the others holding the same pages."""
    tier = RamTier(4 * PAGE, PAGE)
    [shared] = reserved(tier, 1)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    held = HeldWrites(tier)
    held.hold("gone", gone.pid, [shared])
    held.hold("alive", os.getpid(), [shared])
    await asyncio.sleep(0.01)  # (the exited client's session is freed now)
    assert held.sessions == 1 and tier.held_bytes == PAGE and shared.runs
    assert held.release(os.getpid(), ["alive"]) == 1 and tier.held_bytes == 0


def test_the_state_names_shared_pages_once_in_what_older_daemons_read():
    """A daemon that predates "held_shared" takes every page set in "held" as held once: listing
    shared pages under each session there would overlap and cost it the whole RAM index."""
    import msgpack

    slot, shared = HeldPages(0, (PageRun(0, 1),), "ns"), HeldPages(0, (PageRun(1, 1),), "ns")
    records = [
        HeldRecord("s1", 1, (slot, shared), 30.0),
        HeldRecord("s2", 2, (shared, shared), 20.0),  # (named twice within one session too)
    ]
    tier = RamTier(4 * PAGE, PAGE)
    layout = handover.Layout(4 * PAGE, PAGE, "4k", 0)
    frame = handover.encode_state(handover.PoolState("test", layout, [], {}, tier.snapshot(), records))
    body = msgpack.unpackb(frame[handover._FRAME.size :], raw=False)
    older = [(p[0], tuple(p[1])) for h in body["held"] for p in h[3]]  # (as an older daemon flattens them)
    assert len(older) == len(set(older)) == 2
    decoded = handover.decode_state(frame).held
    assert [(h.session_id, h.pages) for h in decoded] == [("s1", (slot, shared)), ("s2", (shared,))]
    assert unique_pages(decoded) == [slot, shared]


def test_a_session_closes_only_after_its_copies_end():
    gate = CopyGate()
    started, finish, closed = threading.Event(), threading.Event(), threading.Event()

    def copy() -> None:
        with gate.copying():
            started.set()
            finish.wait(5)

    def close() -> None:
        gate.close()
        closed.set()

    copier = threading.Thread(target=copy)
    copier.start()
    assert started.wait(5)
    closer = threading.Thread(target=close)
    closer.start()
    time.sleep(0.1)
    assert gate._closed and not closed.is_set()  # close() has begun, and waits: a copy is under way
    finish.set()
    assert closed.wait(5)
    with pytest.raises(Unavailable):  # and no copy starts once it closes
        with gate.copying():
            pass
    copier.join()
    closer.join()


def test_a_close_gives_up_on_a_copy_that_does_not_end():
    gate = CopyGate()
    finish = threading.Event()

    def copy() -> None:
        with gate.copying():
            finish.wait(5)

    copier = threading.Thread(target=copy)
    copier.start()
    time.sleep(0.05)
    assert gate.close(timeout=0.1) is False  # (its session is then not named released)
    finish.set()
    copier.join()


async def test_a_session_held_twice_is_one_hold_and_an_unwatchable_pid_is_timed():
    tier = RamTier(4 * PAGE, PAGE)
    held = HeldWrites(tier, max_s=0.05)
    held.hold("s1", 1 << 40, reserved(tier, 1))  # (no such pid can be watched)
    held.hold("s1", 1 << 40, [r.entry for r in [tier.reserve(("ns", b"again"), PAGE)]])
    assert held.sessions == 1 and tier.held_bytes == 2 * PAGE
    await asyncio.sleep(0.2)
    assert tier.held_bytes == 0 and held.sessions == 0


def test_adopted_held_pages_count_in_their_namespaces_quotas():
    scope = QuotaScope("tenant", 8)
    old, new = RamTier(8 * PAGE, PAGE), RamTier(8 * PAGE, PAGE)
    for tier, sc in ((old, QuotaScope("tenant", 8)), (new, scope)):
        tier.set_placement(lambda ns, sc=sc: Placement(0, (sc,)) if ns == "ns" else Placement())
    entries = reserved(old, 3)
    for entry in entries:
        old.hold(entry)
    adopted = new.adopt(old.snapshot(), held=[HeldPages.of(e) for e in entries])
    assert scope.used_pages == 3  # (the tenant may reserve 5 more pages, not 8)
    for entry in adopted.held:
        new.free_held(entry)
    assert scope.used_pages == 0 and new.used_bytes == 0
