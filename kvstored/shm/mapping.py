"""Shared-memory mappings: the daemon's pool (a memfd) and client regions (files passed by fd)."""

from __future__ import annotations

import mmap
import os
import stat
from dataclasses import dataclass

import numpy as np


def map_fd(fd: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class SharedPool:
    """The RAM tier's bytes: one memfd, mapped once here and by every client session.

    A memfd has no path: clients get it over the session socket, so access follows the
    socket's permissions, and the memory goes away with the last process that maps it.
    """

    def __init__(self, size: int, populate: bool) -> None:
        self.size = size
        self.fd = os.memfd_create("kvstored-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._map = map_fd(self.fd, size, populate)
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def close(self) -> None:
        del self.array
        try:
            self._map.close()
        except BufferError:  # a copy still holds a view; the kernel frees it at exit
            pass
        os.close(self.fd)


@dataclass
class Region:
    """A client's shared-memory file, mapped into the daemon."""

    region_id: int
    name: str
    size: int
    array: np.ndarray
    _map: mmap.mmap

    @classmethod
    def from_fd(cls, region_id: int, name: str, fd: int) -> "Region":
        """Map `fd` (the caller keeps ownership of it). Raises ValueError for unusable files."""
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"region {name!r} is not a regular file")
        if info.st_size == 0:
            raise ValueError(f"region {name!r} is empty")
        mapped = map_fd(fd, info.st_size, populate=True)
        return cls(region_id, name, info.st_size, np.frombuffer(mapped, dtype=np.uint8), mapped)

    def close(self) -> None:
        del self.array
        try:
            self._map.close()
        except BufferError:
            pass
