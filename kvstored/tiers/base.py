# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What every tier shares: the secondary-tier interface, outcomes and counters."""

from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvstored.choices import Choice
from kvstored.chunks.ids import ChunkId, RemovalCause, TierKind


class WriteOutcome(enum.Enum):
    WRITTEN = enum.auto()
    ALREADY_PRESENT = enum.auto()
    REJECTED_ADMISSION = enum.auto()  # admission policy said not yet (e.g. first eviction)
    REJECTED_FULL = enum.auto()  # out of space (disk full / capacity pinned)
    FAILED = enum.auto()  # I/O or remote error; the chunk is simply not stored


@dataclass
class TierCounters:
    """Monotonic counters every secondary tier keeps (exported as stats and metrics)."""

    lookups: int = 0
    hits: int = 0
    reads: int = 0
    writes: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    bad_entries: int = 0  # not a chunk file under a chunk's name (FIFO, socket, directory, symlink...)
    errors: int = 0
    rejected_full: int = 0
    rejected_admission: int = 0


@dataclass(frozen=True)
class TierUsage:
    capacity_bytes: int  # 0 = unbounded
    used_bytes: int
    chunks: int


@dataclass(frozen=True)
class PackUsage:
    """Packed objects (the packed s3 tier): how much of their bytes are still live."""

    packs: int  # objects indexed
    bytes: int  # their sizes
    live_bytes: int  # records still served from them (the rest waits for the pack to expire)
    by_live_quarter: tuple[int, int, int, int]  # packs live [0, 25%), [25, 50%), [50, 75%), [75, 100%]
    written: int  # packs this daemon PUT
    expired: int  # packs deleted for capacity
    dropped: int  # packs found vanished, truncated or unreadable


RemovalListener = Callable[["SecondaryTier", ChunkId, RemovalCause], None]


@dataclass(frozen=True)
class TierCapabilities:
    """What the chain may ask of a tier below RAM (declared per kind in tiers/registry.py)."""

    accepts_writedowns: bool = True  # chunks leaving RAM (or new ones, write-through) are written to it
    accepts_deletes: bool = True  # Delete and ClearNamespace remove chunks from it
    admission: bool = False  # it has an admission policy (config `admission`, changed by SIGHUP)
    # Its chunks are on this node: peers are served from it (fs). Not shared storage (s3: a peer
    # reads the bucket itself) and never another node's chunks (peer: no loops, no amplification).
    local: bool = True


