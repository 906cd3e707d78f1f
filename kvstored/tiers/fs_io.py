"""Blocking file I/O for the fs tier, run in its thread pool: aligned buffers, vectored reads and
writes that finish partial transfers, unlinks and stats."""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading
from typing import Sequence

import numpy as np

from kvstored.tiers.chunkfile import HEADER_BYTES
from kvstored.tiers.views import as_bytes

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffer addresses
_IOV_MAX = 1024
_local = threading.local()


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def header_buffer() -> memoryview:
    """This thread's page-aligned header buffer (anonymous mmaps are page-aligned)."""
    buf = getattr(_local, "header", None)
    if buf is None:
        buf = _local.header = memoryview(mmap.mmap(-1, HEADER_BYTES))
    return buf





def direct_buffers(views: Sequence[memoryview], size: int) -> list[memoryview] | None:
    """The views cut to `size` rounded up to whole pages, if O_DIRECT can use them as they are."""
    out, remaining = [], round_up(size)
    for view in views:
        if remaining <= 0:
            break
        view = as_bytes(view)
        if not len(view):
            continue
        if len(view) % ALIGN or np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN:
            return None
        if len(view) > remaining:
            view = view[:remaining]
        out.append(view)
        remaining -= len(view)
    return out if remaining <= 0 else None


def advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    i = 0
    while i < len(bufs) and n >= len(bufs[i]):
        n -= len(bufs[i])
        i += 1
    rest = bufs[i:]
    if n:
        rest[0] = rest[0][n:]
    return rest


def pwritev_all(fd: int, bufs: list[memoryview]) -> int:
    offset = 0
    while bufs:
        n = os.pwritev(fd, bufs[:_IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset += n
        bufs = advance(bufs, n)
    return offset


def preadv_all(fd: int, bufs: list[memoryview], direct: bool = False) -> int:
    """Read into bufs until they are full or the file ends, at most _IOV_MAX buffers per call
    (more is EINVAL). With O_DIRECT (`direct`), a count that is not whole pages is the end of
    the file: reading on would start at an unaligned offset, which O_DIRECT refuses."""
    offset = 0
    while bufs:
        n = os.preadv(fd, bufs[:_IOV_MAX], offset)
        if n <= 0:
            break
        offset += n
        if direct and n % ALIGN:
            break
        bufs = advance(bufs, n)
    return offset


def unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def unlink_files(paths: list[str]) -> int:
    return sum(unlink_quiet(p) for p in paths)


def unlink_if_same(path: str, fd: int) -> None:
    """Remove `path` if it still names the file open as `fd` (a sharing daemon may have replaced it)."""
    try:
        mine, there = os.fstat(fd), os.stat(path)
    except OSError:
        return
    if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
        unlink_quiet(path)


def stat_files(paths: list[str]) -> list[os.stat_result | None]:
    out: list[os.stat_result | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            st = None
        out.append(st if st is not None and stat.S_ISREG(st.st_mode) else None)
    return out
