# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Buffers, chunk ids, the timing loops and the tier/baseline table shared by the tiers benchmark."""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.lib.buffers import aligned_pool
from bench.lib.daemons import stat_cpu_seconds
from bench.lib.report import GIB, print_aligned
from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored.tiers.base import WriteOutcome

PAGE = mmap.PAGESIZE


class Pool:
    """A populated anonymous mapping (page-aligned, like the daemon's pool) cut into chunk views."""

    def __init__(self, chunks: int, chunk_bytes: int) -> None:
        self._map = aligned_pool(chunks * chunk_bytes)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        whole = memoryview(self._map)
        self.views = [whole[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(chunks)]


def chunk_ids(n: int, seed: str) -> list[tuple[str, bytes]]:
    """Content-hash-like keys (32 bytes, spread uniformly over the fs tier's fan-out directories)."""
    return [("bench", hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=32).digest()) for i in range(n)]


def header_pages(chunks: Sequence[tuple[str, bytes]], views: Sequence[memoryview], size: int) -> list[memoryview]:
    """Each chunk's chunkfile header in its own page-aligned page (what the raw baselines write)."""
    out = []
    for chunk, view in zip(chunks, views):
        page = mmap.mmap(-1, HEADER_BYTES)
        page[:] = chunkfile.encode_header(chunk, size, chunkfile.checksum([view], size))
        out.append(memoryview(page))
    return out


async def drive(n: int, inflight: int, op: Callable[[int], Awaitable[None]]) -> float:
    """Run op(0..n-1) with `inflight` worker tasks (the daemon's queue concurrency); wall seconds."""
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            await op(i)

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(min(inflight, n)):
            group.create_task(worker())
    return time.perf_counter() - t0


def on_loop(runner: asyncio.Runner, phase: Callable[..., Coroutine[Any, Any, float]], *args) -> Callable[[], float]:
    """A phase that runs phase(*args) on the runner's event loop; it returns its wall seconds."""
    return lambda: runner.run(phase(*args))


async def tier_store(tier, chunks, views, size: int, inflight: int) -> float:
    async def op(i: int) -> None:
        if (outcome := await tier.write(chunks[i], [views[i]], size)) is not WriteOutcome.WRITTEN:
            raise RuntimeError(f"{tier.kind.name} tier write {i}: {outcome} (counters {tier.counters})")

    return await drive(len(chunks), inflight, op)


async def tier_load(tier, chunks, views, size: int, inflight: int) -> float:
    async def op(i: int) -> None:
        if not await tier.read(chunks[i], [views[i]], size):
            raise RuntimeError(f"{tier.kind.name} tier read {i}: miss or corrupt (counters {tier.counters})")

    return await drive(len(chunks), inflight, op)


@dataclass
class Sample:
    gib_s: float
    cpu_s_per_gib: float  # this process, all threads
    server_cpu_s_per_gib: float | None = None  # the S3 server's processes


def measure(nbytes: int, run: Callable[[], float], server_pids: Sequence[int] = (), prepare=None) -> Sample:
    """Run `prepare` (untimed), then `run` (which returns its wall seconds), counting CPU seconds."""
    if prepare is not None:
        prepare()
    cpu0, srv0 = time.process_time(), stat_cpu_seconds(server_pids)
    wall = run()
    cpu, srv = time.process_time() - cpu0, stat_cpu_seconds(server_pids) - srv0
    gib = nbytes / GIB
    return Sample(gib / wall, cpu / gib, srv / gib if server_pids else None)


def rotated(arms: list, rnd: int) -> list:
    k = rnd % len(arms)
    return arms[k:] + arms[:k]


def _median(samples: Sequence[Sample], what: str = "gib_s") -> float:
    return statistics.median(getattr(s, what) or 0.0 for s in samples)


@dataclass
class Pair:
    """One measurement: the tier and its baseline, one Sample per round each."""

    name: str
    target: float | None  # None: diagnostic row
    tier: list[Sample] = field(default_factory=list)
    raw: list[Sample] = field(default_factory=list)
    limit: list[Sample] = field(default_factory=list)  # the physical limit (default: raw)

    @property
    def ratio(self) -> float:
        return _median(self.tier) / _median(self.raw)

    @property
    def status(self) -> str:
        return "(info)" if self.target is None else "PASS" if self.ratio >= self.target else "MISS"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tier_gib_s": _median(self.tier),
            "raw_gib_s": _median(self.raw),
            "limit_gib_s": _median(self.limit or self.raw),
            "ratio": self.ratio,
            "target": self.target,
            "status": self.status,
            "tier_samples": [vars(s) for s in self.tier],
            "raw_samples": [vars(s) for s in self.raw],
            "paired_ratios": [t.gib_s / r.gib_s for t, r in zip(self.tier, self.raw)],
        }


def print_pairs(pairs: Sequence[Pair]) -> None:
    table = [["measurement", "tier GiB/s", "baseline GiB/s", "ratio", "target", "result", "limit GiB/s", "of limit"]]
    for p in pairs:
        tier, raw, limit = _median(p.tier), _median(p.raw), _median(p.limit or p.raw)
        target = f">= {p.target:.2f}x" if p.target is not None else "-"
        table.append([p.name, f"{tier:.2f}", f"{raw:.2f}", f"{p.ratio:.2f}x", target, p.status, f"{limit:.2f}"])
        table[-1].append(f"{tier / limit:.2f}x")
    print_aligned(table, right={1, 2, 3, 6, 7})
    print("baseline and limit of each row: docs/benchmarks.md#tiers")
    print("per round: tier/raw GiB/s = paired ratio; CPU s per GiB (this process, tier/raw[; S3 server tier/raw]):")
    for p in pairs:
        rounds = ", ".join(f"{t.gib_s:.2f}/{r.gib_s:.2f}={t.gib_s / r.gib_s:.2f}" for t, r in zip(p.tier, p.raw))
        cpu = f"cpu {_median(p.tier, 'cpu_s_per_gib'):.2f}/{_median(p.raw, 'cpu_s_per_gib'):.2f}"
        if p.tier and p.tier[0].server_cpu_s_per_gib is not None:
            srv = "server_cpu_s_per_gib"
            cpu += f"; server {_median(p.tier, srv):.2f}/{_median(p.raw, srv):.2f}"
        print(f"  {p.name}: {rounds}  ({cpu})")


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def describe(exc: BaseException) -> str:
    """An exception in one line (the first of a TaskGroup's)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
