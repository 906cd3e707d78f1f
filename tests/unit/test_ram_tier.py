# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""RamTier bookkeeping: LRU order, recency on hits, leases and reservations pin chunks, exact
capacity, delete while leased, IN_PROGRESS for a second writer."""

from __future__ import annotations

import pytest

from kvstored.chain.writeback import WriteBackState
from kvstored.tiers.ram import Placement, QuotaScope, RamTier, ReserveOutcome

PAGE = 4096
NS = "ns"


def cid(name: str) -> tuple[str, bytes]:
    return (NS, name.encode())


def put(tier: RamTier, name: str, size: int = PAGE):
    res = tier.reserve(cid(name), size)
    assert res.outcome is ReserveOutcome.RESERVED and res.entry is not None, (name, res)
    tier.commit(res.entry)
    return res


def present(tier: RamTier, *names: str) -> list[str]:
    return [n for n in names if tier.contains(cid(n), touch=False)]


@pytest.fixture
def tier() -> RamTier:
    return RamTier(4 * PAGE, PAGE)  # room for exactly four one-page chunks


def test_capacity_is_exact(tier):
    assert tier.capacity_bytes == 4 * PAGE
    for name in "abcd":
        assert put(tier, name).evicted == []
    assert tier.used_bytes == tier.capacity_bytes
    assert tier.chunk_count == 4
    assert tier.counters.evictions == 0
    res = put(tier, "e")
    assert res.evicted == [cid("a")]
    assert tier.used_bytes == tier.capacity_bytes
    assert tier.chunk_count == 4


def test_capacity_rounds_down_to_whole_pages():
    tier = RamTier(4 * PAGE + 100, PAGE)
    assert tier.capacity_bytes == 4 * PAGE
    for name in "abcd":
        assert put(tier, name).evicted == []
    assert put(tier, "e").evicted == [cid("a")]


def test_partial_pages_are_charged_as_whole_pages(tier):
    put(tier, "a", PAGE + 1)  # two pages
    assert tier.used_bytes == 2 * PAGE
    put(tier, "b", 2 * PAGE)
    assert tier.used_bytes == 4 * PAGE
    assert put(tier, "c", 1).evicted == [cid("a")]
    assert tier.used_bytes == 3 * PAGE


def test_eviction_follows_insertion_order_without_hits(tier):
    for name in "abcd":
        put(tier, name)
    evicted = []
    for name in "efgh":
        evicted += put(tier, name).evicted
    assert evicted == [cid(n) for n in "abcd"]
    assert present(tier, *"abcdefgh") == list("efgh")
    assert tier.counters.evictions == 4


def test_a_hit_refreshes_recency(tier):
    for name in "abcd":
        put(tier, name)
    assert tier.contains(cid("a"))  # a is now the most recent
    assert put(tier, "e").evicted == [cid("b")]
    assert put(tier, "f").evicted == [cid("c")]
    assert put(tier, "g").evicted == [cid("d")]
    assert put(tier, "h").evicted == [cid("a")]


def test_contains_without_touch_does_not_refresh(tier):
    for name in "abcd":
        put(tier, name)
    assert tier.contains(cid("a"), touch=False)
    assert put(tier, "e").evicted == [cid("a")]


def test_reading_a_chunk_refreshes_recency(tier):
    for name in "abcd":
        put(tier, name)
    entry = tier.acquire(cid("a"))
    tier.release(entry)
    assert put(tier, "e").evicted == [cid("b")]
    assert present(tier, "a") == ["a"]


def test_a_batch_lookup_refreshes_its_hits_in_order_leased_ones_too(tier):
    """contains_many: the hits become the most recent, in the batch's order; a leased hit in the
    batch (out of the LRU while leased) changes none of that."""
    for name in "abcd":
        put(tier, name)
    assert tier.contains_many(NS, [b"b", b"zz", b"a"]) == [True, False, True]
    assert (tier.counters.lookups, tier.counters.hits) == (3, 2)
    assert put(tier, "e").evicted == [cid("c")]  # c, d, b, a, e from the cold end
    lease = tier.acquire(cid("d"))
    assert lease is not None
    assert tier.contains_many(NS, [b"e", b"d", b"b"]) == [True, True, True]
    tier.release(lease)  # back in the LRU as the most recent
    assert put(tier, "f").evicted == [cid("a")]
    assert put(tier, "g").evicted == [cid("e")]
    assert put(tier, "h").evicted == [cid("b")]
    assert put(tier, "i").evicted == [cid("d")]


def test_lookup_counters(tier):
    put(tier, "a")
    tier.contains(cid("a"))
    tier.contains(cid("zz"))
    assert tier.counters.lookups == 2
    assert tier.counters.hits == 1


def test_a_lease_blocks_eviction(tier):
    for name in "abcd":
        put(tier, name)
    lease = tier.acquire(cid("a"))
    assert lease is not None
    evicted = []
    for name in "efghij":
        evicted += put(tier, name).evicted
    assert cid("a") not in evicted
    assert present(tier, "a") == ["a"]
    assert tier.extents(lease)[0].offset // PAGE == lease.runs[0].start  # pages stayed put
    tier.release(lease)
    assert present(tier, "a") == ["a"]


def test_pool_full_of_leases_gives_no_space_and_recovers_after_release(tier):
    for name in "abcd":
        put(tier, name)
    leases = [tier.acquire(cid(n)) for n in "abcd"]
    res = tier.reserve(cid("e"), PAGE)
    assert res.outcome is ReserveOutcome.NO_SPACE and res.entry is None
    assert present(tier, *"abcd") == list("abcd")
    tier.release(leases[2])  # c becomes evictable
    res = tier.reserve(cid("e"), PAGE)
    assert res.outcome is ReserveOutcome.RESERVED
    assert res.evicted == [cid("c")]


def test_reservations_are_not_evictable(tier):
    reservations = [tier.reserve(cid(n), PAGE) for n in "abcd"]
    assert all(r.outcome is ReserveOutcome.RESERVED for r in reservations)
    assert tier.reserve(cid("e"), PAGE).outcome is ReserveOutcome.NO_SPACE
    tier.abort(reservations[0].entry)
    assert tier.reserve(cid("e"), PAGE).outcome is ReserveOutcome.RESERVED


def test_reserved_chunks_are_invisible_until_commit(tier):
    res = tier.reserve(cid("a"), PAGE)
    assert not tier.contains(cid("a"))
    assert tier.acquire(cid("a")) is None
    assert tier.chunk_count == 0
    tier.commit(res.entry)
    assert tier.contains(cid("a"))
    assert tier.chunk_count == 1


def test_second_reservation_of_the_same_chunk_is_in_progress(tier):
    first = tier.reserve(cid("a"), PAGE)
    assert first.outcome is ReserveOutcome.RESERVED
    second = tier.reserve(cid("a"), PAGE)
    assert second.outcome is ReserveOutcome.IN_PROGRESS and second.entry is None
    assert tier.used_bytes == PAGE  # the second writer got no pages
    tier.commit(first.entry)
    assert tier.reserve(cid("a"), PAGE).outcome is ReserveOutcome.ALREADY_PRESENT


def test_abort_makes_the_chunk_reservable_again(tier):
    first = tier.reserve(cid("a"), PAGE)
    tier.abort(first.entry)
    assert tier.used_bytes == 0
    assert not tier.contains(cid("a"))
    assert tier.reserve(cid("a"), PAGE).outcome is ReserveOutcome.RESERVED


def test_delete_while_leased_keeps_pages_until_release(tier):
    put(tier, "a")
    put(tier, "b")
    lease = tier.acquire(cid("a"))
    assert tier.delete(cid("a")) is True
    assert not tier.contains(cid("a"))
    assert tier.acquire(cid("a")) is None
    assert tier.chunk_count == 1
    assert tier.used_bytes == 2 * PAGE  # the reader still owns a's pages
    # Filling the pool must not reuse a's pages while they are leased.
    leased_pages = {r.start for r in lease.runs}
    for name in "cdef":
        res = put(tier, name)
        assert not {r.start for r in res.entry.runs} & leased_pages
    tier.release(lease)
    assert tier.used_bytes == 3 * PAGE  # a's page is free again; d, e, f remain
    assert present(tier, *"bcdef") == list("def")
    assert present(tier, "a") == []
    # The key can be stored again.
    assert tier.reserve(cid("a"), PAGE).outcome is ReserveOutcome.RESERVED


def test_delete_unleased_frees_pages(tier):
    put(tier, "a")
    assert tier.delete(cid("a")) is True
    assert tier.used_bytes == 0
    assert tier.chunk_count == 0
    assert tier.delete(cid("a")) is False
    assert tier.delete(cid("never")) is False


def test_two_leases_on_one_chunk(tier):
    put(tier, "a")
    l1, l2 = tier.acquire(cid("a")), tier.acquire(cid("a"))
    assert l1 is l2 and l1.leases == 2
    tier.release(l1)
    for name in "bcde":
        put(tier, name)
    assert present(tier, "a") == ["a"]  # still leased once
    tier.release(l2)
    with pytest.raises(ValueError):
        tier.release(l2)


def test_extents_cover_the_chunk_exactly():
    tier = RamTier(8 * PAGE, PAGE)
    res = put(tier, "a", 2 * PAGE + 123)
    extents = tier.extents(res.entry)
    assert sum(e.length for e in extents) == 2 * PAGE + 123
    assert all(e.offset % PAGE == 0 for e in extents)
    assert all(e.offset + e.length <= tier.capacity_bytes for e in extents)


def test_commit_and_abort_of_wrong_state_raise(tier):
    res = put(tier, "a")
    with pytest.raises(ValueError):
        tier.commit(res.entry)
    with pytest.raises(ValueError):
        tier.abort(res.entry)


def test_a_reservation_that_cannot_fit_evicts_nothing(tier):
    """Leases pin 2 of 4 pages; a 3-page chunk can never fit, even after evicting everything
    evictable. The reservation must fail without throwing cached chunks away for nothing."""
    for name in "abcd":
        put(tier, name)
    leases = [tier.acquire(cid(n)) for n in "ab"]
    res = tier.reserve(cid("big"), 3 * PAGE)
    assert res.outcome is ReserveOutcome.NO_SPACE
    assert res.evicted == []
    assert present(tier, *"abcd") == list("abcd")
    assert tier.counters.evictions == 0
    for lease in leases:
        tier.release(lease)
    # Once it can fit, it evicts only what it needs, oldest first (a and b were used last).
    res = tier.reserve(cid("big"), 3 * PAGE)
    assert res.outcome is ReserveOutcome.RESERVED
    assert res.evicted == [cid("c"), cid("d"), cid("a")]


def test_a_promoted_chunk_read_once_goes_to_the_cold_end_then_lives_normally():
    from kvstored.tiers.ram import RamTier

    page = 4096
    ram = RamTier(4 * page, page, has_lower_tiers=True)
    stored = [("ns", bytes([i]) * 32) for i in range(3)]
    for chunk in stored:
        ram.commit(ram.reserve(chunk, page).entry)
    promoted = ("ns", b"p" * 32)
    ram.commit(ram.reserve(promoted, page).entry, persisted=True)
    ram.release(ram.acquire(promoted))  # its one load: now first in line for eviction

    evicted = ram.reserve(("ns", b"x" * 32), page).evicted
    assert evicted == [promoted]
    assert all(ram.contains(c, touch=False) for c in stored)

    # read twice: an ordinary recently used chunk afterwards
    ram.commit(ram.reserve(promoted, page).entry, persisted=True)  # room: stored[0] is evicted
    ram.release(ram.acquire(promoted))
    ram.release(ram.acquire(promoted))
    evicted = ram.reserve(("ns", b"y" * 32), page).evicted
    assert promoted not in evicted


# -- arenas and quotas ----------------------------------------------------------------------------


def tenants_tier(capacity_pages: int = 16, **kwargs) -> tuple[RamTier, dict[str, Placement], list]:
    """A tier whose namespaces "quiet" and "noisy" are tenants (arenas 1 and 2, 8 pages each);
    every other namespace is public. Returns the tier, the placements and the releases asked."""
    tier = RamTier(capacity_pages * PAGE, PAGE, slack_bytes=PAGE, **kwargs)
    placements = {}
    for arena, name in ((1, "quiet"), (2, "noisy")):
        tier.add_arena(arena, 8 * PAGE)
        placements[name] = Placement(arena, (QuotaScope(name, 8),))
    tier.set_placement(lambda ns: placements.get(ns, Placement()))
    releases: list = []
    tier.set_releaser(lambda arena, runs: releases.append((arena, runs)))
    return tier, placements, releases


def store(tier: RamTier, ns: str, n: int, label: str = "") -> list[tuple[str, bytes]]:
    chunks = [(ns, f"{label or ns}-{i}".encode()) for i in range(n)]
    for chunk in chunks:
        res = tier.reserve(chunk, PAGE)
        assert res.outcome is ReserveOutcome.RESERVED and res.entry is not None, (chunk, res)
        tier.commit(res.entry)
    return chunks


def test_a_tenant_over_its_quota_evicts_only_its_own_oldest_chunks():
    tier, placements, _ = tenants_tier()
    quiet = store(tier, "quiet", 4)
    noisy = store(tier, "noisy", 40)
    assert all(tier.contains(c, touch=False) for c in quiet)
    assert [tier.contains(c, touch=False) for c in noisy] == [False] * 32 + [True] * 8
    assert placements["noisy"].scopes[0].used_pages == 8
    assert placements["noisy"].scopes[0].evictions == 32
    assert tier.counters.evictions == 32


def test_a_quota_full_of_pinned_chunks_refuses_without_evicting():
    tier, _, _ = tenants_tier()
    noisy = store(tier, "noisy", 8)
    leases = [tier.acquire(c) for c in noisy]
    res = tier.reserve(("noisy", b"more"), PAGE)
    assert res.outcome is ReserveOutcome.NO_SPACE and res.evicted == []
    for lease in leases:
        tier.release(lease)
    assert tier.reserve(("noisy", b"more"), PAGE).evicted == [noisy[0]]


def test_recency_within_a_quota_follows_hits():
    tier, _, _ = tenants_tier()
    noisy = store(tier, "noisy", 8)
    assert tier.contains_many("noisy", [noisy[0][1]]) == [True]  # now the most recent
    assert tier.reserve(("noisy", b"new"), PAGE).evicted == [noisy[1]]


def test_tenant_chunks_live_in_their_arena_and_public_ones_in_the_pool():
    tier, _, _ = tenants_tier()
    res = tier.reserve(("quiet", b"x"), PAGE + 1)
    assert {e.arena for e in tier.extents(res.entry)} == {1}
    assert sum(e.length for e in tier.extents(res.entry)) == PAGE + 1
    res = tier.reserve(("public", b"x"), PAGE)
    assert [e.arena for e in tier.extents(res.entry)] == [0]


def test_one_capacity_over_all_arenas():
    tier, _, _ = tenants_tier(capacity_pages=12)
    store(tier, "quiet", 8)
    public = store(tier, "public", 6)  # 14 pages wanted, 12 held: the LRU's oldest go first
    assert tier.used_bytes == 12 * PAGE
    assert tier.contains(public[-1], touch=False)
    assert not tier.contains(("quiet", b"quiet-0"), touch=False)


def test_a_namespace_scope_attached_later_counts_the_chunks_already_there():
    tier = RamTier(16 * PAGE, PAGE)
    old = store(tier, "ns1", 5)
    scope = QuotaScope("ns1", 4)
    tier.attach_scope("ns1", scope)
    tier.set_placement(lambda ns: Placement(0, (scope,)) if ns == "ns1" else Placement())
    assert scope.used_pages == 5
    res = tier.reserve(("ns1", b"new"), PAGE)  # 6 pages wanted, 4 allowed: the two oldest go
    assert res.evicted == old[:2]
    assert scope.used_pages == 4


def test_free_pages_go_back_only_past_the_capacity_and_from_the_arena_holding_the_most():
    tier, _, releases = tenants_tier()  # the pool is resident (16 pages); slack 1 page
    quiet = store(tier, "quiet", 4)  # 20 pages resident, but nothing may go: the pool is pinned
    assert releases == [] and tier.resident_bytes == 20 * PAGE
    for chunk in quiet:
        tier.delete(chunk)  # freed pages stay for reuse: freeing adds no memory
    assert releases == []
    store(tier, "noisy", 2)  # 22 resident: the quiet tenant's free pages go (never noisy's own)
    assert [(arena, sum(r.count for r in runs)) for arena, runs in releases] == [(1, 4)]
    tier.set_public_releasable(True)  # and one of the pool's, for the rest
    assert [(arena, sum(r.count for r in runs)) for arena, runs in releases] == [(1, 4), (0, 1)]
    assert tier.resident_bytes == 22 * PAGE  # pages count until they are back
    for arena, runs in releases:
        tier.released(arena, runs)
    assert tier.resident_bytes == 17 * PAGE  # the capacity plus the slack
    assert store(tier, "quiet", 2, "again")  # its released pages are holes again, and usable


def test_the_public_arena_gives_back_what_tenants_hold_when_allowed():
    tier, _, releases = tenants_tier(populated=True)
    store(tier, "quiet", 6)
    assert releases == []  # pinned by a client: nothing may go
    tier.set_public_releasable(True)
    assert [(arena, sum(r.count for r in runs)) for arena, runs in releases] == [(0, 5)]  # 16 + 6 - 16 - slack 1
    store(tier, "quiet", 2, "more")
    assert [arena for arena, _ in releases] == [0, 0, 0]  # one more page each
    for arena, runs in releases:
        tier.released(arena, runs)
    assert tier.resident_bytes == 17 * PAGE


def test_an_arena_is_removable_only_when_idle():
    tier, _, _ = tenants_tier()
    [chunk] = store(tier, "noisy", 1)
    assert not tier.arena_idle(2)
    with pytest.raises(ValueError):
        tier.remove_arena(2)
    tier.delete(chunk)
    assert tier.arena_idle(2)
    tier.remove_arena(2)
    assert tier.reserve(("noisy", b"x"), PAGE).outcome is ReserveOutcome.NO_SPACE  # no arena: nowhere


def test_write_back_victims_of_a_scope_are_its_own_and_count_as_writing():
    tier = RamTier(16 * PAGE, PAGE, has_lower_tiers=True)
    scope = QuotaScope("noisy", 8)
    tier.set_placement(lambda ns: Placement(0, (scope,)) if ns == "noisy" else Placement())
    public = store(tier, "public", 4)
    noisy = store(tier, "noisy", 8)
    states = WriteBackState(tier)
    to_write, evicted = states.victims(3 * PAGE, scope)
    assert [e.chunk for e in to_write] == noisy[:3] and evicted == []
    assert tier.writing_bytes(scope) == 3 * PAGE and tier.room_bytes(scope) == 0
    assert states.finish(to_write[0], persisted=True)
    assert tier.writing_bytes(scope) == 2 * PAGE and tier.room_bytes(scope) == PAGE
    assert all(tier.contains(c, touch=False) for c in public)


def test_unkeyed_reservations_are_counted_until_bound_or_aborted(tier):
    ahead = tier.reserve_unkeyed(NS, PAGE)
    assert ahead.outcome is ReserveOutcome.RESERVED and ahead.entry is not None
    assert tier.unkeyed_bytes == PAGE and tier.used_bytes == PAGE
    assert not tier.contains(cid("a"), touch=False)  # in no index until bound
    assert tier.bind(ahead.entry, cid("a")) is ReserveOutcome.RESERVED
    assert tier.unkeyed_bytes == 0
    tier.commit(ahead.entry)
    assert present(tier, "a") == ["a"]

    aborted = tier.reserve_unkeyed(NS, PAGE)
    assert aborted.entry is not None
    tier.abort(aborted.entry)
    assert tier.unkeyed_bytes == 0 and tier.used_bytes == PAGE


def test_a_bind_onto_a_key_ram_holds_leaves_the_reservation_to_abort(tier):
    put(tier, "a")
    ahead = tier.reserve_unkeyed(NS, PAGE)
    assert ahead.entry is not None
    assert tier.bind(ahead.entry, cid("a")) is ReserveOutcome.ALREADY_PRESENT
    assert tier.unkeyed_bytes == PAGE
    tier.abort(ahead.entry)
    assert tier.unkeyed_bytes == 0 and tier.used_bytes == PAGE
    assert present(tier, "a") == ["a"]


def test_only_an_unkeyed_reservation_can_be_bound(tier):
    """A keyed reservation deleted while being written is out of the index too; binding it
    would file one chunk's pages under another key."""
    res = tier.reserve(cid("a"), PAGE)
    assert res.entry is not None
    tier.delete(cid("a"))
    with pytest.raises(ValueError, match="unkeyed"):
        tier.bind(res.entry, cid("b"))
    tier.abort(res.entry)
    assert tier.unkeyed_bytes == 0 and tier.used_bytes == 0
    ahead = tier.reserve_unkeyed(NS, PAGE)
    assert ahead.entry is not None
    with pytest.raises(ValueError, match="unkeyed"):
        tier.bind(ahead.entry, ("other-namespace", b"a"))


def test_a_reservation_deleted_before_its_commit_is_freed_and_not_counted_stored(tier):
    res = tier.reserve(cid("a"), PAGE)
    assert res.entry is not None
    assert tier.delete(cid("a")) is False  # not READY yet: unindexed, its commit frees it
    tier.commit(res.entry)
    assert (tier.counters.stored, tier.counters.written_bytes) == (0, 0)
    assert tier.used_bytes == 0 and present(tier, "a") == []
    put(tier, "b")
    assert (tier.counters.stored, tier.counters.written_bytes) == (1, PAGE)
