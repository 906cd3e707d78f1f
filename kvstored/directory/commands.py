# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The directory's commands, encoded as RESP frames with their slots (no I/O).

One interval's write batch is encoded once, here: a chunk gained is one frame of HSET + PEXPIRE
(two replies), a chunk dropped or a stale field one HDEL, the heartbeat one SET ... PX. The hot
path is a chunk's frame: its key's prefix and slot depend only on (namespace, bucket), so both
are computed once per bucket, and a frame is one %-format of pre-encoded parts (~0.3 us).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvstored.chunks.ids import ChunkId, TierKind
from kvstored.directory.keys import PUBLISHED_KINDS, KeyLayout, field, heartbeat_value
from kvstored.directory.resp import Batch, bulk, encode
from kvstored.directory.slots import key_slot, tag_of

MAX_PREFIXES = 65_536  # (namespace, bucket) pairs remembered; past it the cache starts over


class Commands:
    def __init__(
        self, layout: KeyLayout, address: str, incarnation: int, entry_ttl_s: float, heartbeat_ttl_s: float
    ) -> None:
        self.layout = layout
        self._address = address
        self._incarnation = incarnation
        self._heartbeat_ms = int(heartbeat_ttl_s * 1000)
        self._prefixes: dict[tuple[str, int], tuple[bytes, int | None]] = {}
        # "<field>" "1" and then the PEXPIRE's head: the part of a gained chunk's frame after its key
        ttl = bulk(int(entry_ttl_s * 1000))
        self._gained_mid = {
            kind: b"\r\n" + bulk(field(address, incarnation, kind)) + bulk(b"1") + b"*3\r\n$7\r\nPEXPIRE\r\n"
            for kind in PUBLISHED_KINDS
        }
        self._ttl_tail = b"\r\n" + ttl
        self._dropped_tail = {kind: b"\r\n" + bulk(field(address, incarnation, kind)) for kind in PUBLISHED_KINDS}

    # -- keys -------------------------------------------------------------------------------------

    def chunk_key(self, chunk: ChunkId) -> tuple[bytes, int]:
        """The chunk's key and its slot."""
        namespace_id, key = chunk
        bucket = self.layout.bucket(key)
        cached = self._prefixes.get((namespace_id, bucket))
        if cached is None:
            prefix = self.layout.chunk_prefix(namespace_id, bucket)
            # (a prefix whose own '{' would make Redis hash more than the tag: slot per key)
            tag = self.layout.tag(namespace_id, bucket).encode()
            cached = (prefix, key_slot(prefix) if tag_of(prefix) == tag else None)
            if len(self._prefixes) >= MAX_PREFIXES:
                self._prefixes.clear()
            self._prefixes[(namespace_id, bucket)] = cached
        prefix, slot = cached
        full = prefix + key
        return full, key_slot(full) if slot is None else slot

    # -- writes -----------------------------------------------------------------------------------

    def heartbeat(self, batch: Batch) -> None:
        key = self.layout.heartbeat_key(self._address).encode()
        batch.add(key_slot(key), encode(b"SET", key, heartbeat_value(self._incarnation), b"PX", self._heartbeat_ms))

    def gained(self, batch: Batch, kind: TierKind, chunk: ChunkId) -> None:
        """HSET key <this node's field> 1, PEXPIRE key entry_ttl: two replies."""
        key, slot = self.chunk_key(chunk)
        k = b"$%d\r\n%b" % (len(key), key)
        batch.add(slot, b"*4\r\n$4\r\nHSET\r\n%b%b%b%b" % (k, self._gained_mid[kind], k, self._ttl_tail), 2)

    def dropped(self, batch: Batch, kind: TierKind, chunk: ChunkId) -> None:
        key, slot = self.chunk_key(chunk)
        batch.add(slot, b"*3\r\n$4\r\nHDEL\r\n$%d\r\n%b%b" % (len(key), key, self._dropped_tail[kind]))

    def delete_field(self, batch: Batch, key: bytes, raw: bytes) -> None:
        """Another holder's field (stale): HDEL key field."""
        batch.add(key_slot(key), encode(b"HDEL", key, raw))

    def delete_heartbeat(self, batch: Batch) -> None:
        key = self.layout.heartbeat_key(self._address).encode()
        batch.add(key_slot(key), encode(b"DEL", key))

    # -- lookups ----------------------------------------------------------------------------------

    def holders(self, chunks: Sequence[ChunkId]) -> tuple[list[bytes], Batch]:
        """HGETALL of each chunk's key: (the keys, the batch)."""
        batch, keys = Batch(), []
        for chunk in chunks:
            key, slot = self.chunk_key(chunk)
            keys.append(key)
            batch.add(slot, b"*2\r\n$7\r\nHGETALL\r\n$%d\r\n%b\r\n" % (len(key), key))
        return keys, batch

    def heartbeats(self, addresses: Iterable[str]) -> Batch:
        batch = Batch()
        for address in addresses:
            key = self.layout.heartbeat_key(address).encode()
            batch.add(key_slot(key), encode(b"GET", key))
        return batch
