# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Region <-> pool copies split across threads: exact bytes, and never abandoned half-way."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from kvstored.shm import copier as copier_module
from kvstored.shm.copier import MIN_PART_BYTES, Copier, CopyJob, split
from kvstored.shm.copy import MappingVanished
from kvstored.tiers.ram import Extent

PAGE = 64 << 10


def scattered_jobs(rng: np.random.Generator, n_chunks: int, pages_per_chunk: int) -> list[CopyJob]:
    """Chunks back to back in the region, their pages scattered over the pool (as the allocator
    hands them out once it is fragmented); runs of 1-3 pages."""
    pool_pages = rng.permutation(n_chunks * pages_per_chunk)
    jobs, used = [], 0
    for c in range(n_chunks):
        extents, left = [], pages_per_chunk
        while left:
            run = min(left, int(rng.integers(1, 4)))
            # consecutive region pages land on arbitrary pool pages, one extent per page
            extents += [Extent(int(pool_pages[used + i]) * PAGE, PAGE) for i in range(run)]
            used, left = used + run, left - run
        jobs.append(CopyJob(c * pages_per_chunk * PAGE, extents))
    return jobs


def test_split_keeps_every_job_once_in_order_and_balances_bytes():
    jobs = [CopyJob(i, [Extent(0, 4 << 20)]) for i in range(16)]  # 64 MiB
    parts = split(jobs, 4)
    assert [j for part in parts for j in part] == jobs
    assert [len(p) for p in parts] == [4, 4, 4, 4]


def test_split_does_not_cut_small_batches():
    jobs = [CopyJob(i, [Extent(0, 1 << 20)]) for i in range(4)]  # 4 MiB, under one part's minimum
    assert split(jobs, 8) == [jobs]
    big = [CopyJob(i, [Extent(0, MIN_PART_BYTES)]) for i in range(3)]
    assert len(split(big, 8)) == 3  # never more parts than jobs


@pytest.mark.parametrize("to_pool", [True, False])
async def test_parallel_copy_moves_exact_bytes(to_pool):
    rng = np.random.default_rng(7)
    n_chunks, pages = 24, 32  # 2 MiB chunks, 48 MiB: split over 4 threads
    jobs = scattered_jobs(rng, n_chunks, pages)
    assert len(split(jobs, 4)) == 4
    region = rng.integers(0, 256, n_chunks * pages * PAGE, dtype=np.uint8)
    pool = np.zeros_like(region)
    if not to_pool:
        region, pool = np.zeros_like(region), rng.integers(0, 256, len(region), dtype=np.uint8)
    copier = Copier(4)
    try:
        await copier.run(region, pool, jobs, to_pool)
    finally:
        copier.close()
    for job in jobs:
        offset = job.region_offset
        for ext in job.extents:
            assert np.array_equal(region[offset : offset + ext.length], pool[ext.offset : ext.offset + ext.length])
            offset += ext.length


async def test_cancelled_caller_waits_for_every_thread(monkeypatch):
    """The caller frees pool pages right after run() returns or raises: a cancellation must not
    let it do so while a thread still writes them."""
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []

    def slow_part(region, pool, jobs, to_pool):
        started.set()
        release.wait(10)
        finished.append(True)

    monkeypatch.setattr(copier_module, "_copy_part", slow_part)
    copier = Copier(2)
    jobs = [CopyJob(0, [Extent(0, MIN_PART_BYTES)]), CopyJob(0, [Extent(0, MIN_PART_BYTES)])]
    buf = np.zeros(MIN_PART_BYTES, dtype=np.uint8)
    task = asyncio.create_task(copier.run(buf, buf, jobs, True))
    try:
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done(), "run() gave up while its threads were still copying"
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished == [True, True]
    finally:
        release.set()
        copier.close()


async def test_a_failing_part_is_reported_after_the_others_finish(monkeypatch):
    gate = threading.Event()
    finished: list[int] = []

    def part(region, pool, jobs, to_pool):
        if jobs[0].region_offset == 0:  # the first part fails at once
            raise MappingVanished("region shrank")
        gate.wait(10)
        finished.append(jobs[0].region_offset)

    monkeypatch.setattr(copier_module, "_copy_part", part)
    copier = Copier(2)
    jobs = [CopyJob(0, [Extent(0, MIN_PART_BYTES)]), CopyJob(1, [Extent(0, MIN_PART_BYTES)])]
    try:
        running = asyncio.ensure_future(copier.run(np.zeros(1, np.uint8), np.zeros(1, np.uint8), jobs, True))
        await asyncio.sleep(0.05)
        assert not running.done(), "the error surfaced while another part was still copying"
        gate.set()
        with pytest.raises(MappingVanished, match="region shrank"):
            await running
        assert finished == [1]
    finally:
        gate.set()
        copier.close()


def test_copy_threads_must_be_positive():
    with pytest.raises(ValueError, match="copy threads"):
        Copier(0)
