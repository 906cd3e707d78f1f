# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Benchmark of the pool's page modes and NUMA placement (not a test).

Method, baselines, targets and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.lib.daemons import rss_anon
from bench.lib.report import GIB, MIB, load_average, machine_info, print_aligned, write_json
from kvstored.shm import memory
from kvstored.shm.memory import NumaPlacement, PoolMemory, PoolMemoryError, PoolPages
from kvstored.sizes import format_size, parse_size

PIECE = 64 << 10
CHUNK = 2 << 20
COPY_BYTES = 512 * MIB  # copied per repeat (each pattern)


@dataclass
class Result:
    mode: str
    numa: str
    error: str = ""
    populate_gib_s: float = 0.0
    attach_s: float = 0.0
    pte_bytes_per_gib: float = 0.0
    copy_chunk_gib_s: float = 0.0
    copy_piece_gib_s: float = 0.0
    huge_bytes: int = 0
    samples: dict[str, list[float]] = field(default_factory=dict)


# each figure's best over the rounds, and which figures keep their samples
BEST = {"populate_gib_s": max, "attach_s": min, "pte_bytes_per_gib": min, "copy_chunk_gib_s": max}
BEST |= {"copy_piece_gib_s": max, "huge_bytes": max}
SAMPLED = ("populate_gib_s", "attach_s", "copy_chunk_gib_s", "copy_piece_gib_s")


def best(rounds: list[Result]) -> Result:
    """The best of each figure over the rounds of one configuration (samples kept)."""
    ok = [r for r in rounds if not r.error]
    if not ok:
        return rounds[0]
    figures = {f: pick(getattr(r, f) for r in ok) for f, pick in BEST.items()}
    samples = {f: [getattr(r, f) for r in ok] for f in SAMPLED}
    return Result(ok[0].mode, ok[0].numa, **figures, samples=samples)


@contextlib.contextmanager
def fresh_pool(size: int, pages: PoolPages, numa: NumaPlacement | None = None) -> Iterator[PoolMemory]:
    """A new pool memfd, made as the daemon makes it, closed after the block (bench.populate's too)."""
    mem = memory.create_memfd(size, pages, numa)
    try:
        yield mem
    finally:
        mem.mapping.close()
        os.close(mem.fd)


