# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The remote-location index: which peers hold which chunk, and in which of their tiers.

Fed by the peers' KV events (kvstored.peer.follow) and snapshots; read by the peer tier's
`contains`, so a miss costs a dictionary lookup, never a network round trip. It may be stale in
both directions: a chunk a peer dropped since is found missing when fetched (the serving peer
confirms at fetch time) and is simply a miss; a chunk it gained since its last event is a miss.

Structure: one OrderedDict (the LRU, oldest first) from a chunk to a bit mask. The chunk is one
bytes object, a 2-byte id of its namespace (namespaces are interned) followed by its key; the
mask has TIER_BITS bits per peer slot: bit 0 the peer's RAM, bits 1-3 its tiers below RAM, in
its order (a 4th or later tier shares bit 3). Masks of the first two slots are small ints,
which Python shares. An update moves the chunk to the recent end; past `max_entries` the
least recently updated chunk goes (with every peer's bit for it).

A peer that restarts (a new incarnation) or leaves is retired in O(1): its slot leaves the live
mask, so its bits stop counting at once, and `sweep()` clears them in slices later (the daemon
runs it in the background); only a swept slot is given to another peer.

Memory, measured (tracemalloc, 1,000,000 entries of 32-byte keys held by up to 5 peers,
tests/unit/test_peer_index.py prints it; run with -s): ~170 bytes per entry (the key's bytes
object ~67 B, the OrderedDict's entry and node ~100 B, masks beyond two slots 28 B), so the
default bound (index_entries = 1,000,000 chunks, 2 TiB of 2 MiB chunks) takes ~170 MB.
BYTES_PER_ENTRY below is that figure, for sizing (bench/ and docs use it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

from kvstored.chunks.ids import ChunkId

TIER_BITS = 4  # per peer slot: RAM, and three tiers below it
SLOT_MASK = (1 << TIER_BITS) - 1
MAX_NAMESPACES = 1 << 16  # namespace ids are interned as 2 bytes
BYTES_PER_ENTRY = 170  # measured, see the docstring
SWEEP_SLICE = 50_000  # entries per sweep step (a few ms of the event loop)


@dataclass(frozen=True, slots=True)
class Holder:
    slot: int
    tier_bit: int  # the lowest (fastest) of its tiers holding the chunk: 0 is its RAM


def tier_bit(position: int) -> int:
    """The bit of a peer's tier by its position in the peer's serving tiers (0: RAM)."""
    return min(position, TIER_BITS - 1)


class PeerIndex:
    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self._namespaces: dict[str, bytes] = {}
        self._live = 0  # bits of live slots
        self._counts: dict[int, int] = {}  # live slot -> chunks it holds
        self._retired: set[int] = set()  # slots whose bits are still to be swept
        self._next_slot = 0
        self._free: list[int] = []
        self.evictions = 0  # chunks dropped to stay within max_entries
        self.unindexed_namespaces = 0  # events of namespaces past MAX_NAMESPACES (not indexed)

    def __len__(self) -> int:
        return len(self._entries)

    # -- peers ----------------------------------------------------------------------------

    def add_peer(self) -> int:
        """A slot for a peer incarnation (the lowest free one)."""
        if self._free:
            self._free.sort()
            slot = self._free.pop(0)
        else:
            slot = self._next_slot
            self._next_slot += 1
        self._live |= SLOT_MASK << (slot * TIER_BITS)
        self._counts[slot] = 0
        return slot

    def retire(self, slot: int) -> None:
        """The peer incarnation is gone: its entries stop counting now; sweep() clears them."""
        if slot not in self._counts:
            return
        self._live &= ~(SLOT_MASK << (slot * TIER_BITS))
        del self._counts[slot]
        self._retired.add(slot)

    def count(self, slot: int) -> int:
        """Chunks the index says this (live) peer holds."""
        return self._counts.get(slot, 0)

    @property
    def sweeping(self) -> bool:
        return bool(self._retired)

    def sweep(self) -> Iterable[None]:
        """Clear retired slots' bits, SWEEP_SLICE entries per step (iterate it, yielding to the
        event loop between steps); their slots are free again at the end."""
        retired = set(self._retired)
        if not retired:
            return
        dead = 0
        for slot in retired:
            dead |= SLOT_MASK << (slot * TIER_BITS)
        keys = list(self._entries)
        for start in range(0, len(keys), SWEEP_SLICE):
            entries = self._entries
            for key in keys[start : start + SWEEP_SLICE]:
                mask = entries.get(key)
                if mask is None or not mask & dead:
                    continue
                mask &= ~dead
                if mask:
                    entries[key] = mask  # (assigning an existing key keeps its place in the LRU)
                else:
                    del entries[key]
            yield
        self._retired -= retired
        self._free.extend(retired)

    # -- updates --------------------------------------------------------------------------

    def add(self, slot: int, bit: int, namespace_id: str, keys: Sequence[bytes]) -> None:
        """The peer in `slot` holds these chunks in its tier `bit`."""
        if slot not in self._counts:
            return
        prefix = self._prefix(namespace_id)
        if prefix is None:
            return
        flag = 1 << (slot * TIER_BITS + bit)
        slot_bits = SLOT_MASK << (slot * TIER_BITS)
        entries = self._entries
        get, to_end = entries.get, entries.move_to_end
        added = 0
        for key in keys:
            chunk = prefix + key
            mask = get(chunk)
            if mask is None:  # new: it lands at the recent end already
                entries[chunk] = flag
                added += 1
                continue
            if not mask & slot_bits:
                added += 1
            if mask & flag != flag:
                entries[chunk] = mask | flag
            to_end(chunk)
        self._counts[slot] += added
        if len(entries) > self.max_entries:
            self._evict()

    def remove(self, slot: int, bit: int, namespace_id: str, keys: Sequence[bytes]) -> None:
        """The peer in `slot` no longer holds these chunks in its tier `bit`."""
        if slot not in self._counts:
            return
        prefix = self._namespaces.get(namespace_id)
        if prefix is None:
            return
        flag = 1 << (slot * TIER_BITS + bit)
        slot_bits = SLOT_MASK << (slot * TIER_BITS)
        entries = self._entries
        get, live = entries.get, self._live
        gone = 0
        for key in keys:
            mask = get(prefix + key)
            if mask is None or not mask & flag:
                continue
            chunk = prefix + key
            mask &= ~flag
            if not mask & slot_bits:
                gone += 1
            if mask & live:
                entries[chunk] = mask
            else:
                del entries[chunk]
        self._counts[slot] -= gone

    def drop(self, slot: int, namespace_id: str, key: bytes) -> None:
        """The peer in `slot` said it does not hold this chunk (a stale entry found at fetch)."""
        for bit in range(TIER_BITS):
            self.remove(slot, bit, namespace_id, [key])

    # -- reads ----------------------------------------------------------------------------

    def holders(self, chunk: ChunkId) -> list[Holder]:
        """Live peers holding the chunk, those holding it in RAM first, then by tier."""
        prefix = self._namespaces.get(chunk[0])
        if prefix is None:
            return []
        mask = self._entries.get(prefix + chunk[1], 0) & self._live
        out = []
        while mask:
            low = (mask & -mask).bit_length() - 1
            slot = low // TIER_BITS
            out.append(Holder(slot, low % TIER_BITS))
            mask &= ~(SLOT_MASK << (slot * TIER_BITS))
        out.sort(key=lambda h: h.tier_bit)
        return out

    def contains(self, namespace_id: str, keys: Sequence[bytes]) -> list[int]:
        """Per key, the live mask of who holds it (0: nobody). No recency change: lookups don't
        keep a chunk in the index, its holders' events do."""
        prefix = self._namespaces.get(namespace_id)
        if prefix is None:
            return [0] * len(keys)
        entries, live = self._entries, self._live
        return [entries.get(prefix + key, 0) & live for key in keys]

    @staticmethod
    def slots_of(mask: int) -> list[int]:
        out = []
        while mask:
            low = (mask & -mask).bit_length() - 1
            slot = low // TIER_BITS
            out.append(slot)
            mask &= ~(SLOT_MASK << (slot * TIER_BITS))
        return out

    def oldest(self, n: int) -> list[bytes]:
        """The n least recently updated chunks (for tests and diagnostics)."""
        return list(islice(self._entries, n))

    # -- internals ------------------------------------------------------------------------

    def _prefix(self, namespace_id: str) -> bytes | None:
        prefix = self._namespaces.get(namespace_id)
        if prefix is None:
            if len(self._namespaces) >= MAX_NAMESPACES:
                self.unindexed_namespaces += 1
                return None
            prefix = self._namespaces[namespace_id] = len(self._namespaces).to_bytes(2, "little")
        return prefix

    def _evict(self) -> None:
        entries = self._entries
        while len(entries) > self.max_entries:
            _, mask = entries.popitem(last=False)
            self.evictions += 1
            for slot in self.slots_of(mask & self._live):
                self._counts[slot] -= 1
