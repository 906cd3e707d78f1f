# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Shared-memory mappings: the daemon's pool (a memfd) and client regions (files passed by fd)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstored.errors import InvalidRequest, RegionFileMissing, RegionNotAllowed
from kvstored.shm import memory
from kvstored.shm.beneath import open_beneath
from kvstored.shm.memory import NumaPlacement, PoolPages, PopulateProgress

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
POPULATE_STEP_BYTES = 64 << 20  # a closing region stops its populate within one step
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


# Why mmap refused a client's region fd, in the client's terms.
_MAP_REFUSED: dict[int, str] = {
    errno.EACCES: "its fd must be opened read-write (O_RDWR)",
    errno.EBADF: "its fd is not open for reading and writing (an O_PATH fd?)",
    errno.ENOMEM: "the file is larger than the daemon can map",
    errno.ENODEV: "its filesystem does not support shared mappings",
}


def map_fd(fd: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class SharedPool:
    """The RAM tier's bytes: one memfd, mapped once here and by every client session.

    A memfd has no path: clients get it over the session socket, so access follows the
    socket's permissions, and the memory goes away with the last process that maps it.
    Its pages (4 KiB, THP, hugetlb) and NUMA placement are shm.memory's; populate=True fills it
    here and now, populate=False leaves that to populate() (in steps, with progress and a stop).
    """

    def __init__(
        self,
        size: int,
        populate: bool,
        *,
        pages: PoolPages = PoolPages.SMALL,
        numa: NumaPlacement | None = None,
        adopt_fd: int | None = None,
    ) -> None:
        """adopt_fd: the pool memfd of the previous daemon (a hand-over), instead of a new one."""
        if adopt_fd is None:
            self.memory = memory.create_memfd(size, pages, numa)
        else:
            self.memory = memory.adopt_memfd(adopt_fd, size, pages, numa)
        self.size = size
        self.fd = self.memory.fd
        self._map = self.memory.mapping
        try:
            if populate:
                memory.populate(self.memory)
        except BaseException:
            self._map.close()
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def populate(
        self,
        progress: Callable[[PopulateProgress], None] | None = None,
        stop: threading.Event | None = None,
        threads: int | None = None,
    ) -> bool:
        """Fill every page (blocking: run it in a thread; it starts `threads` - 1 more, default
        memory.populate_threads); False if `stop` ended it first."""
        return memory.populate(self.memory, progress, stop, threads=threads)

    def huge_page_bytes(self) -> int:
        """How much of the pool the kernel backs with 2 MiB pages now."""
        return memory.huge_page_bytes(self.memory)

    def close(self) -> None:
        del self.array
        try:
            self._map.close()
        except BufferError:  # a copy still holds a view; the kernel frees it at exit
            pass
        os.close(self.fd)


def create_arena_memfd(name: str, size: int) -> int:
    """A sparse memfd of `size` bytes for a tenant arena: no page is allocated until written,
    and its size is sealed like the pool's (clients get it read-write)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Return a byte range of a memfd to the kernel (it reads as zeros, and is allocated again by
    its next write). Removes the pages from every process's mapping: never for pages in use."""
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length):
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def open_region_file(path: str, allowed_dirs: Sequence[Path]) -> int:
    """Open a region file named by a client, read-write. Only regular files under `allowed_dirs`
    may be named: anyone allowed on the socket must not be able to make the daemon read or write
    its other files. (Passing an fd needs no such rule: the client proves access by opening it.)

    The path is resolved once only to learn which allowed directory it names and the name
    beneath it; that is no check. The check is the open itself: beneath a descriptor of that
    directory, with no symlink on the way (beneath.open_beneath), so a directory swapped for a
    symlink meanwhile makes the open fail instead of leading outside. O_NONBLOCK: a FIFO under
    the name must not block the daemon; it is refused by the fstat that follows."""
    if "\0" in path:
        raise InvalidRequest("region path contains a NUL byte")
    try:
        real = os.path.realpath(path)
    except OSError:  # a symlink on the way changed while it was read: someone is racing us
        raise _not_allowed(path, allowed_dirs, _RACED) from None
    for directory in allowed_dirs:
        relpath = os.path.relpath(real, directory)
        if relpath != ".." and not relpath.startswith("../"):
            break
    else:
        raise _not_allowed(path, allowed_dirs)
    try:
        dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidRequest(f"cannot open the region directory {str(directory)!r}: {exc.strerror}") from None
    try:
        fd = open_beneath(dir_fd, relpath, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise RegionFileMissing(f"region file {path!r} does not exist") from None
    except OSError as exc:
        if exc.errno in (errno.EXDEV, errno.ELOOP):
            raise _not_allowed(path, allowed_dirs, _RACED) from None
        if exc.errno in (errno.EISDIR, errno.ENXIO):  # a directory; a socket or a device without driver
            raise InvalidRequest(f"region file {path!r} is not a regular file") from None
        raise InvalidRequest(f"cannot open region file {path!r}: {exc.strerror}") from None
    finally:
        os.close(dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidRequest(f"region file {path!r} is not a regular file")
    return fd


_RACED = " (a symlink appeared on its way while it was opened)"


def _not_allowed(path: str, allowed_dirs: Sequence[Path], why: str = "") -> RegionNotAllowed:
    return RegionNotAllowed(
        f"region file {path!r} is outside the allowed directories ({', '.join(map(str, allowed_dirs))}){why}; "
        f"pass an open fd over the session socket instead"
    )


@dataclass
class Region:
    """A client's shared-memory file, mapped into the daemon."""

    region_id: int
    name: str
    size: int
    array: np.ndarray
    _map: mmap.mmap
    _fd: int  # our own dup, to notice a file that shrank
    _stop_populating: threading.Event = field(default_factory=threading.Event)
    closed: bool = False  # its session ended: transfers still running copy no more into it

    @classmethod
    def from_fd(cls, region_id: int, name: str, fd: int) -> Region:
        """Map `fd` (the caller keeps ownership of it). Raises ValueError for unusable files."""
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"region {name!r} is not a regular file")
        if info.st_size == 0:
            raise ValueError(f"region {name!r} is empty")
        # Not populated here: a region of tens of GiB would stall the event loop for seconds.
        # populate() fills the page tables in steps instead (first copies fault pages in meanwhile).
        try:
            mapped = map_fd(fd, info.st_size, populate=False)
        except OSError as exc:
            why = _MAP_REFUSED.get(exc.errno or 0) or exc.strerror
            raise ValueError(f"region {name!r} cannot be mapped: {why}") from None
        own = os.dup(fd)
        return cls(region_id, name, info.st_size, np.frombuffer(mapped, dtype=np.uint8), mapped, own)

    def populate(self) -> None:
        """Fill the daemon's page tables for the region (first copies into an unpopulated mapping
        ran 25-40% slower), in steps, without the GIL: run it in a thread. It holds a view of
        the mapping, so close() leaves the unmapping to whichever of the two ends last."""
        info = os.fstat(self._fd)
        if info.st_blocks * 512 < info.st_size:
            return  # sparse: populating would allocate the client's holes (memory it never used)
        view = memoryview(self._map)
        try:
            address = ctypes.addressof(ctypes.c_char.from_buffer(view))
            for offset in range(0, self.size, POPULATE_STEP_BYTES):
                if self._stop_populating.is_set():
                    return
                length = min(POPULATE_STEP_BYTES, self.size - offset)
                if _libc.madvise(ctypes.c_void_p(address + offset), ctypes.c_size_t(length), MADV_POPULATE_WRITE):
                    return  # an older kernel (EINVAL) or a file that shrank: faults will do
        finally:
            view.release()

    def current_size(self) -> int:
        """The file's size now: transfers check it first (and copies are guarded against a
        file that shrinks while they run, see shm/copy.py)."""
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop_populating.set()
        del self.array
        os.close(self._fd)
        try:
            self._map.close()
        except BufferError:
            pass
