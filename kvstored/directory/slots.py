# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Which master serves a key (no I/O): Redis Cluster's slots and the map a client keeps of them.

A key's slot is CRC16 (XMODEM, binascii's crc_hqx) of its hash tag, the part between its first
'{' and the next '}' when that part is not empty, else of the whole key, modulo 16384; the map
comes from CLUSTER SLOTS (the command Redis 3 to 7 and Valkey all answer) and learns single
slots from MOVED replies between refreshes.
"""

from __future__ import annotations

from binascii import crc_hqx
from collections.abc import Sequence
from typing import Any

SLOTS = 16384
Address = tuple[str, int]


def key_slot(key: bytes) -> int:
    return crc_hqx(tag_of(key) or key, 0) % SLOTS


def tag_of(key: bytes) -> bytes | None:
    """The hash tag, if the key has one (its slot depends on nothing else)."""
    start = key.find(b"{")
    if start < 0:
        return None
    end = key.find(b"}", start + 1)
    return key[start + 1 : end] if end > start + 1 else None


class SlotMap:
    """slot -> its master's address; None for a slot no master serves (a shard down)."""

    def __init__(self, owners: Sequence[Address | None]) -> None:
        if len(owners) != SLOTS:
            raise ValueError(f"a slot map has {SLOTS} slots, got {len(owners)}")
        self._owners = list(owners)

    @classmethod
    def from_cluster_slots(cls, reply: Any, asked: Address) -> SlotMap:
        """CLUSTER SLOTS' reply: [[start, end, [host, port, id, ...], replicas...], ...]. An empty
        host (or '?') is the node that answered, as Redis means it."""
        owners: list[Address | None] = [None] * SLOTS
        if not isinstance(reply, list):
            raise ValueError(f"CLUSTER SLOTS: expected a list, got {type(reply).__name__}")
        for entry in reply:
            try:
                start, end, master = int(entry[0]), int(entry[1]), entry[2]
                host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                port = int(master[1])
            except (TypeError, ValueError, IndexError, UnicodeDecodeError) as exc:
                raise ValueError(f"CLUSTER SLOTS: an entry it cannot read: {entry!r}") from exc
            if not 0 <= start <= end < SLOTS:
                raise ValueError(f"CLUSTER SLOTS: slots {start}-{end} out of range")
            address = (asked[0] if host in ("", "?") else host, port)
            owners[start : end + 1] = [address] * (end - start + 1)
        return cls(owners)

    def owner(self, slot: int) -> Address | None:
        return self._owners[slot]

    def moved(self, slot: int, address: Address) -> None:
        self._owners[slot] = address

    def masters(self) -> list[Address]:
        return sorted({a for a in self._owners if a is not None})

    def covered(self) -> int:
        return sum(1 for a in self._owners if a is not None)
