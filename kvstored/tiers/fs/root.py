# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Whether a directory can be an fs tier's root: checked before the daemon populates its RAM
tier (preflight) and again when the tier starts. Blocking: run it on one of the tier's threads.

Refused (RootUnusable, naming the path and the problem): a root under a kernel pseudo filesystem
(/proc, /sys, cgroup...), a root or an ancestor of it that is not a directory, a root that cannot
be created, read or written. A full disk is not refused: the files there are served, the
start-up eviction frees space and writes are refused while it is full.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

from kvstored.tiers.fs import io as fs_io

log = logging.getLogger(__name__)

# Filesystems that hold no files of their own: a write there fails or does something else.
PSEUDO_FILESYSTEMS = frozenset(
    {"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "devpts", "bpf", "pstore"}
)
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# What a probe write may meet that says this root cannot be written at all. Anything else (EIO,
# say) is logged and the start goes on: the files already there are served, writes find out.
_UNWRITABLE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ENOENT})


class RootUnusable(ValueError):
    """An fs tier's root cannot be used; the message names the root and why."""


@dataclass(frozen=True)
class RootCheck:
    direct: bool  # O_DIRECT in use: False when asked for none or the filesystem refuses it
    full: bool  # the probe write found the disk full (the tier starts anyway)

    def describe(self) -> str:
        return f"writable, O_DIRECT {'on' if self.direct else 'off'}{', disk full' if self.full else ''}"


def filesystem_of(path: str) -> str:
    """The type of the filesystem `path` lies on (its longest mount point in /proc/self/mounts);
    "" if that cannot be read."""
    best, kind = "", ""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return ""
    return kind


def check_root(root: str, dir_mode: int, file_mode: int, direct: bool) -> RootCheck:
    """Create `root` if needed and probe it with a temporary file; RootUnusable if it cannot
    serve as a root."""
    real = os.path.realpath(root)
    shown = root if real == os.path.abspath(root) else f"{root} ({real})"
    kind = filesystem_of(real)
    if kind in PSEUDO_FILESYSTEMS or real in ("/proc", "/sys") or real.startswith(("/proc/", "/sys/")):
        raise RootUnusable(f"root {shown} is on {kind or 'a kernel pseudo filesystem'}, not storage")
    _check_ancestors(root, real)
    try:
        fs_io.make_dirs(root, dir_mode)
    except OSError as exc:
        raise RootUnusable(f"root {shown} cannot be created: {exc.strerror}") from None
    if not os.access(root, os.R_OK | os.X_OK):  # (writing: the probe says why not)
        raise RootUnusable(f"root {shown} is not readable by uid {os.geteuid()}")
    return _probe(root, shown, file_mode, direct)


def _check_ancestors(root: str, real: str) -> None:
    """The root, or the nearest part of its path that exists, must be a directory."""
    path = real
    while True:
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):  # (ENOTDIR: a file further up: found next)
            parent = os.path.dirname(path)
            if parent == path:
                return
            path = parent
            continue
        except OSError as exc:
            raise RootUnusable(f"root {root}: cannot look at {path}: {exc.strerror}") from None
        if not os.path.isdir(path):
            what = f"{fs_io.describe(st.st_mode)}, not a directory"
            if path == real:
                raise RootUnusable(f"root {root} is {what}")
            raise RootUnusable(f"root {root}: {path}, on its path, is {what}")
        return


def _probe(root: str, shown: str, file_mode: int, direct: bool) -> RootCheck:
    """Write a page to a temporary file under the root (with O_DIRECT if asked) and remove it."""
    try:
        fd, probe = fs_io.create_tmp(os.path.join(root, "probe.kv"), file_mode)
    except OSError as exc:
        return _probe_failed(shown, direct, exc)
    try:
        if direct:
            try:
                fs_io.set_direct(fd, True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.info("fs tier root %s refuses O_DIRECT; using buffered I/O", shown)
                direct = False
        os.pwrite(fd, fs_io.header_buffer(), 0)
    except OSError as exc:
        if exc.errno == errno.EINVAL and direct:  # the flag was taken, the I/O was not
            log.info("fs tier root %s refuses O_DIRECT writes; using buffered I/O", shown)
            return RootCheck(direct=False, full=False)
        return _probe_failed(shown, direct, exc)
    finally:
        fs_io.unlink_quiet(probe)
        os.close(fd)
    return RootCheck(direct=direct, full=False)


def _probe_failed(shown: str, direct: bool, exc: OSError) -> RootCheck:
    if exc.errno in _FULL_ERRNOS:
        return RootCheck(direct=direct, full=True)
    if exc.errno in _UNWRITABLE_ERRNOS:
        raise RootUnusable(f"root {shown} is not writable: {exc.strerror}") from None
    log.warning("fs tier root %s: the probe write failed (%s); starting anyway", shown, exc.strerror)
    return RootCheck(direct=direct, full=False)
