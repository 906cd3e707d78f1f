# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Which chunk is in which pack, and how much of each pack is still live (the packed s3 tier).

No I/O here; the tier (kvstored/tiers/s3pack.py) does the requests and tells the index what
happened. Invariants:
- every indexed chunk is served by exactly one pack: the newest one holding it (by created_ms,
  then key), whatever the order packs are indexed in; a copy in an older pack is dead weight
  there (a chunk deleted and stored again is served with its new bytes even where the old copy's
  tombstone is missing), kept as a spare so that a delete can tombstone every copy;
- `used_bytes` is the sum of the indexed packs' object sizes, live or not;
- a pack leaves the index whole (expiry, oldest first; vanished; or no live chunk left), and
  with it every chunk it served.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvstored.chunks.ids import ChunkId
from kvstored.chunks.packfile import PackEntry


@dataclass(eq=False, slots=True)
class Pack:
    key: str  # the object's full key
    size: int  # the object's bytes
    created_ms: int  # from its name: expiry order, the same on every daemon sharing the bucket
    live: dict[ChunkId, PackEntry] = field(default_factory=dict)  # chunks this index serves from it
    live_bytes: int = 0  # their records' bytes
    spare: dict[ChunkId, PackEntry] = field(default_factory=dict)  # its copies of chunks served elsewhere

    @property
    def live_fraction(self) -> float:
        return self.live_bytes / self.size if self.size else 0.0


class PackIndex:
    def __init__(self) -> None:
        self._packs: dict[str, Pack] = {}
        self._order: list[tuple[int, str]] = []  # heap of (created_ms, key); stale keys skipped
        self._chunks: dict[ChunkId, Pack] = {}  # the pack serving each chunk
        self._copies: dict[ChunkId, dict[str, Pack]] = {}  # every pack holding a record of it
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, chunk: ChunkId) -> bool:
        return chunk in self._chunks

    @property
    def packs(self) -> int:
        return len(self._packs)

    def has_pack(self, key: str) -> bool:
        return key in self._packs

    def pack(self, key: str) -> Pack | None:
        return self._packs.get(key)

    def find(self, chunk: ChunkId) -> tuple[Pack, PackEntry] | None:
        pack = self._chunks.get(chunk)
        return None if pack is None else (pack, pack.live[chunk])

    def copies(self, chunk: ChunkId) -> list[Pack]:
        """Every indexed pack holding a record of `chunk`, serving it or not."""
        return list(self._copies.get(chunk, {}).values())

    def chunks_of(self, namespace_id: str) -> list[ChunkId]:
        return [c for c in self._chunks if c[0] == namespace_id]

    def add(self, key: str, size: int, created_ms: int, entries: Iterable[PackEntry]) -> list[ChunkId]:
        """Index a pack; returns the chunks it now serves (those not served by a newer pack: an
        older one stops serving them). A pack already indexed is left as it is (returns [])."""
        if key in self._packs:
            return []
        pack = Pack(key, size, created_ms)
        for entry in entries:
            if entry.chunk in pack.live or entry.chunk in pack.spare:
                continue
            self._copies.setdefault(entry.chunk, {})[key] = pack
            other = self._chunks.get(entry.chunk)
            if other is not None and _newer(other, pack):
                pack.spare[entry.chunk] = entry
                continue
            if other is not None:
                spared = other.live.pop(entry.chunk)
                other.live_bytes -= spared.record_bytes
                other.spare[entry.chunk] = spared
            pack.live[entry.chunk] = entry
            pack.live_bytes += entry.record_bytes
            self._chunks[entry.chunk] = pack
        self._packs[key] = pack
        heapq.heappush(self._order, (created_ms, key))
        self.used_bytes += size
        return list(pack.live)

    def drop_chunk(self, chunk: ChunkId) -> Pack | None:
        """Stop serving `chunk` (deleted) and forget its other copies (each tombstoned by the
        caller). Returns its pack if that has no live chunk left (the caller deletes the object; it
        stays indexed until drop_pack, so its bytes still count)."""
        for holder in self._copies.pop(chunk, {}).values():
            holder.spare.pop(chunk, None)
        pack = self._chunks.pop(chunk, None)
        if pack is None:
            return None
        entry = pack.live.pop(chunk)
        pack.live_bytes -= entry.record_bytes
        return pack if not pack.live else None

    def drop_copy(self, chunk: ChunkId, key: str) -> Pack | None:
        """Forget the copy of `chunk` in pack `key` (a deletion naming that pack, or that copy
        failed verification); a copy in another pack is not this one's (a later delete of the
        chunk tombstones it). Returns that pack if it served the chunk and has no live chunk
        left."""
        holders = self._copies.get(chunk, {})
        pack = holders.pop(key, None)
        if not holders:
            self._copies.pop(chunk, None)
        if pack is None:
            return None
        if pack.spare.pop(chunk, None) is not None:
            return None
        del self._chunks[chunk]
        pack.live_bytes -= pack.live.pop(chunk).record_bytes
        return pack if not pack.live else None

    def drop_pack(self, key: str) -> Pack | None:
        """Forget a pack (expired, vanished, emptied) and every chunk it served."""
        pack = self._packs.pop(key, None)
        if pack is None:
            return None
        for chunk in pack.live:
            del self._chunks[chunk]
        for chunk in (*pack.live, *pack.spare):  # (a spare copy elsewhere is not served in its place)
            holders = self._copies.get(chunk, {})
            holders.pop(key, None)
            if not holders:
                self._copies.pop(chunk, None)
        self.used_bytes -= pack.size
        return pack

    def live_summary(self, bands: int = 4) -> tuple[int, list[int]]:
        """Bytes of records still served, and the packs by live fraction in `bands` equal bands
        from [0, 1/bands) up to [1 - 1/bands, 1]: how much capacity dead records take."""
        live, counts = 0, [0] * bands
        for pack in self._packs.values():
            live += pack.live_bytes
            counts[min(int(pack.live_fraction * bands), bands - 1)] += 1
        return live, counts

    def oldest(self) -> Pack | None:
        while self._order:
            _created, key = self._order[0]
            pack = self._packs.get(key)
            if pack is not None:
                return pack
            heapq.heappop(self._order)  # dropped since
        return None

    def expire(self, budget: int, before_ms: int | None = None) -> list[Pack]:
        """Drop the oldest packs until `used_bytes` <= `budget`, none created at or after
        `before_ms` (when given); returns them (delete their objects)."""
        victims = []
        while self.used_bytes > budget and (pack := self.oldest()) is not None:
            if before_ms is not None and pack.created_ms >= before_ms:
                break
            self.drop_pack(pack.key)
            victims.append(pack)
        return victims


def _newer(a: Pack, b: Pack) -> bool:
    """Whether `a` was created after `b` (the same order on every daemon of the bucket)."""
    return (a.created_ms, a.key) > (b.created_ms, b.key)
