# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The pool's memory (kvstored.shm.memory): populate in steps with progress and a stop, huge pages
and NUMA placement as the kernel reports them (/proc/self/smaps, numa_maps), and requests the
machine cannot meet refused with one message naming what was asked and what there is."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import pytest

from kvstored.shm import memory
from kvstored.shm.mapping import SharedPool
from kvstored.shm.memory import NumaPlacement, PoolMemoryError, PoolPages, PopulateProgress
from tests.support.hugepages import reserved_huge_pages

MIB = 1 << 20
STEP = memory.POPULATE_STEP_BYTES


def resident(mem: memory.PoolMemory) -> int:
    """Bytes of the mapping in memory now (Rss of its VMA)."""
    start = memory._address(mem.mapping)
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            inside = int(head.split("-")[0], 16) == start
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError("mapping not in /proc/self/smaps")


def policy(mem: memory.PoolMemory) -> str:
    """The NUMA policy /proc/self/numa_maps shows for the mapping."""
    start = f"{memory._address(mem.mapping):x}"
    for line in Path("/proc/self/numa_maps").read_text().splitlines():
        if line.split()[0] == start:
            return line.split()[1]
    raise AssertionError("mapping not in /proc/self/numa_maps")


@pytest.fixture
def made():
    pools: list[memory.PoolMemory] = []

    def make(size: int, pages: PoolPages = PoolPages.SMALL, numa: NumaPlacement | None = None):
        mem = memory.create_memfd(size, pages, numa)
        pools.append(mem)
        return mem

    yield make
    for mem in pools:
        mem.mapping.close()
        os.close(mem.fd)


def test_populate_reports_progress_in_steps_and_fills_every_page(made):
    mem = made(3 * STEP + 8 * MIB)
    ticks = iter(range(0, 1000, 10))  # a clock 10 s further on at every look: every step reports
    seen: list[PopulateProgress] = []
    assert resident(mem) == 0
    assert memory.populate(mem, seen.append, clock=lambda: next(ticks), threads=1)
    assert [p.done_bytes for p in seen] == [0, STEP, 2 * STEP, 3 * STEP, mem.size]
    assert seen[-1].finished and seen[-1].rate > 0 and "(100%)" in seen[-1].describe()
    assert seen[1].describe() == "64.0 MiB of 200.0 MiB (32%), 6.4 MiB/s, ~21 s left"  # 10 s per step here
    assert resident(mem) == mem.size


def test_populate_stops_within_one_step(made):
    mem = made(4 * STEP)
    stop = threading.Event()

    def progress(p: PopulateProgress) -> None:
        if p.done_bytes >= STEP:
            stop.set()  # as the daemon's SIGTERM does, from another thread

    ticks = iter(range(0, 1000, 10))
    assert not memory.populate(mem, progress, stop, clock=lambda: next(ticks), threads=1)
    assert resident(mem) == STEP


def test_populate_in_threads_fills_every_page_once_and_stops_within_a_step_each(made):
    mem = made(9 * STEP + 8 * MIB)
    seen: list[PopulateProgress] = []
    assert memory.populate(mem, seen.append, report_every_s=0, threads=3)
    done = [p.done_bytes for p in seen]
    assert done[0] == 0 and done == sorted(set(done)) and done[-1] == mem.size  # from one thread, in order
    assert resident(mem) == mem.size

    mem = made(16 * STEP)
    stop = threading.Event()
    at_stop: list[int] = []

    def progress(p: PopulateProgress) -> None:
        if p.done_bytes >= STEP and not stop.is_set():
            at_stop.append(p.done_bytes)
            stop.set()

    assert not memory.populate(mem, progress, stop, report_every_s=0, threads=3)
    assert at_stop[0] <= resident(mem) <= at_stop[0] + 3 * STEP  # what was done, plus one step per thread
    assert resident(mem) < mem.size


def test_numa_placement_is_the_mappings_policy(made):
    assert policy(made(4 * MIB)) == "default"
    assert policy(made(4 * MIB, numa=NumaPlacement(0))) == "bind:0"
    assert policy(made(4 * MIB, numa=NumaPlacement(None))) == "interleave:" + ",".join(map(str, memory.numa_nodes()))


def test_what_the_machine_cannot_give_is_refused_naming_both():
    with pytest.raises(
        PoolMemoryError,
        match=r"cpu_bytes 100.0 TiB is more than this machine can give: it has "
        r"[\d.]+ GiB of RAM, [\d.]+ GiB available",
    ):
        memory.check_request(100 << 40, PoolPages.SMALL, None, populate=True)
    missing = max(memory.numa_nodes()) + 1
    with pytest.raises(
        PoolMemoryError,
        match=rf"numa_node {missing} does not exist: this machine's NUMA nodes "
        rf"with memory are 0",
    ):
        memory.check_request(MIB, PoolPages.SMALL, NumaPlacement(missing), populate=True)
    wanted = memory.free_huge_pages(None) + 1
    with pytest.raises(
        PoolMemoryError,
        match=rf"needs {wanted} huge pages of 2 MiB; this system has "
        rf"{wanted - 1} free .*HugePages_Free.*sysctl vm.nr_hugepages=",
    ):
        memory.check_request(wanted * memory.HUGE_PAGE_BYTES, PoolPages.HUGETLB, None, populate=True)
    assert memory.check_request(64 * MIB, PoolPages.SMALL, NumaPlacement(0), populate=True) == []


def test_thp_says_when_the_kernel_gives_it_no_huge_pages(made):
    mode = memory.thp_shmem_mode()
    warnings = memory.check_request(64 * MIB, PoolPages.THP, None, populate=True)
    mem = made(64 * MIB, PoolPages.THP)
    memory.populate(mem)
    if mode in ("never", "deny", "unavailable"):
        assert len(warnings) == 1 and f"is {mode!r}" in warnings[0] and "no effect" in warnings[0]
        assert memory.huge_page_bytes(mem) == 0
    else:
        assert warnings == [] and memory.huge_page_bytes(mem) > 0


@pytest.mark.root
def test_a_hugetlb_pool_is_all_huge_pages_and_clients_map_it():
    size = 16 * MIB
    assert memory.pool_size(size + MIB, PoolPages.HUGETLB) == size
    with reserved_huge_pages(size // memory.HUGE_PAGE_BYTES):
        pool = SharedPool(size, populate=True, pages=PoolPages.HUGETLB, numa=NumaPlacement(0))
        try:
            assert pool.huge_page_bytes() == size
            pool.array[:4] = [1, 2, 3, 4]
            client = mmap.mmap(pool.fd, pool.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)  # as a client maps it
            assert client[:4] == bytes([1, 2, 3, 4])
            client.close()
        finally:
            pool.close()
