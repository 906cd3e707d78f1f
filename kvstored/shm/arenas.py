# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Arenas: the shared-memory files the RAM tier's chunks live in.

Arena 0 is the public pool (SharedPool), handed to every session. Each tenant has an arena of its
own: a sparse memfd handed only to sessions that registered one of the tenant's namespaces, so no
other process has a mapping of its bytes. The daemon maps every arena (it copies for region
transfers, write-downs and promotions).

Memory the RAM tier no longer needs is returned to the kernel here (`PageReleaser`): a punched
hole costs ~0.35 ms per 2 MiB (freeing the pages and removing them from every mapping), so it
runs in a thread of its own, and the pages stay out of the allocator until it is done.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kvstored.shm.allocator import PageRun
from kvstored.shm.mapping import SharedPool, create_arena_memfd, map_fd, punch_hole

log = logging.getLogger(__name__)

PUBLIC_ARENA = 0
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


@dataclass(frozen=True, slots=True)
class Extent:
    """A run of a chunk's bytes in one arena (what clients and the copiers address)."""

    offset: int
    length: int
    arena: int = PUBLIC_ARENA


@dataclass(eq=False)
class Arena:
    arena_id: int
    tenant: str  # "" for the public arena
    fd: int
    size: int
    array: np.ndarray
    view: memoryview = field(init=False)
    _map: mmap.mmap | None = None  # tenant arenas only: the public one is the SharedPool's

    def __post_init__(self) -> None:
        self.view = memoryview(self.array.data)

    def close(self) -> None:
        self.view.release()
        del self.array
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a copy still holds a view: the kernel frees it with the view
                pass
            os.close(self.fd)


class ArenaSet:
    def __init__(self, pool: SharedPool) -> None:
        self._arenas: dict[int, Arena] = {PUBLIC_ARENA: Arena(PUBLIC_ARENA, "", pool.fd, pool.size, pool.array)}
        # Never reused while the pool lives (a hand-over passes it on, see resume_ids): a client
        # maps an arena by pool and id once, so a reused id would leave it on a dead arena.
        self.next_id = 1

    def __len__(self) -> int:
        return len(self._arenas)

    def get(self, arena_id: int) -> Arena:
        return self._arenas[arena_id]

    def view(self, arena_id: int) -> memoryview:
        return self._arenas[arena_id].view

    def array(self, arena_id: int) -> np.ndarray:
        return self._arenas[arena_id].array

    def create(self, tenant: str, size: int) -> Arena:
        """A new sparse arena of `size` bytes for `tenant` (nothing resident until written)."""
        arena_id = self.next_id
        self.next_id += 1
        fd = create_arena_memfd(f"kvstored-arena-{arena_id}", size)
        try:
            mapped = map_fd(fd, size, populate=False)  # populating would allocate the whole arena
        except BaseException:
            os.close(fd)
            raise
        arena = Arena(arena_id, tenant, fd, size, np.frombuffer(mapped, dtype=np.uint8), mapped)
        self._arenas[arena_id] = arena
        return arena

    def adopt(self, arena_id: int, tenant: str, fd: int, size: int) -> Arena:
        """A tenant arena handed over by the previous daemon, under its id there (ids given
        from now on follow the largest). ValueError if the fd is not a sealed memfd of `size`."""
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if arena_id in self._arenas or seals & _SIZE_SEALS != _SIZE_SEALS or os.fstat(fd).st_size != size:
            raise ValueError(f"handed-over arena {arena_id} is not a free id with a sealed memfd of {size} bytes")
        mapped = map_fd(fd, size, populate=False)  # (its written pages are there: faults are cheap)
        arena = Arena(arena_id, tenant, fd, size, np.frombuffer(mapped, dtype=np.uint8), mapped)
        self._arenas[arena_id] = arena
        self.next_id = max(self.next_id, arena_id + 1)
        return arena

    def resume_ids(self, next_id: int) -> None:
        """Ids from `next_id` on: the previous daemon gave every id below it out on this pool
        (arenas it removed included), and its clients may still map them."""
        self.next_id = max(self.next_id, next_id)

    def tenant_arenas(self) -> list[Arena]:
        return [a for i, a in sorted(self._arenas.items()) if i != PUBLIC_ARENA]

    def remove(self, arena_id: int) -> None:
        if arena_id == PUBLIC_ARENA:
            raise ValueError("the public arena is the pool's")
        self._arenas.pop(arena_id).close()

    def close(self) -> None:
        """Unmap the tenant arenas (the public pool is closed by its owner)."""
        for arena_id in [a for a in self._arenas if a != PUBLIC_ARENA]:
            self.remove(arena_id)
        self._arenas[PUBLIC_ARENA].view.release()


Released = Callable[[int, list[PageRun], bool], None]  # (arena, runs, returned to the kernel)


class PageReleaser:
    """Returns arena pages to the kernel in a thread; tells `done` on the event loop."""

    def __init__(self, arenas: ArenaSet, page_bytes: int, done: Released) -> None:
        self._arenas = arenas
        self._page_bytes = page_bytes
        self._done = done
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvstored-release")
        self._pending: set[asyncio.Future] = set()
        self.released_bytes = 0

    def release(self, arena_id: int, runs: list[PageRun]) -> None:
        fd, pb = self._arenas.get(arena_id).fd, self._page_bytes
        spans = [(run.start * pb, run.count * pb) for run in runs]
        future = asyncio.get_running_loop().run_in_executor(self._executor, _punch_all, fd, spans)
        self._pending.add(future)
        future.add_done_callback(lambda f: self._finished(f, arena_id, runs))

    def _finished(self, future: asyncio.Future, arena_id: int, runs: list[PageRun]) -> None:
        self._pending.discard(future)
        returned = not future.cancelled() and future.exception() is None
        if not returned and not future.cancelled():
            log.warning("cannot return arena %d's free pages to the kernel: %s", arena_id, future.exception())
        if returned:
            self.released_bytes += sum(run.count for run in runs) * self._page_bytes
        self._done(arena_id, runs, returned)

    async def close(self) -> None:
        """Wait for releases in flight (their arenas stay open until then)."""
        self._executor.shutdown(wait=False)
        if self._pending:
            await asyncio.wait(self._pending)


def _punch_all(fd: int, spans: list[tuple[int, int]]) -> None:
    for offset, length in spans:
        punch_hole(fd, offset, length)
