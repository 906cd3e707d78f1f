# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Filesystem (NVMe) tier: one content-addressed file per chunk under a root directory.

Layout: root / chunkfile.chunk_relpath(chunk), i.e. <namespace>/<k0k1>/<k2k3>/<key hex>.kv, each file
a 4096-byte header then the payload (kvstored.chunks.chunkfile). O_DIRECT files are page-rounded,
so a file may be longer than HEADER_BYTES + payload; the header's payload_len is the truth.

Bookkeeping (index, LRU, capacity, admission) lives in CapacityIndex (tiers/capacity.py) and runs
on the event loop; every blocking file operation runs in the tier's own small thread pool (the
job bodies: fs/jobs.py, on the syscalls of fs/io.py). pwritev / preadv move a whole
chunk straight between the caller's page-aligned views and the disk (O_DIRECT; one call per
IOV_MAX views), falling back to buffered I/O where the filesystem or the buffers don't allow it.

Several daemons may share a root: names are content addresses (the same name always holds the
same bytes), files appear only by rename of a complete temporary file, a miss in the index is
checked on disk and adopted, and a corrupt file is removed only if it is still the file we read.
A temporary file is locked by its writer while it exists (fs_io.create_tmp), so a start removes
the ones of killed writers and keeps those of live ones; a tier counts its own in used_bytes.
A write finding a file under the chunk's name takes it for the chunk only if its header says so
(name, length, payload checksum); anything else there is replaced.

A chunk file that cannot be unlinked (EACCES, EROFS, EPERM...: remove() raises TierUnavailable,
an eviction logs it) is hidden: not adopted, read, or taken for a new write's copy, until an
unlink of it succeeds (the next remove()) or a write replaces it. This lasts until a restart,
which indexes whatever files the root holds; the file's bytes are not counted in used_bytes.

Anything but a regular file under a chunk's name (a FIFO, socket, device, directory, symlink) is
never opened for I/O: every open is O_NONBLOCK | O_NOFOLLOW and checked with fstat, O_DIRECT is
turned on (fcntl) only once the file is known to be regular. Such an entry is a miss, counted
(`bad_entries`), and removed if it still is the entry seen (directories only when empty).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored.chunks.ids import ChunkId, RemovalCause, TierKind
from kvstored.chunks.views import check_views
from kvstored.errors import TierUnavailable
from kvstored.io.scheduler import Priority
from kvstored.io.threads import PriorityThreadPool
from kvstored.logs import LogLimiter
from kvstored.sizes import format_size
from kvstored.tiers.base import AdmissionPolicy, SecondaryTier, TierUsage, WriteOutcome
from kvstored.tiers.capacity import CapacityIndex
from kvstored.tiers.fs import identity_area
from kvstored.tiers.fs import io as fs_io
from kvstored.tiers.fs import records as fs_records
from kvstored.tiers.fs.jobs import FsJobs, ReadStatus, WriteFailed, WriteNotes

log = logging.getLogger(__name__)
limited = LogLimiter(log)  # a broken root fails every write: one line per 10 s, with the count

STALE_TMP_S = 60.0  # where the filesystem has no file locks: older temporary files are abandoned
FULL_BACKOFF_S = 1.0  # after ENOSPC, writes are refused for this long
TOUCH_INTERVAL_S = 60.0  # a read hit refreshes the file's mtime (restart LRU order) at most this often
INLINE_STATS = 8  # contains(): up to this many index misses are stat'ed on the loop, more in the pool
CLAIMS_REMEMBERED = 4096  # recent unlinks remembered per chunk (see FsTier._may_adopt)
IDENTITY_READ_BATCH = 256  # chunk headers read per job when reading identities back
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


@dataclass(slots=True)
class _PendingWrite:
    done: asyncio.Future  # the WriteOutcome, for writers and removers of the same chunk meanwhile
    removal: asyncio.Future | None = None  # a remove() waits for this write: its file goes next


