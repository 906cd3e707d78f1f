# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Capacity bookkeeping the fs and s3 tiers share: which chunks are stored, LRU order, capacity, admission.

No I/O here; the tier (FsTier, S3Tier) does the work and tells the index what happened.
Invariants:
- `used_bytes` is the sum of the indexed files' sizes on disk;
- `reserved_bytes` is the room promised to writes in flight (planned file sizes);
- a reservation is granted only if used + reserved stays within capacity, after evicting LRU entries
  (every indexed entry is evictable: open readers keep an unlinked file's bytes alive by themselves).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvstored.chunks.ids import ChunkId
from kvstored.tiers.base import AdmissionPolicy

SEEN_ONCE_LIMIT = 100_000  # chunk ids remembered by SECOND_EVICTION admission


@dataclass(eq=False, slots=True)
class CapacityEntry:
    """One file on disk. Identity matters: a reader removes an entry only if it is still the one it read."""

    size: int  # the file's length on disk (header + payload, page-rounded for O_DIRECT files)
    mtime: float  # wall-clock seconds of the file's last mtime update (restart LRU order)


@dataclass(slots=True)
class Reservation:
    granted: bool
    size: int = 0
    victims: list[tuple[ChunkId, CapacityEntry]] = field(default_factory=list)  # evicted: unlink their files


class CapacityIndex:
    def __init__(
        self,
        capacity_bytes: int,
        admission: AdmissionPolicy = AdmissionPolicy.ALWAYS,
        seen_once_limit: int = SEEN_ONCE_LIMIT,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError("fs tier capacity must be positive")
        self.capacity_bytes = capacity_bytes
        self.admission = admission
        self.used_bytes = 0
        self.reserved_bytes = 0
        self._entries: OrderedDict[ChunkId, CapacityEntry] = OrderedDict()  # least recently used first
        self._seen_once: OrderedDict[ChunkId, None] = OrderedDict()
        self._seen_once_limit = seen_once_limit

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, chunk: ChunkId) -> bool:
        return chunk in self._entries

    def chunks_of(self, namespace_id: str) -> list[ChunkId]:
        return [c for c in self._entries if c[0] == namespace_id]

    def chunks(self) -> list[ChunkId]:
        """Every indexed chunk, least recently used first."""
        return list(self._entries)

    def get(self, chunk: ChunkId) -> CapacityEntry | None:
        return self._entries.get(chunk)

    def touch(self, chunk: ChunkId) -> CapacityEntry | None:
        """Mark a use: the entry becomes the most recently used."""
        entry = self._entries.get(chunk)
        if entry is not None:
            self._entries.move_to_end(chunk)
        return entry

    def insert(self, chunk: ChunkId, size: int, mtime: float) -> CapacityEntry:
        """Index a file as the most recently used; replaces an entry for the same chunk."""
        old = self._entries.pop(chunk, None)
        if old is not None:
            self.used_bytes -= old.size
        entry = CapacityEntry(size, mtime)
        self._entries[chunk] = entry
        self.used_bytes += size
        return entry

    def discard(self, chunk: ChunkId, entry: CapacityEntry | None = None) -> CapacityEntry | None:
        """Drop `chunk` (only if its entry is still `entry`, when one is given)."""
        current = self._entries.get(chunk)
        if current is None or (entry is not None and current is not entry):
            return None
        del self._entries[chunk]
        self.used_bytes -= current.size
        return current

    def reserve(self, size: int) -> Reservation:
        """Room for a new file of `size` bytes, evicting LRU entries as needed.

        Refused (nothing evicted) when the file could not fit even with every indexed file gone:
        bigger than the capacity, or the capacity is held by writes in flight."""
        if self.reserved_bytes + size > self.capacity_bytes:
            return Reservation(False)
        victims = self._evict_until(self.capacity_bytes - self.reserved_bytes - size)
        self.reserved_bytes += size
        return Reservation(True, size, victims)

    def release(self, reservation: Reservation) -> None:
        """The write is over (the file is indexed with insert(), or it failed)."""
        if reservation.granted:
            self.reserved_bytes -= reservation.size
            reservation.granted = False

    def shrink_to_capacity(self) -> list[tuple[ChunkId, CapacityEntry]]:
        """Evict LRU entries until the indexed files fit (after a rebuild or adopting files)."""
        return self._evict_until(self.capacity_bytes - self.reserved_bytes)

    def shrink_to(self, budget: int) -> list[tuple[ChunkId, CapacityEntry]]:
        """Evict LRU entries until the indexed files take at most `budget` bytes."""
        return self._evict_until(budget)

    def load(self, entries: list[tuple[ChunkId, int, float]]) -> None:
        """Rebuild: (chunk, size, mtime) triples, indexed oldest mtime first (= least recently used)."""
        for chunk, size, mtime in sorted(entries, key=lambda e: e[2]):
            self.insert(chunk, size, mtime)

    def admit(self, chunk: ChunkId) -> bool:
        """Whether a write of a chunk that is not on disk may go ahead under the admission policy."""
        if self.admission is AdmissionPolicy.ALWAYS:
            return True
        if chunk in self._seen_once:
            del self._seen_once[chunk]
            return True
        self._seen_once[chunk] = None
        if len(self._seen_once) > self._seen_once_limit:
            self._seen_once.popitem(last=False)
        return False

    def _evict_until(self, budget: int) -> list[tuple[ChunkId, CapacityEntry]]:
        victims = []
        while self.used_bytes > budget and self._entries:
            chunk, entry = self._entries.popitem(last=False)
            self.used_bytes -= entry.size
            victims.append((chunk, entry))
        return victims
