# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fs tier's blocking job bodies: what runs on its I/O threads (FsTier keeps the bookkeeping
on the event loop and hands these their arguments). Each returns what it found; FsTier counts
and indexes it.

Crash safety: a file is written under a temporary name and renamed into place only once
complete, with no fsync. A killed daemon (kill -9, OOM) loses nothing the kernel already
holds (O_DIRECT data is on the device when pwritev returns; buffered data sits in the page
cache, which outlives the process), so every file visible under its final name is complete.
After a power loss or kernel crash a renamed file may be empty, short or zero-filled; the
header crc, the length check and the payload checksum catch that on its first read (counted,
removed), and a write finding it under the chunk's name checks the header before taking it for
the chunk (rewritten if it is not a copy).
fsync would cost most of the write bandwidth (buffered write+fsync ~0.4 GiB/s against
2-3.4 GiB/s for O_DIRECT here) to protect a cache whose loss only costs recomputation.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES, CorruptChunk
from kvstored.chunks.ids import ChunkId
from kvstored.chunks.views import trim
from kvstored.tiers.fs import identity_area
from kvstored.tiers.fs import io as fs_io
from kvstored.tiers.fs.root import RootCheck, check_root

log = logging.getLogger(__name__)

# Reading the file itself failed (bad sectors, fs checksums): no retry will do better, so the
# chunk is dropped like a corrupt one.
_UNREADABLE_ERRNOS = frozenset({errno.EIO, errno.ENXIO, errno.EUCLEAN, errno.EBADMSG})


class ReadStatus:
    HIT, MISS, CORRUPT, UNREADABLE, NOT_REGULAR = "hit", "miss", "corrupt", "unreadable", "not regular"


