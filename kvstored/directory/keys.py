# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What the directory stores, and under which keys (no I/O).

- A chunk: one hash, `<prefix>:c{<namespace>/<bucket>}:<key bytes>`, one field per holder and
  tier, `<address>|<incarnation hex>|<tier kind>` -> "1". The key's TTL (entry_ttl_s) is renewed
  whenever a holder writes it; a holder that drops the chunk deletes its field.
- A node: `<prefix>:hb{<address>}` -> its incarnation (hex), with a TTL of heartbeat_ttl_s,
  written every interval. A field counts only while its holder's heartbeat names the field's
  incarnation: a dead node's chunks stop being offered once its heartbeat expires (seconds),
  a restarted node's old fields at once; such fields are deleted by whoever reads them.

The hash tag is the namespace and a bucket of the key (crc32 mod `buckets`): a chunk id is an
opaque hash, so the daemon cannot group a chain's chunks by position; buckets bound the slots a
lookup touches to `buckets` (one pipelined round trip to at most that many shards), whatever
the cluster's size, while a namespace's keys still spread over that many slots.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from kvstored.chunks.ids import ChunkId, TierKind

PUBLISHED_KINDS = (TierKind.RAM, TierKind.FS)  # this node's own tiers; shared ones (S3) are read directly
_KIND_NAMES = {kind: kind.name.lower() for kind in PUBLISHED_KINDS}
_KINDS_BY_NAME = {name: kind for kind, name in _KIND_NAMES.items()}


@dataclass(frozen=True, slots=True)
class Holder:
    """A node that says it holds a chunk: its address, its incarnation, which tier."""

    address: str
    incarnation: int
    kind: TierKind


@dataclass(frozen=True)
class KeyLayout:
    prefix: str = "kvd"
    buckets: int = 16

    def bucket(self, key: bytes) -> int:
        return zlib.crc32(key) % self.buckets

    def tag(self, namespace_id: str, bucket: int) -> str:
        """The hash tag: chunks with one tag share a slot (and a shard)."""
        return f"{namespace_id}/{bucket}"

    def chunk_key(self, chunk: ChunkId) -> bytes:
        namespace_id, key = chunk
        return self.chunk_prefix(namespace_id, self.bucket(key)) + key

    def chunk_prefix(self, namespace_id: str, bucket: int) -> bytes:
        """What a chunk key starts with, hash tag included: the same for a bucket's chunks."""
        return f"{self.prefix}:c{{{self.tag(namespace_id, bucket)}}}:".encode()

    def heartbeat_key(self, address: str) -> str:
        return f"{self.prefix}:hb{{{address}}}"


def field(address: str, incarnation: int, kind: TierKind) -> bytes:
    return f"{address}|{incarnation:x}|{_KIND_NAMES[kind]}".encode()


def parse_field(raw: bytes) -> Holder | None:
    """None for a field this version does not know (another writer's, or garbage)."""
    try:
        address, incarnation, kind = raw.decode().split("|")
        return Holder(address, int(incarnation, 16), _KINDS_BY_NAME[kind])
    except (UnicodeDecodeError, ValueError, KeyError):
        return None


def heartbeat_value(incarnation: int) -> str:
    return f"{incarnation:x}"


def parse_heartbeat(raw: object) -> int | None:
    """A heartbeat's incarnation; None for no heartbeat, or anything but one (the key holding
    another type: a WRONGTYPE reply)."""
    if not isinstance(raw, bytes):
        return None
    try:
        return int(raw, 16)
    except ValueError:
        return None
