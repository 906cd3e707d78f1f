# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Packed S3 tier: chunks written down fill one open pack object (tens of MiB), sent as one PUT
when full or `pack_age_s` old; loads are ranged GETs of one chunk's record.

The pack format (kvstored/chunks/packfile.py) ends with its own index, so the tier's index of
which chunk is in which pack (kvstored/tiers/packindex.py) is rebuilt at start from a listing and
the packs' last bytes. Running daemons sharing the bucket and prefix keep it current every
`pack_poll_s`: each PUTs one small manifest naming the packs it wrote since the last one (with
their indexes), and LISTs the manifests newer than the last one seen, one GET each; a pack no
manifest announced within a few polls (its writer died, or does not poll) is read from its own
last bytes. A manifest also names the packed chunks its writer deleted since the last one, so
the daemons running on the bucket stop serving them within a poll (the tombstone objects written
at each delete are for the rebuild). Manifests older than MANIFEST_TTL_MS are deleted by their
writer.

A chunk's payload is copied once, into its record (with its checksum); a pack's PUT streams its
records from where they are (no copy of the whole pack). A write returns once the chunk's record
is in the open pack in memory (WRITTEN: the tier serves
it from there until the PUT lands). At most `pack_uploads` packs are in flight and one is open, so
the buffers take at most (pack_uploads + 1) x pack_bytes; a write past that waits for an upload to
end (each is bounded by timeout_s). A pack whose PUT fails is lost as a whole: its chunks are
reported removed. One PUT is atomic: a daemon killed mid write-down leaves the whole pack or no
pack, never part of one.

Everything read is verified (the record's own chunkfile header names the chunk and carries its
xxh3): a corrupt record is a miss and leaves the index; a vanished or truncated pack leaves it
whole. Capacity: whole packs expire oldest first (by the time in their name, the same order on
every daemon of the bucket); a pack with no live chunk left is deleted at once. Mostly dead packs
are not rewritten: they cost capacity until they expire, never read amplification (a ranged GET
reads one record).

One-object-per-chunk objects already under the prefix (S3Tier's) are indexed at start and still
served, deleted and expired (first, being older than any pack); new chunks go to packs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvstored.chunks import chunkfile, packfile
from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored.chunks.ids import ChunkId, RemovalCause
from kvstored.chunks.packfile import PACKS_DIR, TAIL_BYTES, CorruptPack, NeedTail, PackEntry, UnsupportedPack
from kvstored.chunks.receiver import RecordReceiver
from kvstored.chunks.views import trim
from kvstored.errors import TierUnavailable
from kvstored.sizes import format_size
from kvstored.tiers.base import PackUsage, TierUsage, WriteOutcome
from kvstored.tiers.packindex import Pack, PackIndex
from kvstored.tiers.s3 import Fault, PartsStream, S3Failure, S3Tier, _encode, _Skipped, check_range, content_range

log = logging.getLogger(__name__)
T = TypeVar("T")

# A pack's name carries the time its upload started; it becomes visible up to timeout_s later, and
# clocks of the daemons sharing a bucket differ: each poll lists again the names of this last
# minute (one page of LIST), skipping the packs it knows.
LIST_OVERLAP_MS = 60_000
MANIFEST_TTL_MS = 2 * LIST_OVERLAP_MS  # past every reader's listing window
MAX_UNANNOUNCED = 10_000  # packs awaiting a manifest; older ones are left to the orphan reads
MAX_UNANNOUNCED_DELETES = 100_000  # chunks awaiting a manifest; older ones wait for a restart
MAX_DEAD_PACKS = 10_000  # packs not indexed yet that deletions name
GONE_LIMIT = 100_000  # names of packs this daemon dropped, never indexed again by a listing


@dataclass(eq=False)
class _OpenPack:
    opened_at: float  # loop time
    records: dict[ChunkId, bytes] = field(default_factory=dict)  # in object order; frozen once sealed
    nbytes: int = 0
    sealed: bool = False
    upload: asyncio.Task | None = None  # its PUT, once sealed


@dataclass(eq=False)
class _TombBatch:
    """Chunks deleted from one pack that wait for the same tombstone PUT (the next one sent for
    that pack), and its outcome: None once stored (or no longer owed), else why it failed."""

    chunks: set[ChunkId]
    done: asyncio.Future[str | None]


Send = Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]


