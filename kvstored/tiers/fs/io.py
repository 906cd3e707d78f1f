# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Blocking file I/O for the fs tier, run in its thread pool: aligned buffers, vectored reads and
writes that finish partial transfers, opens that never block or follow symlinks, temporary files
with a live-writer lock, unlinks and stats."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import secrets
import stat
import threading
import time
from collections.abc import Sequence

import numpy as np

from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored.chunks.views import advance, as_bytes

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
        if len(view) % ALIGN or address(view) % ALIGN:
            return None
        if len(view) > remaining:
            view = view[:remaining]
        out.append(view)
        remaining -= len(view)
    return out if remaining <= 0 else None


def address(view: memoryview) -> int:
    """Where a byte view's memory starts. ctypes for writable views (a tenth of numpy's cost,
    once per view per I/O), numpy for read-only ones (ctypes refuses them)."""
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


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
    """Unlink a file of our own making (a temporary file, a probe) whose failure changes nothing."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


# unlink(2) errors that leave no file under the name: nothing there, a component that is not a
# directory, or a directory (never taken for a chunk file: not adopted, not read)
_NOTHING_THERE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR})


def unlink_files(paths: list[str]) -> tuple[int, dict[str, OSError]]:
    """Unlink each path: (how many files were removed, the error of each path whose file may still
    be there: EACCES, EROFS, EPERM, EIO...). A path with nothing to remove is no failure."""
    removed, failed = 0, {}
    for path in paths:
        try:
            os.unlink(path)
            removed += 1
        except OSError as exc:
            if exc.errno not in _NOTHING_THERE:
                failed[path] = exc
    return removed, failed


def unlink_if_same(path: str, fd: int) -> bool:
    """Remove `path` if it still names the file open as `fd` (a sharing daemon may have replaced it)."""
    try:
        return remove_if_same(path, os.fstat(fd))
    except OSError:
        return False


def remove_if_same(path: str, seen: os.stat_result) -> bool:
    """Remove the entry at `path` if it is still the one `seen` (same inode): unlink it, or rmdir
    a directory (only an empty one: a tree under a chunk's name is not the tier's to delete)."""
    try:
        there = os.lstat(path)
        if (there.st_dev, there.st_ino) != (seen.st_dev, seen.st_ino):
            return False
        if stat.S_ISDIR(there.st_mode):
            os.rmdir(path)
        else:
            os.unlink(path)
        return True
    except OSError:
        return False


def stat_files(paths: list[str]) -> list[os.stat_result | None]:
    """lstat of each path, None unless it is a regular file (a symlink is never one of ours)."""
    out: list[os.stat_result | None] = []
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        out.append(st if st is not None and stat.S_ISREG(st.st_mode) else None)
    return out


# -- entries that are not regular files ---------------------------------------------------------


class NotRegularFile(Exception):
    """The name holds something other than a regular file: a FIFO, socket, device, directory or
    symlink. Never opened for I/O (a FIFO would block the thread, a directory refuses O_DIRECT)."""

    def __init__(self, path: str, seen: os.stat_result) -> None:
        super().__init__(f"{path} is {describe(seen.st_mode)}, not a regular file")
        self.path = path
        self.seen = seen


def describe(mode: int) -> str:
    for test, what in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return what
    return "a regular file" if stat.S_ISREG(mode) else "an unknown kind of file"


def open_regular(path: str, flags: int, direct: bool = False) -> tuple[int, bool]:
    """Open `path` only if it is a regular file, never blocking: O_NONBLOCK (opening a FIFO for
    reading would wait for a writer forever), O_NOFOLLOW, then fstat. On the regular file one
    fcntl clears O_NONBLOCK and, with `direct`, turns O_DIRECT on (a syscall per flag would each
    hand the GIL over). (fd, whether O_DIRECT is on: False with `direct` if the filesystem
    refuses it, EINVAL). Raises NotRegularFile, or OSError as open(2) does."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP):
            raise  # (ELOOP: a symlink; ENXIO: a socket or a device without driver)
        seen = os.lstat(path)
        if stat.S_ISREG(seen.st_mode):  # replaced by a file meanwhile: let the caller retry
            raise
        raise NotRegularFile(path, seen) from None
    try:
        seen = os.fstat(fd)
        if not stat.S_ISREG(seen.st_mode):
            raise NotRegularFile(path, seen)
        # F_SETFL sets the status flags (O_APPEND, O_DIRECT, O_NOATIME, O_NONBLOCK...) to those
        # given and ignores the access mode and open-time flags: `flags` is what we want.
        if direct:
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
                return fd, True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    except BaseException:
        os.close(fd)
        raise
    return fd, False


