# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Find the open file behind vLLM's primary CPU region, so the daemon can map it.

vLLM's tiering spec backs its primary tier with `/dev/shm/vllm_offload_<engine_id>.mmap` (mode 0600,
owned by vLLM's user). The daemon runs as its own user and cannot open that path, so the region
reaches it as an open file descriptor over the session socket (SCM_RIGHTS). This module finds that
file for a memoryview without trusting names: the mapping that holds the view's first byte is read
from /proc/self/maps, and a candidate fd is accepted only if it is the same inode.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


class RegionNotShareable(RuntimeError):
    """The buffer is not one shared file mapping the daemon could map (anonymous or split memory)."""


@dataclass(frozen=True)
class RegionFile:
    fd: int  # owned by the caller: close it
    base_offset: int  # file offset of the view's first byte
    size: int  # file size in bytes
    path: str


@dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    file_offset: int
    dev: tuple[int, int]
    inode: int
    path: str

    def same_file(self, st: os.stat_result) -> bool:
        return st.st_ino == self.inode and (os.major(st.st_dev), os.minor(st.st_dev)) == self.dev


def _mappings() -> list[_Mapping]:
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 5:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) == 6 else ""
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            out.append(_Mapping(start, end, int(parts[2], 16), (major, minor), int(parts[4]), path))
    return out


def buffer_address(view: memoryview) -> tuple[int, int]:
    """(address of the first byte, total bytes) of a C-contiguous buffer."""
    arr = np.asarray(view)
    if not arr.flags.c_contiguous:
        raise RegionNotShareable("the primary KV view is not C-contiguous")
    return arr.ctypes.data, arr.nbytes


def region_file(view: memoryview, candidate_fds: Iterable[int] = ()) -> RegionFile:
    """An fd (a new one, owned by the caller) of the file that backs `view` entirely.

    Tries `candidate_fds` first (dup'ed, never taken over), then the mapped path. Raises
    RegionNotShareable when the view spans several mappings or an anonymous one."""
    address, nbytes = buffer_address(view)
    maps = _mappings()
    first = next((m for m in maps if m.start <= address < m.end), None)
    if first is None or first.inode == 0:
        raise RegionNotShareable("the primary KV view is not backed by a shared file")
    # The view must lie in one file, contiguously: consecutive mappings of the same inode at
    # consecutive file offsets (the kernel may split one mmap into several map lines).
    covered, expected_offset = first.end, first.file_offset + (first.end - first.start)
    for m in maps:
        if covered >= address + nbytes:
            break
        if m.start == covered and (m.dev, m.inode) == (first.dev, first.inode) and m.file_offset == expected_offset:
            covered, expected_offset = m.end, m.file_offset + (m.end - m.start)
    if covered < address + nbytes:
        raise RegionNotShareable("the primary KV view spans more than one file (segmented region)")
    base_offset = first.file_offset + (address - first.start)

    for fd in candidate_fds:
        try:
            if first.same_file(os.fstat(fd)):
                dup = os.dup(fd)
                return RegionFile(dup, base_offset, os.fstat(dup).st_size, first.path)
        except OSError:
            continue
    path = first.path.removesuffix(" (deleted)")
    if not path.startswith("/") or first.path.endswith(" (deleted)"):
        raise RegionNotShareable(f"the region file {first.path!r} has no path and no open fd was offered")
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not first.same_file(st):
        os.close(fd)
        raise RegionNotShareable(f"{path} is not the file mapped at the primary KV view")
    return RegionFile(fd, base_offset, st.st_size, path)