class FsJobs:
    """The job bodies of one fs tier, with what they need of it: its root, file modes, whether
    O_DIRECT is in use (cleared here, once, for good, when the filesystem refuses it), and
    whether the tier is closing (a long rebuild stops then)."""

    def __init__(
        self,
        name: str,
        root: str,
        file_mode: int,
        dir_mode: int,
        direct: bool,
        stale_tmp_s: float,
        closing: Callable[[], bool],
    ) -> None:
        self._name = name
        self.root = root
        self._file_mode = file_mode
        self._dir_mode = dir_mode
        self.direct = direct
        self._stale_tmp_s = stale_tmp_s
        self._closing = closing

    def check_root(self) -> RootCheck:
        """The root is usable (created if needed; RootUnusable if not); O_DIRECT is turned off
        for good when the filesystem refuses it."""
        found = check_root(self.root, self._dir_mode, self._file_mode, self.direct)
        self.direct = found.direct
        return found

    def start(self) -> tuple[list[tuple[ChunkId, int, float]], int]:
        self.check_root()
        return self._scan()

    def _scan(self) -> tuple[list[tuple[ChunkId, int, float]], int]:
        """Every chunk file under the root, named by its path: <ns>/<k0k1>/<k2k3>/<key hex>.kv,
        and how many chunk names held something else (skipped; removed where they can be).

        Parsing names (one stat per file) instead of reading headers keeps a restart over millions
        of files fast; the contents are verified on every read anyway."""
        entries: list[tuple[ChunkId, int, float]] = []
        bad = 0
        for ns_dir in self._scandir(self.root):
            for d1 in self._scandir(ns_dir.path):
                for d2 in self._scandir(d1.path):
                    for f in self._scandir(d2.path, dirs_only=False):
                        chunk = chunkfile.parse_relpath(f"{ns_dir.name}/{d1.name}/{d2.name}/{f.name}")
                        if chunk is None:
                            continue
                        try:
                            st = f.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if stat.S_ISREG(st.st_mode):
                            entries.append((chunk, st.st_size, st.st_mtime))
                            continue
                        bad += 1
                        removed = fs_io.remove_if_same(f.path, st)
                        log.warning(
                            "fs tier %s: %s is %s, not a chunk file%s",
                            self._name,
                            f.path,
                            fs_io.describe(st.st_mode),
                            "; removed" if removed else "; left alone",
                        )
        return entries, bad

    def _scandir(self, path: str, dirs_only: bool = True):
        """Entries of `path` (only directories if `dirs_only`), removing temporary files no live
        writer holds. Yields nothing once the tier is closing (a stop during a long rebuild)."""
        if self._closing():
            return
        try:
            with os.scandir(path) as it:
                listing = list(it)
        except OSError:
            return
        for entry in listing:
            if fs_io.is_tmp_name(entry.name):
                fs_io.remove_if_abandoned(entry.path, self._stale_tmp_s)
                continue
            try:
                if not dirs_only or entry.is_dir(follow_symlinks=False):
                    yield entry
            except OSError:
                continue

    def _use_direct(self, fd: int) -> bool:
        """Turn O_DIRECT on for `fd`, a regular file of ours; False (and buffered I/O from now on)
        if the filesystem refuses it."""
        try:
            fs_io.set_direct(fd, True)
            return True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._refused_direct(str(exc))
            return False

    def _refused_direct(self, why: str) -> None:
        if self.direct:
            self.direct = False
            log.info("fs tier %s: O_DIRECT refused under %s (%s); using buffered I/O", self._name, self.root, why)

    def write(
        self,
        chunk: ChunkId,
        path: str,
        views: Sequence[memoryview],
        size: int,
        victims: list[tuple[ChunkId, str]],
        record: bytes | None = None,
        reuse: bool = True,
    ) -> tuple[int, bool, WriteNotes]:
        """Unlink evicted files, write the chunk to a temporary file (with its identity record in
        the header, if given: identity_area.py), rename it into place. (file size, whether a copy
        of the chunk was there already, what was found on the way). A file already under the name
        is taken for the chunk only with `reuse` and if its header says it is a copy (the chunk's
        name, length and payload checksum: content addressing makes it the same bytes); anything
        else there (damaged, foreign, an old version) is replaced."""
        notes = WriteNotes(undeleted=fs_io.unlink_files([victim for _, victim in victims])[1])
        digest = chunkfile.checksum(views, size)
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode):
            if reuse:
                found, notes.damaged = _copy_of(chunk, path, size, digest)
                if found is not None:
                    return found, True, notes
        elif st is not None:  # the rename replaces anything but a directory, which must go first
            what = fs_io.describe(st.st_mode)
            if stat.S_ISDIR(st.st_mode) and not fs_io.remove_if_same(path, st):
                notes.odd = f"{path} is {what} (not empty: left alone), not a chunk file"
            else:
                notes.odd = f"{path} was {what}, not a chunk file; replaced"
        try:
            return (*self._write_file(chunk, path, views, size, digest, record), notes)
        except OSError as exc:
            if not notes:
                raise
            raise WriteFailed(exc, notes) from None

    def _write_file(
        self, chunk: ChunkId, path: str, views: Sequence[memoryview], size: int, digest: int, record: bytes | None
    ) -> tuple[int, bool]:
        header = fs_io.header_buffer()
        header[:] = chunkfile.encode_header(chunk, size, digest)
        if record:
            identity_area.place(header, record)
        direct_bufs = fs_io.direct_buffers(views, size) if self.direct else None
        try:
            fd, tmp = fs_io.create_tmp(path, self._file_mode)
        except FileNotFoundError:
            fs_io.make_dirs(os.path.dirname(path), self._dir_mode)
            fd, tmp = fs_io.create_tmp(path, self._file_mode)
        try:
            if direct_bufs is not None and self._use_direct(fd):
                try:
                    return self._finish_file(fd, tmp, path, [header, *direct_bufs])
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    # O_DIRECT was taken but this I/O was not: write this file buffered (only
                    # the filesystem refusing the flag speaks for all files)
                    log.debug(
                        "fs tier %s: O_DIRECT write of %s refused (%s); writing it buffered", self._name, tmp, exc
                    )
                    fs_io.set_direct(fd, False)
                    os.ftruncate(fd, 0)
            return self._finish_file(fd, tmp, path, [header, *trim(views, size)])
        except BaseException:
            fs_io.unlink_quiet(tmp)
            raise
        finally:
            os.close(fd)  # after the rename or the unlink: releases the writer's lock

    @staticmethod
    def _finish_file(fd: int, tmp: str, path: str, bufs: list[memoryview]) -> tuple[int, bool]:
        length = fs_io.pwritev_all(fd, bufs)
        os.replace(tmp, path)
        return length, False

    def read(
        self, chunk: ChunkId, path: str, views: Sequence[memoryview], size: int, want_size: bool, touch: bool
    ) -> tuple[str, int, str | None]:
        """(status, file size if `want_size`, what was wrong); a corrupt or unreadable file, or
        anything but a regular file, is removed (if it is still what was seen)."""
        direct_bufs = fs_io.direct_buffers(views, size) if self.direct else None
        try:
            fd, direct = fs_io.open_regular(path, os.O_RDONLY, direct=direct_bufs is not None)
        except FileNotFoundError:
            return ReadStatus.MISS, 0, None
        except fs_io.NotRegularFile as exc:
            removed = fs_io.remove_if_same(path, exc.seen)
            return ReadStatus.NOT_REGULAR, 0, f"{exc}: {'removed' if removed else 'left alone'}, served as a miss"
        except OSError as exc:
            if exc.errno not in _UNREADABLE_ERRNOS:
                raise
            return ReadStatus.UNREADABLE, 0, str(exc)  # not a file we can open: nothing of ours to unlink
        try:
            header = fs_io.header_buffer()
            got = -1
            if direct_bufs is not None and not direct:  # the filesystem refuses O_DIRECT
                self._refused_direct("fcntl(O_DIRECT): EINVAL")
            elif direct_bufs is not None:
                try:
                    got = fs_io.preadv_all(fd, [header, *direct_bufs], direct=True)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    # O_DIRECT was taken but this I/O was not: read this file buffered (only the
                    # filesystem refusing the flag speaks for all files)
                    log.debug(
                        "fs tier %s: O_DIRECT read of %s refused (%s); reading it buffered", self._name, path, exc
                    )
                    fs_io.set_direct(fd, False)
            if got < 0:
                got = fs_io.preadv_all(fd, [header, *trim(views, size)])
            try:
                if got < HEADER_BYTES:
                    raise CorruptChunk(f"truncated: the file holds {got} bytes, less than a header")
                parsed = chunkfile.decode_header(header)
                if got < HEADER_BYTES + size and parsed.payload_len == size:
                    raise CorruptChunk(f"truncated: {got - HEADER_BYTES} of {size} payload bytes")
                chunkfile.verify(parsed, chunk, size, views)
            except CorruptChunk as exc:
                fs_io.unlink_if_same(path, fd)
                return ReadStatus.CORRUPT, 0, str(exc)
            if touch:
                try:
                    os.utime(fd)
                except OSError:
                    pass
            return ReadStatus.HIT, os.fstat(fd).st_size if want_size else 0, None
        except OSError as exc:
            if exc.errno not in _UNREADABLE_ERRNOS:
                raise
            fs_io.unlink_if_same(path, fd)
            return ReadStatus.UNREADABLE, 0, str(exc)
        finally:
            os.close(fd)

    def read_identities(self, items: list[tuple[ChunkId, str]]) -> list[tuple[ChunkId, bytes | None]]:
        """Per chunk file, the identity record its header keeps (identity_area.take: None for
        none, DOUBTFUL for one that does not check out); a file that is gone, odd or unreadable
        keeps none. Reads the header only (buffered: one page, no O_DIRECT needed); the chunk
        itself is not verified or touched here (its own read does that)."""
        out: list[tuple[ChunkId, bytes | None]] = []
        for chunk, path in items:
            if self._closing():
                break
            try:
                fd, _ = fs_io.open_regular(path, os.O_RDONLY)
            except (OSError, fs_io.NotRegularFile):
                out.append((chunk, None))
                continue
            try:
                header = os.pread(fd, HEADER_BYTES, 0)
            except OSError:
                out.append((chunk, None))
                continue
            finally:
                os.close(fd)
            out.append((chunk, identity_area.take(chunk, header)))
        return out


