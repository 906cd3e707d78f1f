# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The pool's memory: a sealed memfd of 4 KiB pages, transparent huge pages or hugetlb pages,
placed on a NUMA node or interleaved, mapped here and populated in steps.

Why the options: with 4 KiB pages every process mapping a 512 GiB pool needs ~1 GiB of page tables
and copies miss the TLB; 2 MiB pages cut both by 512x. hugetlb pages are reserved up front by the
administrator (vm.nr_hugepages) and every mapping of the memfd uses them, clients included; THP on
shmem needs /sys/kernel/mm/transparent_hugepage/shmem_enabled = advise (or always) and helps
mappings that ask for it (the daemon's). NUMA: the pool on the GPU's node, or interleaved.

`check_request` says, before anything is allocated, whether the machine can give what was asked
(one line naming both); `create_memfd` makes the mapping; `populate` fills it in steps, reporting
progress and stopping at once when asked.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import fcntl
import mmap
import os
import platform
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstored.sizes import format_size

HUGE_PAGE_BYTES = 2 << 20
POPULATE_STEP_BYTES = 64 << 20  # a stop is noticed within one step (~0.1 s here)
REPORT_EVERY_S = 5.0
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MFD_HUGETLB = getattr(os, "MFD_HUGETLB", 4)
MFD_HUGE_2MB = getattr(os, "MFD_HUGE_2MB", 21 << 26)
MPOL_BIND, MPOL_INTERLEAVE = 2, 3
SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259}.get(platform.machine())
NODES = Path("/sys/devices/system/node")
THP_SHMEM = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
MEMINFO = Path("/proc/meminfo")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long


class PoolMemoryError(Exception):
    """The machine cannot give the pool what was asked; the message names both (exit code 2)."""


class PoolPages(enum.Enum):
    SMALL = "4k"  # the kernel's base pages
    THP = "thp"  # transparent huge pages on shmem (madvise), where the kernel allows them
    HUGETLB = "hugetlb"  # 2 MiB pages reserved up front (vm.nr_hugepages)


@dataclass(frozen=True)
class NumaPlacement:
    """Where the pool's pages go: bound to one node, or interleaved across every node with memory."""

    node: int | None  # None: interleave

    @classmethod
    def parse(cls, value: object) -> NumaPlacement | None:
        text = str(value).strip().lower()
        if text in ("", "none", "unset"):
            return None
        if text == "interleave":
            return cls(None)
        if not text.isdigit():
            raise ValueError(f"{value!r} is not a NUMA node number, interleave, or empty (unset)")
        return cls(int(text))

    def __str__(self) -> str:
        return "interleave" if self.node is None else str(self.node)


@dataclass(frozen=True)
class PoolMemory:
    """A mapped memfd. The fd goes to clients over the session socket; `mapping` is the daemon's."""

    fd: int
    mapping: mmap.mmap
    size: int
    pages: PoolPages
    numa: NumaPlacement | None


@dataclass(frozen=True)
class PopulateProgress:
    done_bytes: int
    total_bytes: int
    elapsed_s: float

    @property
    def finished(self) -> bool:
        return self.done_bytes >= self.total_bytes

    @property
    def rate(self) -> float:
        """Bytes per second so far (0 before the first step)."""
        return self.done_bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def describe(self) -> str:
        """e.g. '3.2 GiB of 10.0 GiB (32%), 0.8 GiB/s, ~9 s left'."""
        pct = 100 * self.done_bytes // max(1, self.total_bytes)
        text = f"{format_size(self.done_bytes)} of {format_size(self.total_bytes)} ({pct}%)"
        if self.rate:
            text += f", {format_size(int(self.rate))}/s"
            if not self.finished:
                text += f", ~{(self.total_bytes - self.done_bytes) / self.rate:.0f} s left"
        return text


# -- what the machine has ------------------------------------------------------------------------


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (HugePages_* counts stay counts)."""
    out = {}
    for line in MEMINFO.read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def cgroup_memory_limit() -> int | None:
    """This process' cgroup v2 memory.max, if it has one."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                limit = (Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "memory.max").read_text().strip()
                return None if limit == "max" else int(limit)
    except (OSError, ValueError):
        pass
    return None


def numa_nodes() -> list[int]:
    """The online NUMA nodes with memory ([0] on a machine without NUMA sysfs)."""
    for name in ("has_memory", "online"):
        try:
            return _node_list((NODES / name).read_text())
        except OSError:
            continue
    return [0]


def _node_list(text: str) -> list[int]:
    nodes: list[int] = []
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        nodes += range(int(first), int(last or first) + 1)
    return nodes