def measure(size: int, pages: PoolPages, numa: NumaPlacement | None, src: np.ndarray) -> Result:
    """One round of one configuration."""
    result = Result(pages.value, str(numa) if numa else "unset")
    with contextlib.ExitStack() as stack:
        try:
            memory.check_request(size, pages, numa, populate=True)
            start = time.perf_counter()
            mem = stack.enter_context(fresh_pool(size, pages, numa))
        except PoolMemoryError as exc:
            result.error = str(exc)
            return result
        memory.populate(mem)
        result.populate_gib_s = size / (time.perf_counter() - start) / GIB
        result.huge_bytes = memory.huge_page_bytes(mem)
        pte = rss_anon(os.getpid(), "VmPTE")
        start = time.perf_counter()
        client = mmap.mmap(mem.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)  # as kvstored_client maps it
        stack.enter_context(client)
        result.attach_s = time.perf_counter() - start
        result.pte_bytes_per_gib = (rss_anon(os.getpid(), "VmPTE") - pte) / (size / GIB)
        pool = np.frombuffer(client, dtype=np.uint8)
        rng = np.random.default_rng(1)
        chunk_slots = rng.permutation(size // CHUNK)[: COPY_BYTES // CHUNK]
        piece_slots = rng.integers(0, size // PIECE, COPY_BYTES // PIECE)
        patterns = {"copy_chunk_gib_s": (chunk_slots, CHUNK), "copy_piece_gib_s": (piece_slots, PIECE)}
        for figure, (slots, piece) in patterns.items():
            t = time.perf_counter()
            for i, slot in enumerate(slots):
                at = int(slot) * piece
                np.copyto(pool[at : at + piece], src[(i * piece) % len(src) :][:piece])
            setattr(result, figure, len(slots) * piece / (time.perf_counter() - t) / GIB)
        del pool  # (before the client's mapping closes)
    return result


@contextlib.contextmanager
def system_setting(path: Path, value: str | None) -> Iterator[None]:
    """Write `value` into a sysfs/procfs file for the block (root), then restore it."""
    if value is None:
        yield
        return
    text = path.read_text()
    before = text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()
    path.write_text(value)
    try:
        yield
    finally:
        path.write_text(before)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2GiB", help="pool size (default 2GiB)")
    parser.add_argument("--rounds", type=int, default=5, help="round-robin rounds; the best one counts (default 5)")
    parser.add_argument("--modes", default="4k,thp,hugetlb", help="pool_pages modes to compare")
    parser.add_argument("--numa", default="unset,0,interleave", help="NUMA placements to compare")
    parser.add_argument("--reserve-hugepages", action="store_true", help="(root) raise vm.nr_hugepages for the run")
    parser.add_argument("--thp-shmem", metavar="MODE", help="(root) set transparent_hugepage/shmem_enabled for the run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    size = parse_size(args.size)
    modes = [PoolPages(m) for m in args.modes.split(",")]
    placements = [NumaPlacement.parse(n) for n in args.numa.split(",")]
    src = np.random.default_rng(0).integers(0, 255, 64 * MIB, dtype=np.uint8)

    huge_needed = 0
    if args.reserve_hugepages and PoolPages.HUGETLB in modes:
        huge_needed = max(0, size // memory.HUGE_PAGE_BYTES - memory.free_huge_pages(None))
    nr = Path("/proc/sys/vm/nr_hugepages")
    nr_value = str(int(nr.read_text()) + huge_needed) if huge_needed else None
    print(
        f"pool {format_size(size)}; NUMA nodes {memory.numa_nodes()}; THP shmem_enabled "
        f"{memory.thp_shmem_mode()!r}{' -> ' + repr(args.thp_shmem) if args.thp_shmem else ''}; free huge pages "
        f"{memory.free_huge_pages(None)}{f' (+{huge_needed} reserved for the run)' if huge_needed else ''}; "
        f"load average {load_average():.1f}"
    )
    configs = [(pages, numa) for pages in modes for numa in placements]
    rounds: dict[tuple, list[Result]] = {c: [] for c in configs}
    with system_setting(memory.THP_SHMEM, args.thp_shmem), system_setting(nr, nr_value):
        order = np.random.default_rng(2)
        for _ in range(args.rounds):
            for index in order.permutation(len(configs)):
                pages, numa = configs[index]
                done = rounds[(pages, numa)]
                if not (done and done[0].error):  # (a configuration this machine refuses is tried once)
                    done.append(measure(size, pages, numa, src))
    results = [best(rounds[c]) for c in configs]

    base = next((r for r in results if r.mode == "4k" and r.numa == "unset" and not r.error), None)

    def cell(r: Result, value: float, ref: float, fmt: str) -> str:
        text = fmt.format(value)
        return f"{text} ({value / ref:.2f}x)" if base is not None and ref else text

    table = [["pages", "numa", "populate GiB/s (best, median)", "client attach s", "page tables/GiB"]]
    table[0] += ["copy 2 MiB GiB/s", "copy 64 KiB GiB/s", "in 2 MiB pages"]
    for r in results:
        if r.error:
            table.append([r.mode, r.numa, "-", "-", "-", "-", "-", "-"])
            continue
        b = base or r
        populate = cell(r, r.populate_gib_s, b.populate_gib_s, "{:.2f}")
        populate += f" med {statistics.median(r.samples['populate_gib_s']):.2f}"
        attach, pte = cell(r, r.attach_s, b.attach_s, "{:.3f}"), format_size(int(r.pte_bytes_per_gib))
        copies = [cell(r, getattr(r, f), getattr(b, f), "{:.2f}") for f in ("copy_chunk_gib_s", "copy_piece_gib_s")]
        table.append([r.mode, r.numa, populate, attach, pte, *copies, f"{100 * r.huge_bytes / size:.0f}%"])
    print_aligned(table, right={2, 3, 4, 5, 6, 7})
    for r in results:
        if r.error:
            print(f"  * {r.mode} / numa {r.numa}: {r.error}")
    if args.json:
        sampled = [r for r in results if r.samples]
        medians = {f"{r.mode}/{r.numa}": {k: statistics.median(v) for k, v in r.samples.items()} for r in sampled}
        doc = {"machine": machine_info(), "size": size, "rounds": args.rounds, "copy_bytes": COPY_BYTES}
        write_json(args.json, doc | {"results": [vars(r) for r in results], "medians": medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