def set_direct(fd: int, on: bool) -> None:
    """Turn O_DIRECT on or off for an open file. EINVAL (turning it on) means the filesystem
    refuses O_DIRECT: the same answer open(O_DIRECT) gives, but only ever about a regular file."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)


# -- temporary files and their writers ----------------------------------------------------------
#
# A write goes to a temporary file renamed into place once complete. A writer killed with -9
# leaves its temporary file behind, and several daemons may share a root, so a start must tell
# the files of dead writers (remove) from those of live ones (keep). The writer holds flock(2) on
# its temporary file for as long as it writes: the kernel drops the lock when the process dies,
# however it dies, so "can I take the lock?" is "is the writer gone?", with no guess. pid +
# start time in the name would be a guess: pids are per pid namespace (two containers sharing a
# root see different ones) and get reused. The lock is taken right after the exclusive create;
# a sweeper that wins that instant unlinks the file while holding the lock, and the writer,
# seeing its file unlinked (st_nlink 0) once it has the lock, starts over under a new name.
# Filesystems without flock (ENOLCK, EOPNOTSUPP: some network filesystems) fall back on age.
# The names carry the pid (for people) and a per-run nonce (unique across pid namespaces).

TMP_SUFFIX = ".tmp"  # temporary files are ".<key hex>.<pid>.<nonce>.<n>.tmp", next to their final name
_RUN_NONCE = secrets.token_hex(4)
_TMP_SEQ = itertools.count()  # next() is atomic under the GIL: unique temporary names per process
_CREATE_TRIES = 4
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


def tmp_name(final: str) -> str:
    """A fresh temporary name next to `final` (a path ending in .kv)."""
    directory, name = os.path.split(final)
    return os.path.join(directory, f".{name[:-3]}.{os.getpid()}.{_RUN_NONCE}.{next(_TMP_SEQ)}{TMP_SUFFIX}")


def create_tmp(final: str, mode: int = 0o600) -> tuple[int, str]:
    """Create and lock a new temporary file for `final`; (fd, path). The lock lives as long as
    the fd: close it only after the rename (or the unlink)."""
    for _ in range(_CREATE_TRIES):
        tmp = tmp_name(final)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a sweeper judged it abandoned this very instant: it unlinks it
            os.close(fd)
            continue
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                os.close(fd)
                unlink_quiet(tmp)
                raise
            return fd, tmp  # no locks here: sweepers go by age
        if os.fstat(fd).st_nlink == 0:  # ...and did, before we had the lock
            os.close(fd)
            continue
        return fd, tmp
    raise OSError(errno.EAGAIN, "temporary files keep being removed under the writer", final)


def is_tmp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def remove_if_abandoned(path: str, stale_s: float) -> bool:
    """Remove a temporary file that no live writer holds (True if removed). Where the filesystem
    has no locks, one older than `stale_s` counts as abandoned. Anything but a regular file under
    a temporary name is nobody's write: removed without being opened for I/O."""
    try:
        fd, _ = open_regular(path, os.O_RDONLY)
    except NotRegularFile as exc:
        return remove_if_same(path, exc.seen)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live writer holds it
        except OSError as exc:
            if exc.errno not in _NO_LOCKS or time.time() - os.fstat(fd).st_mtime <= stale_s:
                return False
        return unlink_if_same(path, fd)  # (still holding the lock: see create_tmp)
    finally:
        os.close(fd)


def make_dirs(path: str | os.PathLike[str], mode: int) -> None:
    """os.makedirs giving every directory it creates `mode` (os.makedirs: only the last one)."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.isdir(parent):
        make_dirs(parent, mode)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