def thp_shmem_mode() -> str:
    """The selected [mode] of shmem_enabled (always, within_size, advise, never, deny, force), or
    'unavailable' on a kernel without THP."""
    try:
        match = re.search(r"\[(\w+)\]", THP_SHMEM.read_text())
    except OSError:
        return "unavailable"
    return match.group(1) if match else "unavailable"


def free_huge_pages(node: int | None) -> int:
    """2 MiB pages free and not promised to another mapping (system-wide, or on one node)."""
    info = meminfo()
    free = info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)
    if node is not None:
        path = NODES / f"node{node}" / "hugepages" / "hugepages-2048kB" / "free_hugepages"
        try:
            free = min(free, int(path.read_text()))
        except OSError:
            pass
    return max(0, free)


def pool_size(size: int, pages: PoolPages) -> int:
    """The size a pool of `size` bytes gets: hugetlb pools are whole huge pages (rounded down),
    so every mapping of it, a client's included, unmaps cleanly."""
    return size - size % HUGE_PAGE_BYTES if pages is PoolPages.HUGETLB else size


def check_request(size: int, pages: PoolPages, numa: NumaPlacement | None, populate: bool) -> list[str]:
    """Raise PoolMemoryError (naming what was asked and what the machine has, and how to fix it)
    if the machine cannot give the pool; returns warnings for what it gives only in part."""
    warnings: list[str] = []
    if numa is not None and numa.node is not None and numa.node not in numa_nodes():
        raise PoolMemoryError(
            f"numa_node {numa.node} does not exist: this machine's NUMA nodes with memory are "
            f"{', '.join(map(str, numa_nodes()))}"
        )
    if numa is not None and SYS_MBIND is None:
        raise PoolMemoryError(f"numa_node is not supported on {platform.machine()} (no mbind syscall number known)")
    if pages is PoolPages.HUGETLB:
        if size < HUGE_PAGE_BYTES:
            raise PoolMemoryError(f"pool_pages = hugetlb: cpu_bytes {format_size(size)} is less than one 2 MiB page")
        wanted = size // HUGE_PAGE_BYTES
        free = free_huge_pages(numa.node if numa else None)
        if free < wanted:
            info = meminfo()
            where = f" on node {numa.node}" if numa and numa.node is not None else ""
            raise PoolMemoryError(
                f"pool_pages = hugetlb: cpu_bytes {format_size(size)} needs {wanted} huge pages of 2 MiB{where}; "
                f"this system has {free} free (HugePages_Total {info.get('HugePages_Total', 0)}, HugePages_Free "
                f"{info.get('HugePages_Free', 0)}, HugePages_Rsvd {info.get('HugePages_Rsvd', 0)} in /proc/meminfo). "
                f"Reserve them: sysctl vm.nr_hugepages={info.get('HugePages_Total', 0) + wanted - free} "
                f"(at boot: hugepages=N on the kernel command line), or use pool_pages = thp or 4k"
            )
        return warnings
    info = meminfo()
    total, available = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    limit = cgroup_memory_limit()
    has = f"{format_size(total)} of RAM, {format_size(available)} available"
    if limit is not None:
        has += f", a cgroup limit of {format_size(limit)}"
    if size > min(total, limit or total) or (populate and size > available):
        raise PoolMemoryError(
            f"cpu_bytes {format_size(size)} is more than this machine can give: it has {has}; "
            f"set --cpu-bytes (cpu_bytes) below that (the default, 25% of RAM, is "
            f"{format_size(total // 4)} here)"
        )
    if size > available:
        warnings.append(
            f"cpu_bytes {format_size(size)} is more than the {format_size(available)} available now: "
            f"the pool may be swapped out or the daemon killed when it fills"
        )
    if pages is PoolPages.THP and thp_shmem_mode() not in ("always", "within_size", "advise", "force"):
        warnings.append(
            f"pool_pages = thp has no effect: {THP_SHMEM} is {thp_shmem_mode()!r}, so the pool gets "
            f"4 KiB pages (echo advise > {THP_SHMEM}, or use pool_pages = hugetlb)"
        )
    return warnings


# -- making and filling the pool -------------------------------------------------------------------


