"""What every tier shares: kinds, the secondary-tier interface, outcomes and counters."""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

ChunkId = tuple[str, bytes]  # (namespace id, key): keys are opaque bytes scoped by namespace


class TierKind(enum.IntEnum):
    """Mirrors kvstored.v1.TierKind; 0 is a miss."""

    NONE = 0
    RAM = 1
    FS = 2
    S3 = 3
    PEER = 4


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


class RemovalCause(enum.Enum):
    EVICTED = enum.auto()  # the tier's own capacity bound
    CORRUPT = enum.auto()  # failed verification


RemovalListener = Callable[["SecondaryTier", ChunkId, RemovalCause], None]


class SecondaryTier(abc.ABC):
    """A tier below RAM (fs, s3, peer). The tier chain drives it; it never touches the RAM tier.

    Buffers: `write` and `read` get the chunk's pool slot as a list of writable memoryviews.
    Each view starts on a page boundary (page_bytes is a multiple of 4096) and is a whole
    number of pages long, so O_DIRECT can use them as they are; only the first `size` bytes,
    in order across the views, are the payload. Everything read must be verified (checksum,
    length, namespace and key) before `read` returns True: wrong bytes are never served.
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

    async def start(self) -> None:
        """Open the tier (fs: rebuild the index from disk; s3: check the bucket)."""

    async def close(self) -> None:
        """Finish or abandon in-flight work and release resources."""

    @abc.abstractmethod
    async def contains(self, chunks: Sequence[ChunkId]) -> list[bool]:
        """Which of `chunks` the tier holds (batched: one call per lookup)."""

    @abc.abstractmethod
    async def write(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> WriteOutcome:
        ...

    @abc.abstractmethod
    async def read(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> bool:
        """Fill `views` with the verified payload; False for a miss, a corrupt or a truncated copy
        (corrupt or truncated copies are counted and removed)."""

    @abc.abstractmethod
    async def remove(self, chunk: ChunkId) -> bool:
        ...

    @abc.abstractmethod
    def usage(self) -> TierUsage:
        ...

    def known_chunks(self, namespace_id: str) -> list[ChunkId]:
        """The chunks of a namespace this tier knows of (for clearing a namespace)."""
        return []

    def set_admission(self, policy: "AdmissionPolicy") -> None:
        """Change the admission policy at run time (SIGHUP reload); tiers without one ignore it."""


class AdmissionPolicy(enum.Enum):
    ALWAYS = "always"
    SECOND_EVICTION = "second-eviction"  # store a chunk only the second time it is evicted