class FsTier(SecondaryTier):
    """Counters: lookups/hits per chunk asked of contains(); reads/read_bytes per verified chunk
    served; writes/written_bytes per chunk written (payload bytes); evictions per file evicted;
    bad_entries per non-regular entry found under a chunk's name (by a read, a write or a start)."""

    kind = TierKind.FS

    def __init__(
        self,
        name: str,
        root: Path,
        capacity_bytes: int,
        admission: AdmissionPolicy = AdmissionPolicy.ALWAYS,
        io_threads: int = 8,
        direct_io: bool = True,
        group_access: bool = False,
        *,
        full_backoff_s: float = FULL_BACKOFF_S,
        stale_tmp_s: float = STALE_TMP_S,
        touch_interval_s: float = TOUCH_INTERVAL_S,
    ) -> None:
        super().__init__(name)
        # The daemon's data is the daemon's: chunk files 0600 and directories 0700 (group_access:
        # 0640 / 0750, for a group that backs the files up, say). Files written with older modes
        # are read as before.
        self._file_mode, self._dir_mode = (0o640, 0o750) if group_access else (0o600, 0o700)
        if io_threads < 1:
            raise ValueError("fs tier needs at least one I/O thread")
        self.root = Path(root)
        self._root = str(self.root)
        self._index = CapacityIndex(capacity_bytes, admission)
        self._full_backoff_s = full_backoff_s
        self._touch_interval_s = touch_interval_s
        # Reads first: the tier's queue keeps more operations in flight than there are threads.
        self._executor = PriorityThreadPool(io_threads, f"kvstored-fs-{name}")
        self._inflight: set[asyncio.Future] = set()  # every job in the pool (close() waits for them)
        self._pending: dict[ChunkId, _PendingWrite] = {}  # writes in flight
        self._unlinking: dict[ChunkId, asyncio.Future] = {}  # dropped chunks whose files are being unlinked
        # A file seen on disk may be one of ours about to be unlinked: adopt it only if no unlink of
        # its chunk was claimed since the look (epochs count claims; the last claim per chunk is
        # remembered for the recent ones, older ones only as a bound).
        self._unlink_epoch = 0
        self._claimed_at: OrderedDict[ChunkId, int] = OrderedDict()
        self._forgotten_epoch = 0
        # Chunks dropped from the index whose unlink failed (EACCES, EROFS, EPERM...): their files
        # may still be there, but must not be found (adopted, read, or taken for a new write's
        # copy) until an unlink of them succeeds (the next remove()) or a write replaces the file.
        self._undeleted: set[ChunkId] = set()
        self._full_until = 0.0  # loop.time() until which writes are refused (disk full)
        self._closed = False
        # The identity record to keep in a chunk file's header (identity_area.py), asked when the
        # file is written; set by the daemon when it publishes KV events (None: none kept).
        self.identity_of: Callable[[ChunkId], bytes | None] | None = None
        self.identities_kept = 0  # files written with an identity record
        self.identities_unfit = 0  # ... whose record did not fit beside the header (not kept)
        self._jobs = FsJobs(
            name, self._root, self._file_mode, self._dir_mode, direct_io, stale_tmp_s, lambda: self._closed
        )

    @property
    def direct_io(self) -> bool:
        """Whether O_DIRECT is in use (False once the filesystem refused it)."""
        return self._jobs.direct

    # -- lifecycle ------------------------------------------------------------------------

    async def preflight(self) -> str:
        """The root is usable: a directory (created if missing) this daemon can write to, on
        storage (not /proc or /sys)."""
        found = await self._run(Priority.LOAD, _result, self._jobs.check_root)
        return f"root {self._root} {found.describe()}"

    async def start(self) -> None:
        """Create the root, probe O_DIRECT, rebuild the index from the files on disk (oldest
        mtime = least recently used), remove stale temporary files, evict down to the capacity."""
        entries, bad = await self._run(Priority.LOAD, _result, self._jobs.start)
        self.counters.bad_entries += bad
        self._index.load(entries)
        log.info(
            "fs tier %s: %d chunks, %s on disk under %s (capacity %s, O_DIRECT %s)",
            self.name,
            len(self._index),
            format_size(self._index.used_bytes),
            self._root,
            format_size(self._index.capacity_bytes),
            "on" if self._jobs.direct else "off",
        )
        await self._enforce_capacity()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            while self._inflight:
                await asyncio.wait(list(self._inflight))
        finally:
            self._executor.shutdown(wait=False)

    # -- SecondaryTier ----------------------------------------------------------------------

    def holds(self, chunks: Sequence[ChunkId]) -> list[bool]:
        """Indexed chunks (no stat: a file another daemon wrote counts once a lookup adopted it)."""
        return [self._index.touch(chunk) is not None and chunk not in self._unlinking for chunk in chunks]

    async def contains(self, chunks: Sequence[ChunkId]) -> list[bool]:
        out: list[bool] = []
        misses: list[int] = []
        for i, chunk in enumerate(chunks):
            hit = self._index.touch(chunk) is not None
            out.append(hit)
            if not hit and chunk not in self._unlinking and chunk not in self._undeleted:
                misses.append(i)
        self.counters.lookups += len(out)
        self.counters.hits += sum(out)
        if not misses or self._closed:
            return out
        # Another daemon sharing the root may have written them: look on disk and adopt.
        paths = [self._path(chunks[i]) for i in misses]
        epoch = self._unlink_epoch
        if len(paths) <= INLINE_STATS:
            found = fs_io.stat_files(paths)
        else:
            found = await self._run(Priority.LOAD, _result_or_nothing, fs_io.stat_files, paths)
        adopted = 0
        for i, st in zip(misses, found or ()):
            if st is None:
                continue
            chunk = chunks[i]
            if not self._may_adopt(chunk, epoch):
                continue
            if chunk not in self._index and chunk not in self._pending:  # (a write indexes its own)
                self._index.insert(chunk, st.st_size, st.st_mtime)
            out[i] = True
            adopted += 1
        if adopted:
            self.counters.hits += adopted
            await self._enforce_capacity()
        return out

    async def write(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> WriteOutcome:
        path = self._path(chunk)
        check_views(views, size)
        if self._index.touch(chunk) is not None:
            return WriteOutcome.ALREADY_PRESENT
        pending = self._pending.get(chunk)
        if pending is not None:  # the same bytes are on their way: share that write's outcome
            outcome = await asyncio.shield(pending.done)
            if pending.removal is not None:  # ...unless that file is being removed: write anew after
                await asyncio.shield(pending.removal)
                return await self.write(chunk, views, size)
            if outcome in (WriteOutcome.WRITTEN, WriteOutcome.ALREADY_PRESENT):
                return WriteOutcome.ALREADY_PRESENT
            return outcome
        if self._closed:
            return WriteOutcome.FAILED
        loop = asyncio.get_running_loop()
        if loop.time() < self._full_until:
            self.counters.rejected_full += 1
            return WriteOutcome.REJECTED_FULL
        if not self._index.admit(chunk):
            self.counters.rejected_admission += 1
            return WriteOutcome.REJECTED_ADMISSION
        reservation = self._index.reserve(HEADER_BYTES + fs_io.round_up(size))
        if not reservation.granted:
            self.counters.rejected_full += 1
            return WriteOutcome.REJECTED_FULL
        victims = [(victim, self._path(victim)) for victim, _ in reservation.victims]
        self._evicted(victims)
        gate = self._claim_unlinks(victims)
        identity = self._identity_record(chunk)
        record = _PendingWrite(loop.create_future())
        self._pending[chunk] = record
        outcome = WriteOutcome.FAILED

        def finish(fut: asyncio.Future) -> WriteOutcome:
            nonlocal outcome
            outcome = _finish(fut)
            return outcome

        def _finish(fut: asyncio.Future) -> WriteOutcome:
            self._index.release(reservation)
            error = None
            try:
                file_size, existed, notes = fut.result()
            except WriteFailed as failed:  # after finding something to report
                error, notes = failed.error, failed.notes
            except OSError as exc:
                error, notes = exc, WriteNotes()
            self._note_unlinks(victims, notes.undeleted)
            if notes.odd is not None:
                self._bad_entry(notes.odd)
            if notes.damaged is not None:
                self.counters.checksum_failures += 1
                log.warning("fs tier %s: %s", self.name, notes.damaged)
            if error is None:
                self._index.insert(chunk, file_size, time.time())
                self._undeleted.discard(chunk)  # (the file is this write's now)
                if existed:  # written by a daemon sharing the root: adopted, not rewritten
                    return WriteOutcome.ALREADY_PRESENT
                self.counters.writes += 1
                self.counters.written_bytes += size
                return WriteOutcome.WRITTEN
            if error.errno in _FULL_ERRNOS:
                if loop.time() >= self._full_until:
                    log.warning(
                        "fs tier %s: disk full under %s (%s); refusing writes for %.1f s",
                        self.name,
                        self._root,
                        error.strerror,
                        self._full_backoff_s,
                    )
                self._full_until = loop.time() + self._full_backoff_s
                self.counters.rejected_full += 1
                return WriteOutcome.REJECTED_FULL
            self.counters.errors += 1
            limited.log(
                f"write {self.name}", logging.WARNING, "fs tier %s: cannot write %s: %s", self.name, path, error
            )
            return WriteOutcome.FAILED

        try:
            while (prior := self._unlinking.get(chunk)) is not None:  # an eviction or remove of
                await asyncio.wait((prior,))  # this chunk's old file must land first
            reuse = chunk not in self._undeleted  # (a file left by a failed unlink is replaced)
            return await self._run(
                Priority.WRITEDOWN, finish, self._jobs.write, chunk, path, views, size, victims, identity, reuse
            )
        finally:
            self._settle_unlinks(victims, gate)
            self._index.release(reservation)  # no-op unless the job never ran
            del self._pending[chunk]
            record.done.set_result(outcome)

    async def read(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> bool:
        path = self._path(chunk)
        check_views(views, size)
        if self._closed or chunk in self._undeleted:  # (its file may be there: a failed unlink's)
            return False
        entry = self._index.get(chunk)
        epoch = self._unlink_epoch if entry is None and chunk not in self._unlinking else -1
        now = time.time()
        touch = entry is not None and now - entry.mtime >= self._touch_interval_s

        def finish(fut: asyncio.Future) -> bool:
            try:
                status, file_size, detail = fut.result()
            except OSError as exc:
                self.counters.errors += 1
                log.warning("fs tier %s: cannot read %s: %s", self.name, path, exc)
                return False
            if status is ReadStatus.HIT:
                self.counters.reads += 1
                self.counters.read_bytes += size
                current = self._index.touch(chunk)
                if current is None and self._may_adopt(chunk, epoch) and chunk not in self._pending:
                    self._index.insert(chunk, file_size, now)  # written by a daemon sharing the root
                elif touch and current is not None and current is entry:
                    current.mtime = now
                return True
            # the file vanished (evicted by a daemon sharing the root) or was bad: forget it,
            # unless a write indexed a new copy meanwhile
            dropped = entry is not None and self._index.discard(chunk, entry) is not None
            if status is ReadStatus.CORRUPT:
                self.counters.checksum_failures += 1
                log.warning("fs tier %s: corrupt chunk file %s removed: %s", self.name, path, detail)
                self._notify(chunk, RemovalCause.CORRUPT)
            elif status is ReadStatus.UNREADABLE:
                self.counters.errors += 1
                log.warning("fs tier %s: unreadable chunk file %s dropped: %s", self.name, path, detail)
                if dropped:
                    self._notify(chunk, RemovalCause.CORRUPT)
            elif status is ReadStatus.NOT_REGULAR:
                self._bad_entry(detail)
                if dropped:
                    self._notify(chunk, RemovalCause.CORRUPT)
            elif dropped:
                self._notify(chunk, RemovalCause.EVICTED)
            return False

        hit = await self._run(Priority.LOAD, finish, self._jobs.read, chunk, path, views, size, entry is None, touch)
        if hit and entry is None:
            await self._enforce_capacity()
        return hit

    async def remove(self, chunk: ChunkId) -> bool:
        """Unlink the chunk's file (again, after a failed unlink). Raises TierUnavailable, naming
        the file and the error, when the unlink fails: the chunk is not found meanwhile."""
        path = self._path(chunk)
        pending = self._pending.get(chunk)
        removal = None
        if pending is not None:  # let the write land, then remove what it wrote
            if pending.removal is None:  # writes joining it meanwhile must not count on its file
                pending.removal = asyncio.get_running_loop().create_future()
            removal = pending.removal
            await asyncio.wait((pending.done,))
        try:
            entry = self._index.discard(chunk)
            if self._closed:
                return entry is not None
            removed, failed = await self._unlink([(chunk, path)])
            if failed:
                raise TierUnavailable(
                    f"fs tier {self.name}: cannot unlink {path}: {_describe(failed[path])}; "
                    "the chunk is not served from it meanwhile; retry the delete"
                )
            return entry is not None or removed > 0
        finally:
            if removal is not None and not removal.done():
                removal.set_result(None)

    async def identity_records(self) -> AsyncIterator[list[tuple[ChunkId, bytes | None]]]:
        """The identity records kept with the chunks indexed now (after start(): what the disk
        held before), in batches of header reads at the lowest priority, so loads and write-downs
        go first. Each batch lists only chunks still indexed as it is handed over (its consumer
        runs before any other event of the loop): (chunk, record), record None for a file that
        keeps none, identity_area.DOUBTFUL for one that did not check out."""
        chunks = self._index.chunks()
        for first in range(0, len(chunks), IDENTITY_READ_BATCH):
            if self._closed:
                return
            items = [(chunk, self._path(chunk)) for chunk in chunks[first : first + IDENTITY_READ_BATCH]]
            items = [item for item in items if item[0] in self._index]
            if not items:
                continue
            found = await self._run(Priority.DELETE, _result_or_nothing, self._jobs.read_identities, items)
            batch = [(c, r) for c, r in found or () if c in self._index and c not in self._unlinking]
            if batch:
                yield batch

    def known_chunks(self, namespace_id: str) -> list[ChunkId]:
        return self._index.chunks_of(namespace_id)

    async def save_namespace_record(self, namespace_id: str, record: bytes) -> None:
        # With the write-downs: a record left behind them would leave, after a crash, chunks on
        # disk whose namespace is not recovered.
        await self._run(
            Priority.WRITEDOWN,
            _result,
            fs_records.write_record,
            self._root,
            namespace_id,
            record,
            self._file_mode,
            self._dir_mode,
        )

    async def remove_namespace_record(self, namespace_id: str) -> None:
        await self._run(Priority.DELETE, _result, fs_records.remove_record, self._root, namespace_id)

    async def namespace_records(self) -> dict[str, bytes]:
        return await self._run(Priority.LOAD, _result, fs_records.read_records, self._root)

    def usage(self) -> TierUsage:
        """used_bytes: the indexed files and the temporary files of writes in flight (their
        reservations: a temporary file never outgrows the room reserved for it)."""
        index = self._index
        return TierUsage(index.capacity_bytes, index.used_bytes + index.reserved_bytes, len(index))

    def set_admission(self, policy: AdmissionPolicy) -> None:
        self._index.admission = policy

    # -- loop-side helpers ------------------------------------------------------------------

    def _path(self, chunk: ChunkId) -> str:
        ns, key = chunk
        if not ns or ns[0] == "." or "/" in ns or "\0" in ns or len(key) < 2:
            raise ValueError(
                f"chunk id {chunk!r} cannot name a file: the namespace must be a plain name, the key >= 2 bytes"
            )
        return os.path.join(self._root, chunkfile.chunk_relpath(chunk))

    async def _run(self, priority: Priority, finish: Callable[[asyncio.Future], object], fn, *args):
        """Run `fn(*args)` in the tier's pool (before queued jobs of lower priority) and return
        `finish(future)` (bookkeeping, on the loop).

        Waits for the job to end even if the caller is cancelled meanwhile (the job's future
        cannot be cancelled; the cancellation is re-raised after the bookkeeping), so once
        read()/write() return or raise, no thread touches the caller's views any more."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future
        try:
            fut = self._executor.submit_async(loop, priority, fn, *args)
        except RuntimeError:  # the pool is shut down: close() ran
            fut = loop.create_future()
            fut.set_exception(OSError(errno.ESHUTDOWN, f"fs tier {self.name} is closed"))
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        cancelled = False
        try:
            await fut
        except asyncio.CancelledError:  # raised only once the job has ended (see JobFuture)
            cancelled = True
        except Exception:  # the job's failure: finish() decides what it means
            pass
        result = finish(fut)
        if cancelled:
            raise asyncio.CancelledError()
        return result

    def _identity_record(self, chunk: ChunkId) -> bytes | None:
        if self.identity_of is None:
            return None
        record = self.identity_of(chunk)
        if record is None:
            return None
        if len(record) > identity_area.room(chunk):
            if not self.identities_unfit:
                log.info(
                    "fs tier %s: a chunk's identity (%d bytes) does not fit in its file's header: such chunks "
                    "are not published again after a restart",
                    self.name,
                    len(record),
                )
            self.identities_unfit += 1
            return None
        self.identities_kept += 1
        return record

    def _may_adopt(self, chunk: ChunkId, epoch: int) -> bool:
        """Whether a file seen on disk since `epoch` (taken when `chunk` was not being unlinked)
        may be indexed: no unlink of it was claimed since, so it is not one of ours about to go."""
        if epoch < 0 or chunk in self._unlinking or chunk in self._undeleted or self._forgotten_epoch > epoch:
            return False
        return self._claimed_at.get(chunk, 0) <= epoch

    def _claim_unlinks(self, items: list[tuple[ChunkId, str]]) -> asyncio.Future | None:
        """Mark chunks dropped from the index whose files are about to be unlinked: until
        _settle_unlinks, a write of one waits (or the unlink would delete the new file) and
        lookups don't adopt them."""
        if not items:
            return None
        gate = asyncio.get_running_loop().create_future()
        self._unlink_epoch += 1
        for chunk, _ in items:
            self._unlinking[chunk] = gate
            self._claimed_at[chunk] = self._unlink_epoch
            self._claimed_at.move_to_end(chunk)
        while len(self._claimed_at) > CLAIMS_REMEMBERED:
            _, epoch = self._claimed_at.popitem(last=False)
            self._forgotten_epoch = max(self._forgotten_epoch, epoch)
        return gate

    def _settle_unlinks(self, items: list[tuple[ChunkId, str]], gate: asyncio.Future | None) -> None:
        if gate is None:
            return
        for chunk, _ in items:
            if self._unlinking.get(chunk) is gate:
                del self._unlinking[chunk]
        gate.set_result(None)

    async def _unlink(self, items: list[tuple[ChunkId, str]]) -> tuple[int, dict[str, OSError]]:
        """Unlink the files of chunks just dropped from the index (claimed meanwhile: a write of
        one waits, lookups don't adopt it): (files removed, the error of each path whose file may
        remain)."""
        paths = [path for _, path in items]

        def finish(fut: asyncio.Future) -> tuple[int, dict[str, OSError]]:
            try:
                removed, failed = fut.result()
            except OSError as exc:  # the job never ran (the tier is closing): every file may remain
                removed, failed = 0, dict.fromkeys(paths, exc)
            self._note_unlinks(items, failed)
            return removed, failed

        gate = self._claim_unlinks(items)
        try:
            return await self._run(Priority.DELETE, finish, fs_io.unlink_files, paths)
        finally:
            self._settle_unlinks(items, gate)

    def _note_unlinks(self, items: list[tuple[ChunkId, str]], failed: dict[str, OSError]) -> None:
        """After unlinking the files of `items`: hide the chunks whose files may remain, unhide
        those whose files are gone; count and log the failures."""
        for chunk, path in items:
            if path in failed:
                self._undeleted.add(chunk)
            else:
                self._undeleted.discard(chunk)
        if not failed:
            return
        self.counters.errors += len(failed)
        path, exc = next(iter(failed.items()))
        limited.log(
            f"unlink {self.name}",
            logging.WARNING,
            "fs tier %s: cannot unlink %d chunk file(s), first %s: %s; not served until removed",
            self.name,
            len(failed),
            path,
            _describe(exc),
        )

    def _evicted(self, victims: list[tuple[ChunkId, str]]) -> None:
        self.counters.evictions += len(victims)
        for chunk, _ in victims:
            self._notify(chunk, RemovalCause.EVICTED)

    def _bad_entry(self, what: str) -> None:
        self.counters.bad_entries += 1
        log.warning("fs tier %s: %s", self.name, what)

    def _notify(self, chunk: ChunkId, cause: RemovalCause) -> None:
        try:
            self.notify_removed(chunk, cause)
        except Exception:  # a listener's failure must not break the tier's bookkeeping
            log.exception("fs tier %s: removal listener failed", self.name)

    async def _enforce_capacity(self) -> None:
        """Evict LRU files until the indexed ones fit (after a rebuild or adopting files)."""
        victims = self._index.shrink_to_capacity()
        if victims:
            items = [(chunk, self._path(chunk)) for chunk, _ in victims]
            self._evicted(items)
            await self._unlink(items)


# -- finishing jobs (event loop) -------------------------------------------------------------


def _result(fut: asyncio.Future):
    return fut.result()


def _describe(exc: OSError) -> str:
    """An unlink's error as an operator reads it: 'EACCES (Permission denied)'."""
    code = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno is not None else "error"
    return f"{code} ({exc.strerror or exc})"


def _result_or_nothing(fut: asyncio.Future):
    """finish() for jobs whose failure only means 'nothing found / nothing done'."""
    try:
        return fut.result()
    except OSError as exc:
        log.debug("fs tier job failed: %s", exc)
        return None
