# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Region <-> pool copies on a small thread pool, a large batch split across its threads.

One core's memcpy reaches a fraction of a node's memory bandwidth, so a batch of chunks is cut
into parts of whole extents, one per thread. A copy is never abandoned half-way: when the caller is
cancelled (an RPC deadline), `run` still waits for every part before it re-raises, because the
caller then frees the pool pages those threads are writing or reading.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstored.shm.copy import copy as guarded_copy
from kvstored_client.copy_policy import MIN_PART_BYTES, daemon_copy_threads

if TYPE_CHECKING:
    from kvstored.shm.arenas import Extent

# One split policy for the daemon's copier and the client's (see kvstored_client.copy_policy).
default_copy_threads = daemon_copy_threads


@dataclass(frozen=True, slots=True)
class CopyJob:
    """One chunk: its bytes at `region_offset` in the region, in `extents` of the pool."""

    region_offset: int
    extents: Sequence[Extent]


class Copier:
    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"copy threads must be >= 1, got {threads}")
        self.threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvstored-copy")

    async def run(self, region: np.ndarray, pool: np.ndarray, jobs: list[CopyJob], to_pool: bool) -> None:
        """Copy every job; returns (or raises the first error, e.g. MappingVanished) only once no
        thread touches `region` or `pool` for these jobs any more."""
        if not jobs:
            return
        loop = asyncio.get_running_loop()
        futures = [
            loop.run_in_executor(self._executor, _copy_part, region, pool, part, to_pool)
            for part in split(jobs, self.threads)
        ]
        cancelled = False
        while not all(f.done() for f in futures):
            try:
                await asyncio.wait(futures)
            except asyncio.CancelledError:
                cancelled = True
        errors = [exc for f in futures if (exc := f.exception()) is not None]
        if cancelled:
            raise asyncio.CancelledError()
        if errors:
            raise errors[0]

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def split(jobs: list[CopyJob], parts: int) -> list[list[CopyJob]]:
    """Consecutive runs of jobs with about equal bytes, at most `parts`, none under MIN_PART_BYTES
    (unless there is only one)."""
    sizes = [sum(e.length for e in job.extents) for job in jobs]
    total = sum(sizes)
    parts = max(1, min(parts, len(jobs), total // MIN_PART_BYTES))
    if parts == 1:
        return [jobs]
    target = total / parts
    out: list[list[CopyJob]] = [[]]
    filled = 0
    for job, size in zip(jobs, sizes):
        if filled >= target * len(out) and len(out) < parts:
            out.append([])
        out[-1].append(job)
        filled += size
    return out


def _copy_part(region: np.ndarray, pool: np.ndarray, jobs: list[CopyJob], to_pool: bool) -> None:
    for job in jobs:
        offset = job.region_offset
        for ext in job.extents:
            pool_part = pool[ext.offset : ext.offset + ext.length]
            region_part = region[offset : offset + ext.length]
            if to_pool:
                guarded_copy(pool_part, region_part)
            else:
                guarded_copy(region_part, pool_part)
            offset += ext.length