def _copy_of(chunk: ChunkId, path: str, size: int, digest: int) -> tuple[int | None, str | None]:
    """(the size of the file at `path` if its header says it holds `chunk`'s payload of `size`
    bytes with checksum `digest`, what is wrong with it if it is a file that does not). The
    payload itself is not read: the header is written with it, so a file whose header checks out
    but whose payload blocks were lost is caught by its first read."""
    try:
        fd, _ = fs_io.open_regular(path, os.O_RDONLY)
    except (OSError, fs_io.NotRegularFile):
        return None, None  # gone or replaced meanwhile: the write puts its own file there
    try:
        length = os.fstat(fd).st_size
        if length < HEADER_BYTES + size:
            raise CorruptChunk(f"truncated: the file holds {length} bytes, less than {HEADER_BYTES + size}")
        header = chunkfile.decode_header(os.pread(fd, HEADER_BYTES, 0))
        chunkfile.verify_digest(header, chunk, size, lambda: digest)
    except CorruptChunk as exc:
        return None, f"{path} is not a copy of the chunk ({exc}); rewritten"
    except OSError:
        return None, None  # cannot tell: writing the chunk anew is the safe answer
    finally:
        os.close(fd)
    return length, None


@dataclass(slots=True)
class WriteNotes:
    """What a write job found on the way, for the tier to count and log."""

    odd: str | None = None  # something other than a regular file under the chunk's name
    damaged: str | None = None  # a file under the chunk's name that was no copy of it
    undeleted: dict[str, OSError] = field(default_factory=dict)  # victims whose files may remain

    def __bool__(self) -> bool:
        return bool(self.odd or self.damaged or self.undeleted)


class WriteFailed(Exception):
    """A write failed after finding something the tier must hear of: both are reported."""

    def __init__(self, error: OSError, notes: WriteNotes) -> None:
        super().__init__(str(error))
        self.error = error
        self.notes = notes