class PackedS3Tier(S3Tier):
    """Counters as S3Tier's, with evictions per chunk expired; `packs_written` (PUTs of packs by
    this daemon), `packs_found` (packs of other daemons indexed after start), `packs_expired`
    (deleted for capacity) and `packs_dropped` (vanished, truncated or unreadable)."""

    def __init__(
        self,
        name: str,
        bucket: str,
        *,
        pack_bytes: int = 32 << 20,
        pack_age_s: float = 1.0,
        pack_uploads: int = 4,
        pack_poll_s: float = 2.0,
        capacity_bytes: int = 0,
        **options: Any,
    ) -> None:
        # The one-object index is unbounded here: the capacity covers packs and objects together.
        super().__init__(name, bucket, capacity_bytes=0, **options)
        if pack_bytes <= 0 or pack_uploads < 1 or pack_age_s < 0 or pack_poll_s < 0:
            raise ValueError("packed s3 tier needs pack_bytes > 0, pack_uploads >= 1, pack_age_s and pack_poll_s >= 0")
        if capacity_bytes < 0:
            raise ValueError("s3 tier needs capacity_bytes >= 0")
        self.capacity_bytes = capacity_bytes
        self.pack_bytes = pack_bytes
        self._pack_age_s = pack_age_s
        self._pack_uploads = pack_uploads
        self._poll_s = pack_poll_s
        self._packs = PackIndex()
        self._packs_prefix = f"{self.prefix}{PACKS_DIR}/"
        self._filling: _OpenPack | None = None
        self._opened = asyncio.Event()  # a new open pack (the age loop waits for one)
        self._buffered: dict[ChunkId, _OpenPack] = {}  # chunks written, not yet in an uploaded pack
        self._buffered_bytes = 0
        self._uploads: set[asyncio.Task] = set()
        self._uploading: dict[str, int] = {}  # keys of packs being PUT by this daemon -> created_ms
        self._reserved = 0  # bytes of packs being PUT (capacity)
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._undeleted_packs: set[str] = set()  # DELETE failed: retried at each poll
        self._retry_index: dict[str, int] = {}  # packs whose index could not be read: key -> size
        self._seen_ms = 0  # newest pack name listed
        self._manifests_prefix = f"{self.prefix}{packfile.MANIFESTS_DIR}/"
        self._tombs_prefix = f"{self.prefix}{packfile.TOMBSTONES_DIR}/"
        self._dead: dict[str, set[ChunkId]] = {}  # pack key -> chunks its tombstones name (rebuild)
        # pack key -> chunks deleted from it (not served) whose tombstone has not landed yet: a
        # rebuild would serve them again. Paid by a retried remove() (which raises until then),
        # each poll and close(); forgotten once the pack itself is deleted.
        self._owed: dict[str, set[ChunkId]] = {}
        self._owed_by: dict[ChunkId, set[str]] = {}  # the same, by chunk: pack keys it is owed in
        # One tombstone PUT in flight per pack (its sender task); the chunks deleted meanwhile
        # wait together for the next one: a delete of a whole namespace is a few PUTs per pack.
        self._tomb_senders: dict[str, asyncio.Task] = {}
        self._tomb_waiting: dict[str, _TombBatch] = {}
        self._unannounced: list[tuple[str, int, int, bytes]] = []  # packs this daemon wrote since
        self._unannounced_deletes: dict[str, list[ChunkId]] = {}  # pack name -> chunks deleted since
        self._deletes_pending = 0  # chunks in _unannounced_deletes
        self._own_manifests: list[tuple[int, str]] = []  # (created_ms, key), oldest first
        self._seen_manifests: dict[str, int] = {}  # manifests read (or skipped) -> created_ms
        self._manifest_ms = int(time.time() * 1000)  # newest manifest listed (older packs: the rebuild)
        # a pack no manifest announced by then is read from its own end
        self._orphan_ms = int(1000 * (3 * pack_poll_s + float(options.get("timeout_s", 5.0))))
        self.manifests_written = 0
        self.manifests_read = 0
        self._writer = secrets.randbits(32)
        self._seq = 0
        self._background: list[asyncio.Task] = []
        self._closing = False
        self.packs_written = 0
        self.packs_found = 0
        self.packs_expired = 0
        self.packs_dropped = 0

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await super().start()
        if self._listed:
            await self._expire(0)
        loop = asyncio.get_running_loop()
        self._background.append(loop.create_task(self._age_loop(), name=f"kvstored-s3pack-age-{self.name}"))
        if self._poll_s > 0:
            self._background.append(loop.create_task(self._poll_loop(), name=f"kvstored-s3pack-poll-{self.name}"))

    async def flush(self) -> None:
        """Send the open pack now and wait until every pack in flight has landed (or failed)."""
        self._seal()
        while self._uploads:
            await asyncio.wait(list(self._uploads))

    async def close(self) -> None:
        if not self._closed:
            self._closing = True  # writes from now on would never be sent
            for task in self._background:
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            self._background.clear()
            if self._client is not None:
                await self.flush()  # each PUT is bounded by timeout_s
                if self._owed and self.available:
                    await self._pay_tombstones()
                if self._poll_s > 0 and self.available:
                    try:  # so that running daemons need not wait for the orphan reads
                        await self._announce()
                    except (_Skipped, S3Failure) as exc:
                        log.debug("s3 tier %s: last manifest not sent: %s", self.name, exc)
        await super().close()

    async def _rebuild(self) -> None:
        """List the whole prefix once: one-object chunks into the object index, packs (their
        indexes read from their last bytes) into the pack index."""
        objects: list[tuple[ChunkId, int, float]] = []
        packs: list[tuple[str, int]] = []
        tombs: list[str] = []
        token: str | None = None
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": self.prefix, **({"ContinuationToken": token} if token else {})}
            page = await self._retrying(functools.partial(self._client.list_objects_v2, **kwargs))
            for obj in page.get("Contents", ()):
                key, size = obj["Key"], int(obj["Size"])
                if key.startswith(self._packs_prefix):
                    packs.append((key, size))
                elif key.startswith(self._tombs_prefix):
                    tombs.append(key)
                elif (chunk := chunkfile.parse_relpath(key[len(self.prefix) :])) is not None:
                    objects.append((chunk, size, obj["LastModified"].timestamp()))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break
        self._index.load(objects)
        await self._read_tombstones(tombs, {key for key, _size in packs})
        await self._adopt(packs, self._retrying)
        self._listed = True
        log.info(
            "s3 tier %s: %d packs (%s, %d chunks) and %d one-object chunks under %r",
            self.name,
            self._packs.packs,
            format_size(self._packs.used_bytes),
            len(self._packs),
            len(self._index),
            self.prefix,
        )

    # -- SecondaryTier ----------------------------------------------------------------------

    def _holds(self, chunk: ChunkId) -> bool:
        return chunk in self._buffered or chunk in self._packs or self._index.touch(chunk) is not None

    async def contains(self, chunks: Sequence[ChunkId]) -> list[bool]:
        """From the index alone (complete: listing at start, polls after): no requests."""
        self.counters.lookups += len(chunks)
        if not self.available:
            self.skipped += 1
            return [False] * len(chunks)
        out = [self._holds(chunk) for chunk in chunks]
        self.counters.hits += sum(out)
        return out

    async def write(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> WriteOutcome:
        if self._holds(chunk):
            return WriteOutcome.ALREADY_PRESENT
        if not self.available:
            self.skipped += 1
            return WriteOutcome.FAILED
        if not self._index.admit(chunk):
            self.counters.rejected_admission += 1
            return WriteOutcome.REJECTED_ADMISSION
        if self.capacity_bytes and HEADER_BYTES + size > self.capacity_bytes:
            self.counters.rejected_full += 1
            return WriteOutcome.REJECTED_FULL
        try:
            record = await self._off_loop(_encode, chunk, views, size)
        except _Skipped:
            return WriteOutcome.FAILED
        while True:  # room in the open pack, or an upload slot to send it and open another
            if self._holds(chunk):  # another write of it landed meanwhile
                return WriteOutcome.ALREADY_PRESENT
            if self._closed or self._closing:
                return WriteOutcome.FAILED
            current = self._filling
            if current is None or not current.nbytes or current.nbytes + len(record) <= self.pack_bytes:
                break
            if len(self._uploads) < self._pack_uploads:
                self._seal()
                break
            await asyncio.wait(list(self._uploads), return_when=asyncio.FIRST_COMPLETED)
        pack = self._filling
        if pack is None:
            pack = self._filling = _OpenPack(asyncio.get_running_loop().time())
            self._opened.set()
        pack.records[chunk] = record
        pack.nbytes += len(record)
        self._buffered[chunk] = pack
        self._buffered_bytes += len(record)
        self._missing.discard(chunk)
        self.counters.writes += 1
        self.counters.written_bytes += size
        if pack.nbytes >= self.pack_bytes and len(self._uploads) < self._pack_uploads:
            self._seal()
        return WriteOutcome.WRITTEN

    async def read(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> bool:
        targets = trim(views, size)
        buffered = self._buffered.get(chunk)
        if buffered is not None:  # still in memory (open, or its pack on its way)
            receiver = RecordReceiver(chunk, size, targets)
            try:  # (a 2 MiB copy and hash: off the event loop)
                await self._off_loop(receiver.feed, buffered.records[chunk])
            except _Skipped:
                return False
            return self._served(chunk, size, receiver.problem())
        found = self._packs.find(chunk)
        if found is None:
            return chunk in self._index and await super().read(chunk, views, size)
        pack, entry = found
        if entry.size != size:  # not the chunk that was asked for: never served
            self._corrupt(chunk, pack, f"pack record holds {entry.size} bytes, expected {size}")
            return False
        if not self.available:
            self.skipped += 1
            return False
        try:
            got = await self._call(lambda: self._receive(pack.key, RecordReceiver(chunk, size, targets), entry.offset))
        except _Skipped:
            return False
        except S3Failure as exc:
            if exc.fault is Fault.NOT_FOUND:  # expired by another daemon, or a lifecycle rule
                self._forget(pack, "vanished")
            elif exc.detail == "InvalidRange":
                await self._check_length(pack, "a ranged read was refused (InvalidRange)")
            else:
                self._failed("read", pack.key, exc)
            return False
        if not got.read:  # shorter than its index says: truncated or replaced, if a HEAD agrees
            await self._check_length(pack, f"a ranged read answered {got.length} bytes, not {HEADER_BYTES + size}")
            return False
        if self._packs.find(chunk) is None:  # dropped while the GET ran (deleted, expired)
            return False
        return self._served(chunk, size, got.problem, pack)

    async def remove(self, chunk: ChunkId) -> bool:
        """Stop serving the chunk. A packed record stays in its object until the pack expires or
        has no live chunk left; a tombstone keeps a rebuild from serving it, and the next manifest
        tells the daemons running on the bucket. Returns once the tombstone is stored; raises
        TierUnavailable while it cannot be (the chunk is not served meanwhile; a retried remove,
        the polls and close() store it)."""
        removed = False
        pack = self._buffered.pop(chunk, None)
        if pack is not None:
            removed = True
            if not pack.sealed:  # not part of the object at all
                record = pack.records.pop(chunk)
                pack.nbytes -= len(record)
                self._buffered_bytes -= len(record)
            elif pack.upload is not None:  # its record goes into the object: tombstoned once it lands
                await asyncio.wait((pack.upload,))
        copies = self._packs.copies(chunk)  # (two daemons may have packed it: every copy goes)
        if copies:
            removed = True
            self._packs.drop_chunk(chunk)
            for held in copies:
                self._owe_tombstone(held.key, [chunk])
                if not held.live:  # nothing left in it to serve (a spare copy is served elsewhere)
                    self._forget(held, "emptied", delete=True)
        owed = self._owed_by.get(chunk)
        if owed:  # (including a tombstone that did not land before: this is the retry)
            removed = True
            for pack_key in list(owed):
                await self._store_tombstone(pack_key, [chunk])
        if chunk in self._index or not removed:  # a one-object copy (S3Tier's DELETE by name)
            removed = await super().remove(chunk) or removed
        return removed

    def _owe_tombstone(self, pack_key: str, chunks: Sequence[ChunkId]) -> None:
        """Chunks deleted from a pack whose records stay in it: for the next manifest (running
        daemons), and owed a tombstone object (for a rebuild)."""
        name = pack_key[len(self._packs_prefix) :]
        if self._poll_s > 0 and self._deletes_pending < MAX_UNANNOUNCED_DELETES:
            self._unannounced_deletes.setdefault(name, []).extend(chunks)
            self._deletes_pending += len(chunks)
        self._owed.setdefault(pack_key, set()).update(chunks)
        for chunk in chunks:
            self._owed_by.setdefault(chunk, set()).add(pack_key)

    def _paid(self, pack_key: str, chunks: Sequence[ChunkId]) -> None:
        """These chunks of the pack are owed no tombstone any more (stored, or the pack is gone)."""
        owed = self._owed.get(pack_key)
        if owed is None:
            return
        for chunk in chunks:
            owed.discard(chunk)
            packs = self._owed_by.get(chunk)
            if packs is not None:
                packs.discard(pack_key)
                if not packs:
                    del self._owed_by[chunk]
        if not owed:
            del self._owed[pack_key]

    async def _store_tombstone(self, pack_key: str, chunks: Sequence[ChunkId]) -> None:
        """Return once a tombstone of the pack naming these chunks is stored: the next PUT for
        that pack, with the chunks of the other callers waiting for it (none that is no longer
        owed: stored meanwhile, or the pack deleted). Raises TierUnavailable naming it when it
        could not be stored (they stay owed)."""
        loop = asyncio.get_running_loop()
        batch = self._tomb_waiting.get(pack_key)
        if batch is None:
            batch = self._tomb_waiting[pack_key] = _TombBatch(set(), loop.create_future())
        batch.chunks.update(chunks)
        if pack_key not in self._tomb_senders:
            task = self._tomb_senders[pack_key] = loop.create_task(self._send_tombstones(pack_key))
            self._uploads.add(task)  # close() waits for it as for an upload
            task.add_done_callback(self._uploads.discard)
        problem = await asyncio.shield(batch.done)  # (a caller cancelled leaves the PUT to the others)
        if problem is not None:
            raise TierUnavailable(problem)

    async def _send_tombstones(self, pack_key: str) -> None:
        """The pack's tombstone PUTs, one at a time, each naming the chunks that waited for it."""
        batch: _TombBatch | None = None
        try:
            while (batch := self._tomb_waiting.pop(pack_key, None)) is not None:
                owed = self._owed.get(pack_key, set())
                chunks = [chunk for chunk in batch.chunks if chunk in owed]
                batch.done.set_result(await self._put_tombstone(pack_key, chunks) if chunks else None)
        finally:
            del self._tomb_senders[pack_key]
            for left in (batch, self._tomb_waiting.pop(pack_key, None)):  # (cancelled, or a bug)
                if left is not None and not left.done.done():
                    left.done.set_result(f"s3 tier {self.name}: tombstone of {pack_key} not stored (PUT abandoned)")

    async def _put_tombstone(self, pack_key: str, chunks: list[ChunkId]) -> str | None:
        """PUT one tombstone naming these chunks of the pack; None once stored (they are paid),
        else why not (they stay owed)."""
        name = pack_key[len(self._packs_prefix) : -len(packfile.PACK_SUFFIX)]
        self._seq += 1
        tomb = packfile.pack_name(int(time.time() * 1000), self._writer, self._seq, packfile.TOMBSTONE_SUFFIX)
        key = f"{self._tombs_prefix}{name}/{tomb}"
        body = packfile.encode_tombstone(chunks)
        try:
            await self._call(lambda: self._client.put_object(Bucket=self.bucket, Key=key, Body=body))
        except (_Skipped, S3Failure) as exc:
            if isinstance(exc, S3Failure):
                self._failed("store tombstone", key, exc)
            why = str(exc) if isinstance(exc, S3Failure) else f"{self.endpoint_url or 'S3'} is not answering"
            return (
                f"s3 tier {self.name}: cannot store tombstone {key} of {len(chunks)} chunks deleted from "
                f"{pack_key}: {why}; they are not served, retry the delete"
            )
        self._paid(pack_key, chunks)  # (chunks deleted during the PUT stay owed)
        return None

    async def _pay_tombstones(self) -> None:
        """Store the tombstones still owed (a remove() that raised and was not retried); stops at
        the first failure."""
        for pack_key in list(self._owed):
            try:
                await self._store_tombstone(pack_key, list(self._owed.get(pack_key, ())))
            except TierUnavailable as exc:
                log.debug("%s", exc)
                return

    def known_chunks(self, namespace_id: str) -> list[ChunkId]:
        found = dict.fromkeys(self._packs.chunks_of(namespace_id))
        found.update(dict.fromkeys(c for c in self._buffered if c[0] == namespace_id))
        found.update(dict.fromkeys(self._index.chunks_of(namespace_id)))
        return list(found)

    async def namespace_chunks(self, namespace_id: str) -> list[ChunkId]:
        found = dict.fromkeys(self.known_chunks(namespace_id))
        found.update(dict.fromkeys(await super().namespace_chunks(namespace_id)))
        return list(found)

    def usage(self) -> TierUsage:
        used = self._packs.used_bytes + self._index.used_bytes + self._buffered_bytes
        return TierUsage(self.capacity_bytes, used, len(self._packs) + len(self._buffered) + len(self._index))

    def pack_usage(self) -> PackUsage:
        live, quarters = self._packs.live_summary(4)
        return PackUsage(
            self._packs.packs,
            self._packs.used_bytes,
            live,
            (quarters[0], quarters[1], quarters[2], quarters[3]),
            self.packs_written,
            self.packs_expired,
            self.packs_dropped,
        )

    def live_fraction(self, pack_key: str) -> float | None:
        """The share of a pack's bytes this daemon still serves (None: not indexed)."""
        pack = self._packs.pack(pack_key)
        return None if pack is None else pack.live_fraction

    # -- packs: sealing, uploading, expiry ----------------------------------------------------

    def _seal(self) -> None:
        pack, self._filling = self._filling, None
        if pack is None or not pack.records or self._client is None:
            return
        pack.sealed = True
        task = pack.upload = asyncio.get_running_loop().create_task(self._upload(pack))
        self._uploads.add(task)
        task.add_done_callback(self._uploads.discard)

    async def _upload(self, pack: _OpenPack) -> None:
        created_ms = int(time.time() * 1000)
        self._seq += 1
        key = self._packs_prefix + packfile.pack_name(created_ms, self._writer, self._seq)
        self._uploading[key] = created_ms
        size = 0
        index = b""
        entries: list[PackEntry] = []
        stored = False
        try:
            parts, entries, index = await self._off_loop(_assemble, list(pack.records.items()))
            size = sum(len(p) for p in parts)
            self._reserved += size
            try:
                await self._expire(0)
                await self._call(lambda: self._client.put_object(Bucket=self.bucket, Key=key, Body=PartsStream(parts)))
                stored = True
            finally:
                self._reserved -= size
        except _Skipped:
            pass
        except S3Failure as exc:
            self._failed("write", key, exc)
        finally:
            self._uploading.pop(key, None)
            live = []
            for chunk, record in pack.records.items():
                if self._buffered.get(chunk) is pack:
                    del self._buffered[chunk]
                    live.append(chunk)
                self._buffered_bytes -= len(record)
            if stored:
                self.packs_written += 1
                if self._poll_s > 0:
                    name = key[len(self._packs_prefix) :]
                    self._unannounced.append((name, size, created_ms, index))
                    del self._unannounced[:-MAX_UNANNOUNCED]
                alive = set(live)
                deleted = [e.chunk for e in entries if e.chunk not in alive]  # while the PUT ran
                if deleted:  # their records are in the object: their removers store the tombstone
                    self._owe_tombstone(key, deleted)
                self._packs.add(key, size, created_ms, [e for e in entries if e.chunk in alive])
                indexed = self._packs.pack(key)
                if indexed is not None and not indexed.live:  # every chunk was deleted meanwhile
                    self._forget(indexed, "emptied", delete=True)
            else:
                log.warning(
                    "s3 tier %s: a pack of %d chunks could not be stored; they are dropped", self.name, len(live)
                )
                for chunk in live:
                    self.notify_removed(chunk, RemovalCause.EVICTED)
        # packs PUT at once are indexed as they land, in any order: the capacity is kept here too
        # (an expiry waiting for an older pack in flight happens once that one lands or fails)
        await self._expire(0)

    async def _expire(self, incoming: int) -> None:
        """Make room within the capacity for `incoming` more bytes: one-object chunks first (LRU),
        then whole packs, oldest first."""
        if not self.capacity_bytes:
            return
        budget = self.capacity_bytes - self._reserved - incoming
        legacy = self._index.shrink_to(max(0, budget - self._packs.used_bytes))
        # never a pack newer than one still in flight: oldest first, whichever lands first
        before_ms = min(self._uploading.values(), default=None)
        victims = self._packs.expire(max(0, budget - self._index.used_bytes), before_ms)
        for pack in victims:
            self.packs_expired += 1
            self.counters.evictions += len(pack.live)
            for chunk in pack.live:
                self.notify_removed(chunk, RemovalCause.EVICTED)
        if legacy:
            await self._evict(self._claim_deletes(legacy))
        if victims:
            await asyncio.gather(*(self._delete_pack(pack.key) for pack in victims))

    def _forget(self, pack: Pack, why: str, delete: bool = False) -> None:
        """Drop a pack from the index (its chunks become misses); delete its object if it is ours
        to delete (no live chunk left, or damaged), in a tracked task."""
        if self._packs.drop_pack(pack.key) is None:
            return
        if why != "emptied":
            self.packs_dropped += 1
            log.warning("s3 tier %s: pack %s %s; its %d chunks are misses", self.name, pack.key, why, len(pack.live))
        self._remember_gone(pack.key)
        if delete:
            task = asyncio.get_running_loop().create_task(self._delete_pack(pack.key))
            self._uploads.add(task)  # close() waits for it as for an upload
            task.add_done_callback(self._uploads.discard)

    def _remember_gone(self, key: str) -> None:
        self._gone[key] = None
        if len(self._gone) > GONE_LIMIT:
            self._gone.popitem(last=False)

    async def _delete_pack(self, key: str) -> None:
        self._remember_gone(key)
        try:
            await self._call(lambda: self._client.delete_object(Bucket=self.bucket, Key=key))
        except _Skipped:
            self._undeleted_packs.add(key)
            return
        except S3Failure as exc:
            if exc.fault is not Fault.NOT_FOUND:
                self._failed("delete", key, exc)
                self._undeleted_packs.add(key)
                return
        self._undeleted_packs.discard(key)
        self._paid(key, list(self._owed.get(key, ())))  # no record left to serve: its tombstone is moot

    # -- packs written by others: polling ------------------------------------------------------

    async def _age_loop(self) -> None:
        """Send the open pack once it is pack_age_s old (a slow trickle of write-downs)."""
        loop = asyncio.get_running_loop()
        while True:
            pack = self._filling
            if pack is None:
                self._opened.clear()
                await self._opened.wait()
                continue
            delay = pack.opened_at + self._pack_age_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            while len(self._uploads) >= self._pack_uploads:
                await asyncio.wait(list(self._uploads), return_when=asyncio.FIRST_COMPLETED)
            if self._filling is pack:
                self._seal()

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            if not self.available or not self._ready:
                continue
            try:
                await self._announce()
                before = self._packs.packs
                await self._read_manifests()
                await self._discover()
                self.packs_found += self._packs.packs - before
                await self._expire(0)
                await self._prune_manifests()
                for key in list(self._undeleted_packs):
                    await self._delete_pack(key)
                await self._pay_tombstones()
            except (_Skipped, S3Failure) as exc:
                log.debug("s3 tier %s: pack listing failed: %s", self.name, exc)
            except Exception:  # noqa: BLE001 - the next poll tries again; the loop must not end
                log.exception("s3 tier %s: pack listing failed", self.name)

    async def _announce(self) -> None:
        """One manifest naming the packs written and the packed chunks deleted since the last one
        (nothing when there were none)."""
        if not self._unannounced and not self._unannounced_deletes:
            return
        items = list(self._unannounced)
        deleted = {name: list(chunks) for name, chunks in self._unannounced_deletes.items()}
        created_ms = int(time.time() * 1000)
        self._seq += 1
        key = self._manifests_prefix + packfile.pack_name(created_ms, self._writer, self._seq, packfile.MANIFEST_SUFFIX)
        body = packfile.encode_manifest(items, list(deleted.items()))
        await self._call(lambda: self._client.put_object(Bucket=self.bucket, Key=key, Body=body))
        del self._unannounced[: len(items)]
        for name, chunks in deleted.items():  # (deletes made during the PUT stay for the next one)
            rest = self._unannounced_deletes.pop(name)[len(chunks) :]
            if rest:
                self._unannounced_deletes[name] = rest
            self._deletes_pending -= len(chunks)
        self._own_manifests.append((created_ms, key))
        self.manifests_written += 1

    async def _read_manifests(self) -> None:
        """Index the packs the other daemons' new manifests announce: one LIST, one GET each."""
        start_after = self._manifests_prefix + packfile.time_marker(self._manifest_ms - LIST_OVERLAP_MS)
        listing = await self._call(functools.partial(self._list_after, self._manifests_prefix, start_after))
        to_read: dict[str, int] = {}
        for key, size in listing:
            name = key[len(self._manifests_prefix) :]
            created_ms = packfile.parse_pack_name(name, packfile.MANIFEST_SUFFIX)
            if created_ms is None or key in self._seen_manifests:
                continue
            self._manifest_ms = max(self._manifest_ms, created_ms)
            if packfile.writer_of(name) == self._writer or size > packfile.MAX_MANIFEST_BYTES:
                self._seen_manifests[key] = created_ms
            else:
                to_read[key] = created_ms
        bodies = await asyncio.gather(
            *(self._call(functools.partial(self._read_all, key)) for key in to_read), return_exceptions=True
        )
        for (key, created_ms), data in zip(to_read.items(), bodies):
            if isinstance(data, S3Failure) and data.fault is Fault.NOT_FOUND:
                manifest = packfile.Manifest([], [])
            elif isinstance(data, BaseException):
                if not isinstance(data, (S3Failure, _Skipped)):
                    raise data
                continue  # read again at the next poll
            else:
                try:
                    manifest = packfile.decode_manifest(data)
                except CorruptPack as exc:
                    log.warning("s3 tier %s: manifest %s skipped: %s", self.name, key, exc)
                    manifest = packfile.Manifest([], [])
            self._seen_manifests[key] = created_ms
            self.manifests_read += 1
            for pack in manifest.packs:
                pack_key = self._packs_prefix + pack.name
                if not self._packs.has_pack(pack_key) and pack_key not in self._gone:
                    dead = self._dead.pop(pack_key, ())
                    self._packs.add(
                        pack_key, pack.size, pack.created_ms, [e for e in pack.entries if e.chunk not in dead]
                    )
                    self._seen_ms = max(self._seen_ms, pack.created_ms)
            for name, chunks in manifest.deleted:  # after the packs: a pack and deletes from it
                self._deleted_elsewhere(self._packs_prefix + name, chunks)
        horizon = self._manifest_ms - 2 * LIST_OVERLAP_MS
        for key in [k for k, ms in self._seen_manifests.items() if ms < horizon]:
            del self._seen_manifests[key]

    def _deleted_elsewhere(self, pack_key: str, chunks: Sequence[ChunkId]) -> None:
        """Another daemon deleted these chunks from this pack: stop serving them (a pack left with
        no live chunk is deleted, as this daemon's own deletes do); for a pack not indexed yet,
        remember them for when it is."""
        pack = self._packs.pack(pack_key)
        if pack is None:
            if pack_key not in self._gone and pack_key not in self._uploading:
                self._dead.setdefault(pack_key, set()).update(chunks)
                while len(self._dead) > MAX_DEAD_PACKS:
                    del self._dead[next(iter(self._dead))]
            return
        emptied = None
        for chunk in chunks:
            served = chunk in pack.live  # (a copy in another pack is not this deletion's)
            emptied = self._packs.drop_copy(chunk, pack_key) or emptied
            if served:
                self.notify_removed(chunk, RemovalCause.DELETED)
        if emptied is not None:
            self._forget(emptied, "emptied", delete=True)

    async def _prune_manifests(self) -> None:
        """Delete this daemon's manifests that every reader has listed by now."""
        horizon = int(time.time() * 1000) - MANIFEST_TTL_MS
        while self._own_manifests and self._own_manifests[0][0] < horizon:
            _created, key = self._own_manifests[0]
            try:
                await self._call(lambda: self._client.delete_object(Bucket=self.bucket, Key=key))  # noqa: B023
            except S3Failure as exc:
                if exc.fault is not Fault.NOT_FOUND:
                    raise
            self._own_manifests.pop(0)

    async def _discover(self) -> None:
        """Read the index of the packs no manifest announced (listed after the newest pack seen,
        less the overlap, and older than the orphan age), and of those whose index could not be
        read last time: one LIST (a page per 1,000 names) per poll, GETs only for orphans."""
        start_after = self._packs_prefix + packfile.time_marker(self._seen_ms - LIST_OVERLAP_MS)
        listing = await self._call(functools.partial(self._list_after, self._packs_prefix, start_after))
        retry, self._retry_index = self._retry_index, {}
        await self._adopt([*listing, *retry.items()], self._call, int(time.time() * 1000) - self._orphan_ms)

    async def _list_after(self, prefix: str, start_after: str) -> list[tuple[str, int]]:
        found: list[tuple[str, int]] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            kwargs.update({"ContinuationToken": token} if token else {"StartAfter": start_after})
            page = await self._client.list_objects_v2(**kwargs)
            found += [(obj["Key"], int(obj["Size"])) for obj in page.get("Contents", ())]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found

    async def _adopt(self, listing: Sequence[tuple[str, int]], send: Send, before_ms: int | None = None) -> None:
        """Read the index of every listed pack not known yet (created before `before_ms`, when
        given: younger ones wait for their manifest) and index its chunks."""
        new: dict[str, tuple[int, int]] = {}
        for key, size in listing:
            created_ms = packfile.parse_pack_name(key[len(self._packs_prefix) :])
            if created_ms is None:
                continue
            if before_ms is not None and created_ms > before_ms:
                continue  # (not counted as seen: listed again next time)
            self._seen_ms = max(self._seen_ms, created_ms)
            if not self._packs.has_pack(key) and key not in self._uploading and key not in self._gone:
                new[key] = (size, created_ms)
        results = await asyncio.gather(
            *(self._read_index(key, size, send) for key, (size, _ms) in new.items()), return_exceptions=True
        )
        for (key, (size, created_ms)), result in zip(new.items(), results):
            if isinstance(result, list):
                if key not in self._gone:  # (dropped while its index was read)
                    dead = self._dead.pop(key, ())
                    self._packs.add(key, size, created_ms, [e for e in result if e.chunk not in dead])
            elif isinstance(result, (S3Failure, _Skipped)):
                if not (isinstance(result, S3Failure) and result.fault is Fault.NOT_FOUND):
                    self._retry_index[key] = size
            elif isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # cancellation

    async def _read_tombstones(self, tombs: Sequence[str], packs: set[str]) -> None:
        """At start: the chunks deleted from each listed pack; tombstones of packs gone are deleted."""
        live: dict[str, str] = {}
        garbage: list[str] = []
        for key in tombs:
            stem = key[len(self._tombs_prefix) :].partition("/")[0]
            pack_key = f"{self._packs_prefix}{stem}{packfile.PACK_SUFFIX}"
            if pack_key in packs:
                live[key] = pack_key
            else:
                garbage.append(key)
        bodies = await asyncio.gather(
            *(self._retrying(functools.partial(self._read_all, key)) for key in live), return_exceptions=True
        )
        for (key, pack_key), data in zip(live.items(), bodies):
            if isinstance(data, BaseException):
                if not isinstance(data, Exception):
                    raise data
                log.warning("s3 tier %s: tombstone %s unreadable: %s", self.name, key, data)
                continue
            try:
                self._dead.setdefault(pack_key, set()).update(packfile.decode_tombstone(data))
            except CorruptPack as exc:
                log.warning("s3 tier %s: tombstone %s skipped: %s", self.name, key, exc)
        await asyncio.gather(
            *(
                self._retrying(functools.partial(self._client.delete_object, Bucket=self.bucket, Key=key))
                for key in garbage
            ),
            return_exceptions=True,
        )

    async def _read_index(self, key: str, size: int, send: Send) -> list[PackEntry] | None:
        """A pack's entries from its last bytes (a second ranged GET if its index is longer);
        None for a pack that is not readable (damaged: deleted; newer format: left alone)."""
        want = min(size, TAIL_BYTES)
        for _ in range(2):
            tail = await send(functools.partial(self._get_range, key, size - want, want, size))
            if tail is None:  # not the size it was listed with: replaced or truncated meanwhile
                raise S3Failure(Fault.NOT_FOUND, "changed since listed")
            try:
                got = packfile.decode_index(tail, size)
            except UnsupportedPack as exc:
                log.warning("s3 tier %s: pack %s left alone: %s", self.name, key, exc)
                self._remember_gone(key)
                return None
            except CorruptPack as exc:
                self.counters.checksum_failures += 1
                self.packs_dropped += 1
                log.warning("s3 tier %s: unreadable pack %s deleted: %s", self.name, key, exc)
                await self._delete_pack(key)
                return None
            if not isinstance(got, NeedTail):
                return got
            want = min(size, got.nbytes)
        return None

    # -- reads ------------------------------------------------------------------------------

    async def _get_range(self, key: str, start: int, length: int, size: int) -> bytes | None:
        """Bytes [start, start + length) of the object of `size` bytes (None: it is not that size
        now). For the small reads (a pack's index); a chunk's record streams into its views
        (_receive). An answer that is not that range (Range ignored) raises: a failed read."""
        response = await self._client.get_object(
            Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}"
        )
        async with response["Body"] as stream:  # closes the connection if the body is left unread
            check_range(response, start, length)
            got = content_range(response)
            if int(response["ContentLength"]) != length or (got is not None and got[2] not in (None, size)):
                return None
            return await stream.read()

    async def _check_length(self, pack: Pack, what: str) -> None:
        """A ranged read of the pack came back short: drop (and delete) it only if a HEAD says the
        object is not the size indexed (truncated or replaced); if it is, the read just failed."""
        try:
            head = await self._call(lambda: self._client.head_object(Bucket=self.bucket, Key=pack.key))
        except _Skipped:
            return
        except S3Failure as exc:
            if exc.fault is Fault.NOT_FOUND:
                self._forget(pack, "vanished")
            else:
                self._failed("check the length of", pack.key, exc)
            return
        length = int(head.get("ContentLength", -1))
        if length == pack.size:
            self.counters.errors += 1
            log.warning("s3 tier %s: pack %s: %s; it is %d bytes, as indexed: kept", self.name, pack.key, what, length)
            return
        self.counters.checksum_failures += 1
        self._forget(pack, f"is {length} bytes, {pack.size} indexed (truncated or replaced)", delete=True)

    def _served(self, chunk: ChunkId, size: int, problem: str | None, pack: Pack | None = None) -> bool:
        if problem is not None:
            self._corrupt(chunk, pack, problem)
            return False
        self.counters.reads += 1
        self.counters.read_bytes += size
        return True

    def _corrupt(self, chunk: ChunkId, pack: Pack | None, problem: str) -> None:
        self.counters.checksum_failures += 1
        log.warning(
            "s3 tier %s: %s of pack %s is not served: %s",
            self.name,
            chunk[1].hex(),
            pack.key if pack else "(memory)",
            problem,
        )
        if pack is None:
            return
        found = self._packs.find(chunk)
        if found is not None and found[0] is pack:
            self.notify_removed(chunk, RemovalCause.CORRUPT)
        # only this copy: another pack's (two daemons packed the chunk) is still tombstoned by a delete
        emptied = self._packs.drop_copy(chunk, pack.key)
        if emptied is not None:
            self._forget(emptied, "emptied", delete=True)


def _assemble(records: list[tuple[ChunkId, bytes]]) -> tuple[list[bytes], list[PackEntry], bytes]:
    """The pack object's parts (the records back to back, then their index; not copied) and its
    entries and index."""
    entries: list[PackEntry] = []
    offset = 0
    for chunk, record in records:
        header = chunkfile.decode_header(memoryview(record)[:HEADER_BYTES])
        entries.append(PackEntry(chunk, offset, header.payload_len, header.checksum))
        offset += len(record)
    index = packfile.encode_index(entries, offset)
    return [*(r for _c, r in records), index], entries, index
