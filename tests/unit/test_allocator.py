# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""PageAllocator: best contiguous run when one exists, several runs when fragmented, never a
failure while enough pages are free, coalescing on free, and double frees refused."""

from __future__ import annotations

import random

import pytest

from kvstored.shm.allocator import PageAllocator, PageRun


def pages_of(runs: list[PageRun]) -> set[int]:
    out: set[int] = set()
    for run in runs:
        out.update(range(run.start, run.start + run.count))
    return out


def test_fresh_allocator_hands_out_contiguous_disjoint_runs():
    alloc = PageAllocator(16)
    a = alloc.allocate(4)
    b = alloc.allocate(5)
    c = alloc.allocate(7)
    for runs, n in ((a, 4), (b, 5), (c, 7)):
        assert len(runs) == 1 and runs[0].count == n
    assert pages_of(a) | pages_of(b) | pages_of(c) == set(range(16))
    assert alloc.free_pages == 0
    assert alloc.allocate(1) is None


def test_contiguous_run_chosen_when_one_fits_even_if_fragmented():
    alloc = PageAllocator(12)
    singles = [alloc.allocate(1) for _ in range(12)]
    # Free pages 1, 3 (isolated) and 6..9 (a run of 4).
    for i in (1, 3, 6, 7, 8, 9):
        alloc.free(singles[i])
    runs = alloc.allocate(3)
    assert len(runs) == 1, runs
    assert pages_of(runs) <= {6, 7, 8, 9}


def test_best_fit_prefers_the_smallest_run_that_fits():
    alloc = PageAllocator(12)
    singles = [alloc.allocate(1) for _ in range(12)]
    for i in (0, 1, 2, 3, 4, 6, 7):  # free runs: 0..4 (5 pages) and 6..7 (2 pages)
        alloc.free(singles[i])
    assert alloc.allocate(2) == [PageRun(6, 2)]


def test_fragmented_pool_gives_several_runs_covering_exactly_the_request():
    alloc = PageAllocator(10)
    singles = [alloc.allocate(1) for _ in range(10)]
    for i in (1, 3, 5, 7):
        alloc.free(singles[i])
    runs = alloc.allocate(3)
    assert runs is not None and len(runs) == 3
    assert sum(r.count for r in runs) == 3
    assert pages_of(runs) <= {1, 3, 5, 7}
    assert len(pages_of(runs)) == 3
    assert alloc.free_pages == 1


def test_allocation_fails_only_when_fewer_pages_are_free():
    alloc = PageAllocator(8)
    held = [alloc.allocate(1) for _ in range(8)]
    for i in (0, 2, 4):
        alloc.free(held[i])
    assert alloc.allocate(4) is None  # 3 free: not enough
    assert alloc.free_pages == 3  # a refused allocation takes nothing
    runs = alloc.allocate(3)
    assert pages_of(runs) == {0, 2, 4}


def test_randomized_never_fails_with_enough_free_pages_and_never_overlaps():
    rng = random.Random(1234)
    total = 64
    alloc = PageAllocator(total)
    held: list[list[PageRun]] = []
    used: set[int] = set()
    for _ in range(3000):
        if held and (rng.random() < 0.45 or alloc.free_pages == 0):
            runs = held.pop(rng.randrange(len(held)))
            alloc.free(runs)
            used -= pages_of(runs)
        else:
            want = rng.randint(1, 9)
            runs = alloc.allocate(want)
            free_before = total - len(used)
            if want > free_before:
                assert runs is None
                continue
            assert runs is not None, f"allocate({want}) failed with {free_before} pages free"
            got = pages_of(runs)
            assert len(got) == want == sum(r.count for r in runs)
            assert not (got & used), "allocation overlaps pages already in use"
            assert all(0 <= r.start and r.start + r.count <= total for r in runs)
            used |= got
            held.append(runs)
        assert alloc.free_pages == total - len(used)
    for runs in held:
        alloc.free(runs)
    assert alloc.free_pages == total
    assert alloc.allocate(total) == [PageRun(0, total)]


def test_freeing_neighbours_coalesces_into_one_run():
    alloc = PageAllocator(9)
    a, b, c = alloc.allocate(3), alloc.allocate(3), alloc.allocate(3)
    alloc.free(a)
    alloc.free(c)
    alloc.free(b)  # merges with both neighbours
    assert alloc.free_pages == 9
    assert alloc.allocate(9) == [PageRun(0, 9)]


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2), (2, 0, 3, 1)])
def test_coalescing_in_any_free_order(order):
    alloc = PageAllocator(8)
    blocks = [alloc.allocate(2) for _ in range(4)]
    for i in order:
        alloc.free(blocks[i])
    assert alloc.allocate(8) == [PageRun(0, 8)]


def test_double_free_of_a_lone_run_raises():
    alloc = PageAllocator(8)
    a = alloc.allocate(2)
    alloc.allocate(2)
    alloc.free(a)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a)
    assert alloc.free_pages == 6


def test_double_free_of_a_run_at_the_start_of_a_coalesced_free_run_raises():
    alloc = PageAllocator(8)
    a, b = alloc.allocate(4), alloc.allocate(4)
    alloc.free(a)
    alloc.free(b)  # now one free run 0..8
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a)
    assert alloc.free_pages == 8


def test_double_free_inside_a_coalesced_free_run_raises():
    """A run freed twice after it merged with free neighbours on both sides must still be refused;
    otherwise free_pages exceeds total_pages and the same pages are handed out twice."""
    alloc = PageAllocator(12)
    a, b, c = alloc.allocate(4), alloc.allocate(4), alloc.allocate(4)
    alloc.free(a)
    alloc.free(c)
    alloc.free(b)  # the whole pool is one free run 0..12; b (4..8) lies strictly inside it
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b)
    assert alloc.free_pages == 12


def test_double_free_overlapping_a_free_run_raises():
    alloc = PageAllocator(8)
    a = alloc.allocate(4)  # 0..4
    alloc.free(a)
    with pytest.raises(ValueError, match="double free"):
        alloc.free([PageRun(1, 2)])  # pages 1..3 are free already
    assert alloc.free_pages == 8


def test_bad_arguments():
    with pytest.raises(ValueError):
        PageAllocator(0)
    alloc = PageAllocator(4)
    with pytest.raises(ValueError):
        alloc.allocate(0)
    assert alloc.allocate(5) is None
    assert alloc.free_pages == 4


# -- resident pages and holes ---------------------------------------------------------------------


def test_a_sparse_allocator_starts_with_holes_and_counts_what_it_hands_out_as_resident():
    alloc = PageAllocator(8, resident=False)
    assert (alloc.resident_pages, alloc.resident_free_pages) == (0, 0)
    runs = alloc.allocate(3)
    assert alloc.resident_pages == 3  # its writer touches them
    alloc.free(runs)
    assert (alloc.resident_pages, alloc.resident_free_pages, alloc.free_pages) == (3, 3, 8)


def test_resident_free_pages_are_handed_out_before_holes():
    alloc = PageAllocator(8, resident=False)
    first = alloc.allocate(2)
    alloc.allocate(6)
    alloc.free(first)  # pages 0..1 resident, nothing else free
    runs = alloc.allocate(2)
    assert pages_of(runs) == {0, 1}
    assert alloc.resident_pages == 8


def test_pages_taken_for_release_are_unavailable_until_released_as_holes():
    alloc = PageAllocator(8)
    taken = alloc.take_resident(5)
    assert sum(r.count for r in taken) == 5
    assert (alloc.free_pages, alloc.releasing_pages, alloc.resident_pages) == (3, 5, 8)
    assert alloc.allocate(4) is None  # what is being released cannot be handed out
    alloc.released(taken)
    assert (alloc.free_pages, alloc.releasing_pages, alloc.resident_pages, alloc.resident_free_pages) == (8, 0, 3, 3)
    runs = alloc.allocate(3)  # the resident ones first
    assert alloc.resident_pages == 3 and alloc.resident_free_pages == 0
    alloc.allocate(5)  # then holes, which become resident
    assert alloc.resident_pages == 8
    assert len(runs) == 1


def test_a_failed_release_gives_the_pages_back_as_resident():
    alloc = PageAllocator(4)
    taken = alloc.take_resident(4)
    alloc.released(taken, returned=False)
    assert (alloc.free_pages, alloc.resident_free_pages, alloc.resident_pages) == (4, 4, 4)
    with pytest.raises(ValueError):
        alloc.released(taken)  # not taken any more


def test_randomized_residency_accounting_stays_consistent():
    rng = random.Random(99)
    alloc = PageAllocator(48, resident=False)
    held: list[list[PageRun]] = []
    releasing: list[list[PageRun]] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.4:
            runs = alloc.allocate(rng.randint(1, 6))
            if runs is not None:
                held.append(runs)
        elif op < 0.7 and held:
            alloc.free(held.pop(rng.randrange(len(held))))
        elif op < 0.85:
            taken = alloc.take_resident(rng.randint(1, 8))
            if taken:
                releasing.append(taken)
        elif releasing:
            alloc.released(releasing.pop(rng.randrange(len(releasing))), returned=rng.random() < 0.8)
        in_use = sum(r.count for runs in held for r in runs)
        being_released = sum(r.count for runs in releasing for r in runs)
        assert alloc.free_pages + in_use + being_released == 48
        assert alloc.releasing_pages == being_released
        assert in_use + being_released + alloc.resident_free_pages <= alloc.resident_pages <= 48
        assert alloc.resident_pages == in_use + being_released + alloc.resident_free_pages
