# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Staging memory: where a region load reads a chunk from a lower tier when RAM has no free room.

The tier reads the chunk into staging pages and verifies it there; one guarded copy then puts it
in the client's region. A load through staging evicts nothing and writes nothing down, and the
region never holds unverified bytes (reading straight into it would verify memory the client
can truncate under the daemon, a SIGBUS). One anonymous mapping of `budget_bytes`, cut into
4 KiB pages by the pool's page allocator. A take never waits (a load waiting for pages while
holding others could wait on another load doing the same): a load takes what is free, and waits
for pages to come back only while it holds none. Bookkeeping only: the event loop calls it, the
tiers' I/O fills the pages.
"""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstored.shm.allocator import PageAllocator, PageRun
from kvstored.shm.arenas import Extent

PAGE_BYTES = 4096  # O_DIRECT's alignment: tiers read into the pages as they are


@dataclass(frozen=True, eq=False)
class StagingSlot:
    """Pages holding one chunk of `size` bytes."""

    runs: tuple[PageRun, ...]
    size: int


class Staging:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < PAGE_BYTES:
            raise ValueError(f"staging needs at least one page ({PAGE_BYTES} bytes), got {budget_bytes}")
        pages = budget_bytes // PAGE_BYTES
        self.capacity_bytes = pages * PAGE_BYTES
        self._map = mmap.mmap(-1, self.capacity_bytes)  # touched on first use only
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self._view = memoryview(self._map)
        self._pages = PageAllocator(pages, resident=False)
        self._returned = asyncio.Event()  # set whenever pages come back

    @property
    def used_bytes(self) -> int:
        return (self._pages.total_pages - self._pages.free_pages) * PAGE_BYTES

    def holds(self, size: int) -> bool:
        """Whether chunks of `size` bytes are staged: at most half of staging each, so a load that
        waits for pages is never starved by loads of smaller chunks taking them one by one."""
        return _pages(size) <= self._pages.total_pages // 2

    def try_take(self, size: int) -> StagingSlot | None:
        """Pages for a chunk of `size` bytes, if enough are free now."""
        runs = self._pages.allocate(_pages(size))
        return StagingSlot(tuple(runs), size) if runs is not None else None

    def wait_for_room(self) -> Coroutine[Any, Any, Any]:
        """Until some pages come back (then try_take again). Armed when called, not when first
        awaited: pages given back before the awaiting task first runs still wake it."""
        self._returned.clear()
        return self._returned.wait()

    def give(self, slot: StagingSlot) -> None:
        """Give pages back; nothing may touch them any more."""
        self._pages.free(list(slot.runs))
        self._returned.set()

    def give_when(self, slot: StagingSlot, free: asyncio.Future) -> None:
        """Give pages back once `free` is done (a transfer into them that could not be stopped)."""
        free.add_done_callback(lambda _: self.give(slot))

    def views(self, slot: StagingSlot) -> list[memoryview]:
        """The slot's whole pages (page-aligned, page-multiple lengths: what tiers read into)."""
        return [self._view[r.start * PAGE_BYTES : (r.start + r.count) * PAGE_BYTES] for r in slot.runs]

    def extents(self, slot: StagingSlot) -> list[Extent]:
        """The chunk's bytes in `array`, in order (what the copier copies out)."""
        out, remaining = [], slot.size
        for run in slot.runs:
            length = min(run.count * PAGE_BYTES, remaining)
            out.append(Extent(run.start * PAGE_BYTES, length))
            remaining -= length
        return out

    def close(self) -> None:
        if self._map.closed:
            return
        self._view.release()
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:  # a read still holds a view: the mapping goes with the last one
            pass


def _pages(size: int) -> int:
    return max(1, -(-size // PAGE_BYTES))