def create_memfd(
    size: int, pages: PoolPages = PoolPages.SMALL, numa: NumaPlacement | None = None, name: str = "kvstored-pool"
) -> PoolMemory:
    """A sealed memfd of `size` bytes (a multiple of 2 MiB for hugetlb: see pool_size), mapped
    here, with its NUMA policy and huge-page advice applied before any page is touched."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (MFD_HUGETLB | MFD_HUGE_2MB if pages is PoolPages.HUGETLB else 0)
    try:
        fd = os.memfd_create(name, flags)
    except OSError as exc:
        raise PoolMemoryError(f"cannot create the pool's memfd ({pages.value} pages): {exc.strerror}") from None
    try:
        os.ftruncate(fd, size)
        # Clients get this fd read-write: sealing its size means no client can shrink the pool
        # under the daemon (its pages would vanish and the next copy would SIGBUS).
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        try:
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:  # hugetlb: the reservation is taken here
            raise PoolMemoryError(
                f"cannot map a {format_size(size)} pool of {pages.value} pages: {exc.strerror} ({_has(pages)})"
            ) from None
        _place(mapping, size, pages, numa)
    except BaseException:
        os.close(fd)
        raise
    return PoolMemory(fd, mapping, size, pages, numa)


def adopt_memfd(fd: int, size: int, pages: PoolPages, numa: NumaPlacement | None) -> PoolMemory:
    """Map a pool memfd handed over by the previous daemon (kvstored/server/handover.py): its
    pages are already there; the policy and advice apply to pages it gets from now on.
    PoolMemoryError if the fd is not a sealed memfd of `size` bytes."""
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS) if _is_memfd(fd) else 0
    wanted = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    if seals & wanted != wanted or os.fstat(fd).st_size != size:
        raise PoolMemoryError(f"the handed-over pool is not a sealed memfd of {format_size(size)}")
    try:
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise PoolMemoryError(f"cannot map the handed-over pool: {exc.strerror}") from None
    _place(mapping, size, pages, numa)
    return PoolMemory(fd, mapping, size, pages, numa)


def _place(mapping: mmap.mmap, size: int, pages: PoolPages, numa: NumaPlacement | None) -> None:
    """The NUMA policy and page advice of a pool mapping (closed if either fails)."""
    try:
        address = _address(mapping)
        if numa is not None:
            _mbind(address, size, numa)
        if pages is PoolPages.THP:
            _madvise(address, size, MADV_HUGEPAGE, "MADV_HUGEPAGE")
    except BaseException:
        mapping.close()
        raise


def _is_memfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except OSError:
        return False


MAX_POPULATE_THREADS = 8


def populate_threads(numa: NumaPlacement | None) -> int:
    """Threads that fill the pool: one per CPU this process may run on, at most 8 (the kernel's
    page zeroing and page-table work scale with cores until memory bandwidth is the limit). One
    with numa_node unset on a machine of several nodes: first touch places a page on the node of
    the thread that touches it, and one thread keeps the pool on one node as before."""
    cpus = len(os.sched_getaffinity(0))
    if numa is None and len(numa_nodes()) > 1:
        return 1
    return max(1, min(cpus, MAX_POPULATE_THREADS))


def populate(
    memory: PoolMemory,
    progress: Callable[[PopulateProgress], None] | None = None,
    stop: threading.Event | None = None,
    report_every_s: float = REPORT_EVERY_S,
    clock: Callable[[], float] = time.monotonic,
    threads: int | None = None,
) -> bool:
    """Allocate and map every page of the pool, POPULATE_STEP_BYTES at a time, `threads` steps
    at once (default populate_threads(); blocking, without the GIL: run it in a thread).
    `progress` hears at the start, every `report_every_s` and at the end, always from this
    thread; `stop` ends it within one step. True once every page is in, False if stopped."""
    start = last = clock()
    size = memory.size
    if progress is not None:
        progress(PopulateProgress(0, size, 0.0))
    filler = _Filler(memory, stop)
    count = max(1, threads if threads is not None else populate_threads(memory.numa))
    workers = [threading.Thread(target=filler.run, name=f"kvstored-populate-{i}", daemon=True) for i in range(1, count)]
    for worker in workers:
        worker.start()
    reported = 0
    try:
        while filler.step(wait_s=report_every_s if workers else 0):
            now = clock()
            if progress is not None and now - last >= report_every_s and filler.done > reported:
                last, reported = now, filler.done
                progress(PopulateProgress(reported, size, now - start))
    finally:
        filler.abandon()  # (an error here: the others stop after their current step)
        for worker in workers:
            worker.join()
    if filler.error is not None:
        raise filler.error
    if filler.done < size:
        return False
    if progress is not None and reported < size:
        progress(PopulateProgress(size, size, clock() - start))
    return True


class _Filler:
    """Hands out the pool's steps, in order, to the threads filling it (each step to one
    thread: disjoint ranges); counts what is done, keeps the first error."""

    def __init__(self, memory: PoolMemory, stop: threading.Event | None) -> None:
        self.memory = memory
        self.address = _address(memory.mapping)
        self.stop = stop if stop is not None else threading.Event()
        self.touch = False  # kernels before 5.14 lack MADV_POPULATE_WRITE: touch one byte per page
        self.done = 0
        self.error: BaseException | None = None
        self._next = 0
        self._running = 0
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)

    def abandon(self) -> None:
        with self._lock:
            self._next = self.memory.size

    def run(self) -> None:
        while self.step(wait_s=0):
            pass

    def step(self, wait_s: float) -> bool:
        """Fill the next step, or (none left) wait up to `wait_s` for the others; False once
        every step has ended, a stop was asked or a step failed."""
        with self._lock:
            if self.stop.is_set() or self.error is not None:
                self._next = self.memory.size
            offset = self._next
            if offset >= self.memory.size:
                if self._running and wait_s:
                    self._ended.wait(wait_s)
                return bool(self._running)
            length = min(POPULATE_STEP_BYTES, self.memory.size - offset)
            self._next += length
            self._running += 1
        try:
            self._fill(offset, length)
        except BaseException as exc:  # noqa: BLE001 - handed to populate()'s caller
            with self._lock:
                self.error = self.error or exc
        finally:
            with self._lock:
                self._running -= 1
                self.done += length
                self._ended.notify_all()
        return True

    def _fill(self, offset: int, length: int) -> None:
        memory = self.memory
        if not self.touch and _libc.madvise(
            ctypes.c_void_p(self.address + offset), ctypes.c_size_t(length), MADV_POPULATE_WRITE
        ):
            err = ctypes.get_errno()
            if err != errno.EINVAL:
                raise PoolMemoryError(
                    f"populating the pool failed at {format_size(offset)} of {format_size(memory.size)}: "
                    f"{os.strerror(err)} ({_has(memory.pages)})"
                )
            self.touch = True
        if self.touch:
            page = HUGE_PAGE_BYTES if memory.pages is PoolPages.HUGETLB else mmap.PAGESIZE
            for at in range(offset, offset + length, page):
                memory.mapping[at] = 0  # a fresh memfd reads zeros: writing one changes nothing


def huge_page_bytes(memory: PoolMemory) -> int:
    """How much of the mapping the kernel backs with 2 MiB pages now (from /proc/self/smaps)."""
    start = _address(memory.mapping)
    inside, total = False, 0
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            inside = int(head.split("-")[0], 16) == start
        elif inside and head in ("ShmemPmdMapped:", "FilePmdMapped:", "Shared_Hugetlb:", "Private_Hugetlb:"):
            total += int(line.split()[1]) * 1024
    return total


def _has(pages: PoolPages) -> str:
    if pages is PoolPages.HUGETLB:
        info = meminfo()
        return f"HugePages_Free {info.get('HugePages_Free', 0)} of HugePages_Total {info.get('HugePages_Total', 0)}"
    info = meminfo()
    return f"MemAvailable {format_size(info.get('MemAvailable', 0))} of MemTotal {format_size(info.get('MemTotal', 0))}"


def _address(mapping: mmap.mmap) -> int:
    view = memoryview(mapping)
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    finally:
        view.release()


def _madvise(address: int, size: int, advice: int, name: str) -> None:
    if _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), advice):
        err = ctypes.get_errno()
        raise PoolMemoryError(f"madvise({name}) on the pool failed: {os.strerror(err)}")


def _mbind(address: int, size: int, numa: NumaPlacement) -> None:
    """Set the mapping's NUMA policy (for a memfd: the policy of its pages, whoever faults them)."""
    if SYS_MBIND is None:  # (check_request refuses this first)
        raise PoolMemoryError(f"numa_node is not supported on {platform.machine()}")
    nodes = numa_nodes() if numa.node is None else [numa.node]
    bits = 1024
    mask = (ctypes.c_ulong * (bits // (8 * ctypes.sizeof(ctypes.c_ulong))))()
    word = 8 * ctypes.sizeof(ctypes.c_ulong)
    for node in nodes:
        mask[node // word] |= 1 << (node % word)
    mode = MPOL_INTERLEAVE if numa.node is None else MPOL_BIND
    # syscall() is variadic and reads every argument as a long: pass each one that wide
    if _libc.syscall(
        ctypes.c_long(SYS_MBIND),
        ctypes.c_void_p(address),
        ctypes.c_ulong(size),
        ctypes.c_ulong(mode),
        mask,
        ctypes.c_ulong(bits + 1),
        ctypes.c_ulong(0),
    ):
        err = ctypes.get_errno()
        raise PoolMemoryError(f"numa_node {numa}: mbind of the pool failed: {os.strerror(err)}")
