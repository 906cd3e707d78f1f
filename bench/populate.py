# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""How fast a fresh pool is populated by 1 thread (the baseline) and by several (up to the daemon's default),
per page mode; ratios against 1 thread in the same run.

Not a test. Each round makes a fresh pool (a memfd, as the daemon and bench.pool do) and populates it with
1 thread (what the daemon did before it used several), then 2, 4, ...; GiB/s is the best and the median of the
rounds. Results: docs/benchmarks.md#populating-the-pool.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.lib.report import GIB, load_average, print_aligned
from bench.pool import fresh_pool
from kvstored.shm import memory
from kvstored.shm.memory import PoolMemoryError, PoolPages
from kvstored.sizes import parse_size


def one(size: int, pages: PoolPages, threads: int) -> float:
    with fresh_pool(size, pages) as mem:
        start = time.perf_counter()
        memory.populate(mem, threads=threads)
        return size / (time.perf_counter() - start) / GIB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.populate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", default="2GiB", help="pool size per populate (default 2GiB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pages", default="4k", help="comma-separated page modes: 4k, thp, hugetlb")
    args = parser.parse_args(argv)
    size = parse_size(args.bytes)
    default = memory.populate_threads(None)
    counts = sorted({1, *[n for n in (2, 4, 8) if n <= default], default})
    print(f"pool {args.bytes}, {args.rounds} rounds, daemon default {default} thread(s), load {load_average():.1f}")
    table = [["pages", "threads", "GiB/s best", "median", "x 1 thread"]]
    for mode in (PoolPages(p) for p in args.pages.split(",")):
        rates: dict[int, list[float]] = {n: [] for n in counts}
        try:
            for _ in range(args.rounds):
                for n in counts:  # interleaved, so a busy moment costs every count alike
                    rates[n].append(one(size, mode, n))
        except PoolMemoryError as exc:
            print(f"{mode.value}: {exc}", file=sys.stderr)
            continue
        base = statistics.median(rates[1])
        for n in counts:
            med = statistics.median(rates[n])
            table.append([mode.value, str(n), f"{max(rates[n]):.2f}", f"{med:.2f}", f"{med / base:.2f}"])
    print_aligned(table, right={1, 2, 3, 4})
    return 0


if __name__ == "__main__":
    sys.exit(main())
