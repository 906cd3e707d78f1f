# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Checking adopted chunks' bytes after a hand-over, without holding up serving.

A hand-over carries each chunk's xxh3-64 (kvstored/server/handover.py); the new daemon adopts the
index unverified (RamEntry.verified) and serves at once. A chunk is checked before anyone reads
it: before its first lease (Leases, region loads) or write-down, and by a background sweep over
all of them. One whose bytes differ is dropped (a miss, counted in the RAM tier's
verify_failures and published as REMOVED/CORRUPT), never served.

Hashing runs in threads (xxhash releases the GIL); an entry's result counts only if the RAM tier
still indexes it afterwards: its pages were never freed meanwhile, so the bytes hashed were its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvstored.chunks.ids import ChunkId, TierKind
from kvstored.events.bus import Cause, EventBus, EventType
from kvstored.sizes import format_size
from kvstored.tiers.ram import RamEntry, RamTier

log = logging.getLogger(__name__)

ArenaView = Callable[[int], memoryview]
SWEEP_BATCH_BYTES = 64 << 20  # per turn of the sweep: loads' own checks wait behind at most this much


@dataclass(frozen=True, slots=True)
class SweepStatus:
    running: bool
    finished: bool
    seconds: float  # so far, or in all once finished


class ChunkVerifier:
    def __init__(self, ram: RamTier, arena_view: ArenaView, events: EventBus, threads: int) -> None:
        self._ram = ram
        self._arena_view = arena_view
        self._events = events
        self._threads = max(1, threads)
        # One core left to serving: with every core hashing, health checks right after a
        # hand-over waited 0.5-2 s here (2 vCPUs); a read's own check uses them all.
        self._sweep_threads = max(1, self._threads - 1)
        self._pool: ThreadPoolExecutor | None = None
        self._sweep: asyncio.Task | None = None
        self._started = 0.0
        self._finished_s: float | None = None

    # -- checks before a read ------------------------------------------------------------------

    async def check(self, chunks: Sequence[ChunkId]) -> None:
        """Check those of `chunks` still unverified (none after the sweep: then this costs nothing)."""
        entries = self._ram.unverified(chunks)
        if entries:
            await self._check(entries)

    async def check_entries(self, entries: Sequence[RamEntry], threads: int | None = None) -> None:
        entries = [e for e in entries if not e.verified and e.indexed]
        if entries:
            await self._check(entries, threads)

    def check_now(self, entry: RamEntry) -> bool:
        """Check one leased entry here, blocking (a read that could not wait for check()); returns
        whether it is readable."""
        if entry.verified or not entry.indexed:
            return entry.indexed
        return self._settle([entry], [self._digest(entry)])

    # -- before a hand-over ------------------------------------------------------------------------

    async def hash_unknown(self) -> int:
        """Take the checksum of every READY chunk that has none, while the daemon still serves
        (a READY chunk's bytes never change): its stop then hashes only what is stored meanwhile.
        Returns the checksums taken."""
        entries = self._ram.unhashed()
        taken = 0
        for start in range(0, len(entries), 64):  # (batches: a store's commit waits for no long pass)
            batch = entries[start : start + 64]
            for entry, digest in zip(batch, await self._hash(batch), strict=True):
                if digest is not None and entry.indexed and entry.checksum is None:
                    entry.checksum = digest
                    taken += 1
        return taken

    # -- the sweep ----------------------------------------------------------------------------

    def start_sweep(self) -> None:
        """Check every unverified chunk in the background (owned here: close() stops it)."""
        if self._ram.unverified_count and self._sweep is None:
            self._started = time.perf_counter()
            self._sweep = asyncio.create_task(self._run_sweep(), name="kvstored-verify-sweep")

    def status(self) -> SweepStatus:
        if self._finished_s is not None:
            return SweepStatus(False, True, self._finished_s)
        running = self._sweep is not None and not self._sweep.done()
        return SweepStatus(running, False, time.perf_counter() - self._started if running else 0.0)

    async def close(self) -> None:
        task, self._sweep = self._sweep, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def _run_sweep(self) -> None:
        try:
            await self._sweep_all()
        except Exception:  # (not fatal: what it did not check, a first read checks)
            log.exception("the verify sweep stopped; chunks it did not check are checked at their first read")

    async def _sweep_all(self) -> None:
        ram, c = self._ram, self._ram.counters
        todo = ram.unverified()
        log.info(
            "verifying %d adopted chunks in the background (%s)",
            len(todo),
            format_size(sum(e.size for e in todo)),
        )
        before = (c.verified_chunks, c.verified_bytes, c.verify_failures)
        batch: list[RamEntry] = []
        size = 0
        for entry in todo:
            batch.append(entry)
            size += entry.size
            if size >= SWEEP_BATCH_BYTES:
                await self.check_entries(batch, self._sweep_threads)
                batch, size = [], 0
        await self.check_entries(batch, self._sweep_threads)
        self._finished_s = time.perf_counter() - self._started
        log.info(
            "every adopted chunk verified in %.2f s: %d chunks (%s) matched, %d dropped (altered since the hand-over)",
            self._finished_s,
            c.verified_chunks - before[0],
            format_size(c.verified_bytes - before[1]),
            c.verify_failures - before[2],
        )

    # -- internals ------------------------------------------------------------------------------

    async def _check(self, entries: list[RamEntry], threads: int | None = None) -> None:
        self._settle(entries, await self._hash(entries, threads))

    async def _hash(self, entries: list[RamEntry], threads: int | None = None) -> list[int | None]:
        """Each entry's digest (None: freed meanwhile), in `threads` threads (default: all)."""
        loop = asyncio.get_running_loop()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kvstored-verify")
        n = min(threads or self._threads, len(entries))
        parts = await asyncio.gather(
            *(loop.run_in_executor(self._pool, self._digests, entries[i::n]) for i in range(n))
        )
        out: list[int | None] = [None] * len(entries)
        for i, part in enumerate(parts):
            out[i::n] = part
        return out

    def _digests(self, entries: list[RamEntry]) -> list[int | None]:
        return [self._digest(e) for e in entries]

    def _digest(self, entry: RamEntry) -> int | None:
        runs = entry.runs  # (empty once freed: then the result does not count)
        if not runs:
            return None
        try:
            view = self._arena_view(entry.arena)
        except KeyError:  # its arena is gone: so is the entry
            return None
        from kvstored.chunks import chunkfile  # (here: the GPU machine's lean installs have no xxhash)

        pb = self._ram.page_bytes
        return chunkfile.checksum([view[r.start * pb : (r.start + r.count) * pb] for r in runs], entry.size)

    def _settle(self, entries: Sequence[RamEntry], digests: Sequence[int | None]) -> bool:
        dropped: list[ChunkId] = []
        readable = True
        for entry, digest in zip(entries, digests, strict=True):
            if not entry.indexed or entry.verified:
                readable = readable and entry.indexed
                continue
            if digest is not None and self._ram.verified(entry, digest == entry.checksum):
                continue
            readable = False
            if digest is not None:
                dropped.append(entry.chunk)
        if dropped:
            log.warning("%d adopted chunk(s) dropped: their bytes changed since the hand-over", len(dropped))
            self._events.publish(EventType.REMOVED, Cause.CORRUPT, "ram", TierKind.RAM, dropped)
        return readable
