# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Open a file strictly beneath a directory, with no symlink anywhere on the way, in one step.

Checking a path (realpath, then "is it under the allowed directory?") and opening it afterwards
is a race: a directory on the way can be swapped for a symlink in between. Here the kernel does
the check while it resolves: openat2(2) with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS relative to a
descriptor of the directory (Linux 5.6+). Where openat2 is missing (ENOSYS: older kernels,
some seccomp profiles), the same guarantee comes from walking the path one component at a time
with openat(2) and O_NOFOLLOW from descriptor to descriptor: no name is ever looked up twice.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat

# openat2 has the same number on every architecture (it came after the syscall tables merged).
SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
_EAGAIN_RETRIES = 8  # openat2 says EAGAIN when a rename raced a ".." check: retrying is the fix


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_openat2_works: bool | None = None if platform.system() == "Linux" else False  # None: not tried yet


def open_beneath(dir_fd: int, relpath: str, flags: int, *, use_openat2: bool | None = None) -> int:
    """Open `relpath` relative to the directory `dir_fd`, refusing anything that would leave it or
    pass through a symlink. Raises OSError like open(2); escapes and symlinks raise EXDEV or ELOOP.

    `use_openat2` forces one implementation (tests); by default openat2 where the kernel has it."""
    if not relpath or os.path.isabs(relpath):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), relpath)
    if use_openat2 is None:
        use_openat2 = openat2_supported(dir_fd)
    return _openat2(dir_fd, relpath, flags) if use_openat2 else _open_walk(dir_fd, relpath, flags)


def openat2_supported(dir_fd: int) -> bool:
    """Whether openat2 works here, probed once with a harmless call (a seccomp profile may answer
    ENOSYS or EPERM for syscalls it does not know; a real open can fail with EPERM too)."""
    global _openat2_works
    if _openat2_works is None:
        try:
            os.close(_openat2(dir_fd, ".", os.O_PATH | os.O_DIRECTORY))
            _openat2_works = True
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EPERM):
                return True  # something else is wrong (the caller's fd?): the real call will say
            _openat2_works = False
    return _openat2_works


def _openat2(dir_fd: int, relpath: str, flags: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE)
    path = os.fsencode(relpath)
    for _ in range(_EAGAIN_RETRIES):
        fd = _libc.syscall(SYS_OPENAT2, dir_fd, path, ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EINTR):
            break
    raise OSError(err, os.strerror(err), relpath)


def _open_walk(dir_fd: int, relpath: str, flags: int) -> int:
    """openat one component at a time: each directory as an O_PATH | O_NOFOLLOW descriptor
    checked with fstat (a symlink is refused, never followed), '..' refused outright."""
    parts = [p for p in relpath.split("/") if p not in ("", ".")] or ["."]
    if ".." in parts:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), relpath)
    current = dir_fd
    try:
        for name in parts[:-1]:
            step = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
            if current != dir_fd:
                os.close(current)
            current = step
            mode = os.fstat(current).st_mode
            if stat.S_ISLNK(mode):
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), relpath)
            if not stat.S_ISDIR(mode):
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), relpath)
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
    finally:
        if current != dir_fd:
            os.close(current)