class SecondaryTier(abc.ABC):
    """A tier below RAM (fs, s3, peer). The tier chain drives it; it never touches the RAM tier.

    Buffers: `write` and `read` get the chunk's pool slot as a list of writable memoryviews.
    Each view starts on a page boundary (page_bytes is a multiple of 4096) and is a whole
    number of pages long, so O_DIRECT can use them as they are; only the first `size` bytes,
    in order across the views, are the payload. Everything read must be verified (checksum,
    length, namespace and key) before `read` returns True: wrong bytes are never served.
    Once `write` or `read` returns or raises (cancellation included), nothing may touch the
    views any more: the chain frees or reuses those pages at once.

    Failures: `contains`, `write` and `read` report them in their result (a miss, FAILED, False)
    and count them in `counters.errors`; an exception that escapes one anyway is logged by the
    chain and taken as that result. `remove` raises when a copy may remain (the caller's Delete
    fails and can be retried). `start` raises when the tier cannot work as configured (the daemon
    does not start). `close`, `usage`, `known_chunks` and `set_admission` do not raise.
    The chain only calls `write` on tiers whose capabilities accept write-downs and `remove` on
    tiers that accept deletes (besides undoing its own write of a chunk deleted meanwhile).
    """

    kind: ClassVar[TierKind]

    def __init__(self, name: str) -> None:
        self.name = name
        self.counters = TierCounters()
        self.removal_listener: RemovalListener | None = None  # set by the chain (KV events)

    def notify_removed(self, chunk: ChunkId, cause: RemovalCause) -> None:
        """Tiers call this when they drop a chunk on their own (capacity, corruption)."""
        if self.removal_listener is not None:
            self.removal_listener(self, chunk, cause)

    async def preflight(self) -> str:
        """Check what can be checked before the daemon populates its RAM tier (an fs root, an
        S3 bucket and its credentials, a peer tier's ports), quickly; one phrase saying what was
        checked, for the start-up log. Raises, naming the problem, when the tier cannot work as
        configured (the daemon exits 2 without populating). `start` follows unless this raised."""
        return "nothing to check before start"

    async def start(self) -> None:
        """Open the tier (fs: rebuild the index from disk; s3: check the bucket). Raises when the
        tier cannot work as configured."""

    async def close(self) -> None:
        """Finish or abandon in-flight work and release resources. Does not raise."""

    @abc.abstractmethod
    async def contains(self, chunks: Sequence[ChunkId]) -> list[bool]:
        """Which of `chunks` the tier holds, one bool per chunk, in order (batched: one call per
        lookup). A tier that cannot tell answers False (a miss is never wrong, only slower)."""

    def holds(self, chunks: Sequence[ChunkId]) -> list[bool]:
        """Which of `chunks` the tier's own index says it holds, asked with no I/O at all (a store
        copies these into RAM no more: a load brings them up). Hits count as a use of the chunk.
        A tier whose index is not its own storage (peer: other nodes' chunks) answers False."""
        return [False] * len(chunks)

    @abc.abstractmethod
    async def write(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> WriteOutcome:
        """Store the payload; the outcome says whether the tier now holds it (WRITTEN,
        ALREADY_PRESENT) or why not (REJECTED_ADMISSION, REJECTED_FULL, FAILED)."""

    @abc.abstractmethod
    async def read(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> bool:
        """Fill `views` with the verified payload; False for a miss, a corrupt or a truncated copy
        (corrupt or truncated copies are counted and removed), or a failure."""

    @abc.abstractmethod
    async def remove(self, chunk: ChunkId) -> bool:
        """Remove the chunk: True if a copy was there and is gone, False if there was none.
        Raises (TierUnavailable for the caller to see) when a copy may still be there."""

    @abc.abstractmethod
    def usage(self) -> TierUsage:
        """Capacity, bytes used and chunks held, now (cheap: read at every Stats call and scrape)."""

    def pack_usage(self) -> PackUsage | None:
        """Packed objects' live fractions (None: the tier does not pack; cheap, read at every Stats)."""
        return None

    def known_chunks(self, namespace_id: str) -> list[ChunkId]:
        """The chunks of a namespace this tier knows of (for clearing a namespace)."""
        return []

    async def namespace_chunks(self, namespace_id: str) -> list[ChunkId]:
        """Every chunk of a namespace the tier holds, as completely as it can tell (clearing a
        namespace; s3 lists them). Raises TierUnavailable when it cannot look."""
        return self.known_chunks(namespace_id)

    # Namespace records: one small record per namespace the tier holds chunks of
    # (kvstored.namespaces.encode_record), so a restarted daemon knows its namespaces before any
    # client registers them. A tier without storage of its own keeps none. These raise on failure.

    async def save_namespace_record(self, namespace_id: str, record: bytes) -> None:
        """Store (or replace) the record, atomically: a reader sees the old or the new one."""

    async def remove_namespace_record(self, namespace_id: str) -> None:
        """Remove the record, if there is one."""

    async def namespace_records(self) -> dict[str, bytes]:
        """Every record the tier holds, by namespace id."""
        return {}

    def set_admission(self, policy: AdmissionPolicy) -> None:
        """Change the admission policy at run time (SIGHUP reload); tiers without one ignore it."""

    def views_busy(self, views: Sequence[memoryview]) -> asyncio.Future | None:
        """After a `read` into `views` failed or was cancelled: a future that is done once nothing
        touches them any more, if something still may (a network transfer that could not be stopped
        in time: kvstored.peer.quarantine); None when they are free now (every tier but peer). The
        chain keeps the slot reserved until then."""
        return None


class AdmissionPolicy(Choice):
    ALWAYS = "always"
    SECOND_EVICTION = "second-eviction"  # store a chunk only the second time it is evicted
