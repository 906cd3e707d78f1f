# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Buffers the benchmarks time copies into and out of: populated (fresh pages run ~10x slower),
with content that tells chunks apart."""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np


def populate(arr: np.ndarray) -> np.ndarray:
    """Write every page so that timed copies never take first-touch faults."""
    arr.view(np.uint8)[:: mmap.PAGESIZE] = 0
    arr.view(np.uint8)[-1:] = 0
    return arr


def aligned_pool(nbytes: int) -> mmap.mmap:
    """A populated anonymous mapping: page-aligned, as O_DIRECT needs and as the daemon's pool is."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    populate(np.frombuffer(buf, dtype=np.uint8))
    return buf


def fill_pattern(arr: np.ndarray, chunk_bytes: int, seed: int) -> None:
    """Distinct, cheap content per chunk (so a chunk landing in the wrong place is detected)."""
    flat = arr.view(np.uint8).reshape(-1)
    base = np.arange(chunk_bytes // 8, dtype=np.uint64)
    for c in range(flat.shape[0] // chunk_bytes):
        tag = np.uint64(((seed & 0xFFFF) << 48) | (c << 24))
        np.bitwise_xor(base, tag, out=flat[c * chunk_bytes : (c + 1) * chunk_bytes].view(np.uint64))


def each_batch(spans: Sequence[tuple[int, int]], call: Callable[[int, int], int], errors: list[str], what: str) -> None:
    """call(b0, b1) for each span of chunks b0..b1-1 (a request): it returns how many it moved; fewer is an error."""
    for b0, b1 in spans:
        if (got := call(b0, b1)) != b1 - b0:
            errors.append(f"{what} batch {b0}: {got} of {b1 - b0} chunks")


class ShmFile:
    """A /dev/shm file of `size` bytes, mapped (MAP_POPULATE) and exposed as `.array` (uint8)."""

    def __init__(self, size: int, prefix: str = "kvstored-bench") -> None:
        self.size = size
        fd, path = tempfile.mkstemp(prefix=f"{prefix}-{os.getpid()}-", dir="/dev/shm")
        self.path = Path(path)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self.array = populate(np.frombuffer(self._map, dtype=np.uint8))

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def close(self) -> None:
        self.unlink()
        self.array = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._map.close()
