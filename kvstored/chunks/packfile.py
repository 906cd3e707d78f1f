# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The pack object format: many chunk records in one object, with its own index at the end.

A pack is the records back to back, each one exactly a chunk file (chunkfile's 4096-byte header,
then the payload), then an index block naming every record (namespace, key, offset, payload
length, xxh3), then a fixed trailer (magic, version, entry count, index length and crc32, where
the records end, and a crc32 of the trailer itself). Whoever can read the object's last bytes can
rebuild its index; every record still verifies on its own when it is read with a ranged GET.

Pack names sort by the time they were written (milliseconds since the epoch, hex, fixed width),
so a reader can list only the packs newer than a point in time (ListObjectsV2 StartAfter).

A manifest announces the packs one daemon wrote lately: for each, its name, size, creation time
and its index exactly as the pack ends (index block and trailer); then the chunks that daemon
deleted from packs lately (each pack's name, then its chunks, as its tombstones name them); then a
trailer of its own (magic, pack count, crc32 of everything before). One GET of a manifest stands
for one GET per pack, and tells the daemons running on the bucket what was deleted.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored.chunks.ids import ChunkId

MAGIC = b"KVSPACK1"
VERSION = 1
_ENTRY = struct.Struct("<QQQHH")  # offset, payload_len, checksum, ns_len, key_len; then ns, key
_TRAILER = struct.Struct("<8sHHIIIQ")  # magic, version, flags, count, index_len, index_crc, records_end
TRAILER_BYTES = _TRAILER.size + 4  # + crc32 of the fields before it
TAIL_BYTES = 64 << 10  # what a first read of a pack's end asks for (fits ~800 entries of 32-byte keys)
PACKS_DIR = "_kvstored/packs"  # under the tier's prefix; chunk names have four parts, this has three
PACK_SUFFIX = ".kvp"
MANIFESTS_DIR = "_kvstored/manifests"
MANIFEST_SUFFIX = ".kvm"
_NAME = re.compile(r"^([0-9a-f]{12})-([0-9a-f]{8})-([0-9a-f]{8})(\.kvp|\.kvm)$")
_MANIFEST_ITEM = struct.Struct("<HQQI")  # name_len, pack size, created_ms, index_len; name, index
_MANIFEST_TRAILER = struct.Struct("<8sII")  # magic, count, crc32 of the items
_MANIFEST_DELETES = struct.Struct("<HI")  # name_len, chunk count; name, then tombstone items
MANIFEST_MAGIC = b"KVSMANI2"
MANIFEST_MAGIC_V1 = b"KVSMANI1"  # packs only (still read)
MAX_MANIFEST_BYTES = 64 << 20  # a manifest names a few seconds of one daemon's packs


class CorruptPack(ValueError):
    """The bytes are not a pack's index (truncated, damaged, or not a pack at all)."""


class UnsupportedPack(ValueError):
    """A pack of a format version this daemon does not read (written by a newer one): left alone."""


@dataclass(frozen=True, slots=True)
class PackEntry:
    chunk: ChunkId
    offset: int  # of the record's chunkfile header within the object
    size: int  # payload bytes
    checksum: int  # the payload's xxh3-64 (the record's header carries it too)

    @property
    def record_bytes(self) -> int:
        return HEADER_BYTES + self.size


@dataclass(frozen=True, slots=True)
class NeedTail:
    """The index is longer than the tail that was read: read the object's last `nbytes`."""

    nbytes: int


def pack_name(created_ms: int, writer: int, seq: int, suffix: str = PACK_SUFFIX) -> str:
    return f"{created_ms:012x}-{writer & 0xFFFFFFFF:08x}-{seq & 0xFFFFFFFF:08x}{suffix}"


def parse_pack_name(name: str, suffix: str = PACK_SUFFIX) -> int | None:
    """The creation time (ms) a pack's (or manifest's) name carries, if it is one."""
    match = _NAME.match(name)
    return int(match.group(1), 16) if match and match.group(4) == suffix else None


def writer_of(name: str) -> int | None:
    """The writer id in a pack's or manifest's name."""
    match = _NAME.match(name)
    return int(match.group(2), 16) if match else None


@dataclass(frozen=True, slots=True)
class Announced:
    """One pack named by a manifest."""

    name: str  # within PACKS_DIR
    size: int
    created_ms: int
    entries: list[PackEntry]


@dataclass(frozen=True, slots=True)
class Manifest:
    packs: list[Announced]
    deleted: list[tuple[str, list[ChunkId]]]  # (pack name within PACKS_DIR, chunks deleted from it)


def encode_manifest(
    packs: Sequence[tuple[str, int, int, bytes]], deleted: Sequence[tuple[str, Sequence[ChunkId]]] = ()
) -> bytes:
    """(name, size, created_ms, the pack's last bytes: index block and trailer) of each pack, then
    (pack name, chunks) of each pack chunks were deleted from."""
    parts = []
    for name, size, created_ms, index in packs:
        raw = name.encode()
        parts.append(_MANIFEST_ITEM.pack(len(raw), size, created_ms, len(index)) + raw + index)
    for name, chunks in deleted:
        raw = name.encode()
        parts.append(_MANIFEST_DELETES.pack(len(raw), len(chunks)) + raw + _tomb_items(chunks))
    body = b"".join(parts)
    return body + _MANIFEST_TRAILER.pack(MANIFEST_MAGIC, len(packs), zlib.crc32(body))


def decode_manifest(data: bytes | memoryview) -> Manifest:
    """The packs a manifest names, each index checked as decode_index does, and the chunks it
    says were deleted; CorruptPack if it does not hold together."""
    raw = memoryview(data)
    if len(raw) < _MANIFEST_TRAILER.size:
        raise CorruptPack("manifest too short")
    magic, count, crc = _MANIFEST_TRAILER.unpack_from(raw, len(raw) - _MANIFEST_TRAILER.size)
    body = raw[: len(raw) - _MANIFEST_TRAILER.size]
    if magic not in (MANIFEST_MAGIC, MANIFEST_MAGIC_V1) or zlib.crc32(body) != crc:
        raise CorruptPack("manifest damaged (magic or checksum)")
    packs, pos = [], 0
    for _ in range(count):
        if pos + _MANIFEST_ITEM.size > len(body):
            raise CorruptPack("manifest shorter than its count")
        name_len, size, created_ms, index_len = _MANIFEST_ITEM.unpack_from(body, pos)
        pos += _MANIFEST_ITEM.size
        if pos + name_len + index_len > len(body):
            raise CorruptPack("manifest item runs past its end")
        name = bytes(body[pos : pos + name_len]).decode(errors="replace")
        entries = decode_index(body[pos + name_len : pos + name_len + index_len], size)
        pos += name_len + index_len
        if isinstance(entries, NeedTail) or parse_pack_name(name) != created_ms:
            raise CorruptPack(f"manifest names {name!r} inconsistently")
        packs.append(Announced(name, size, created_ms, entries))
    deleted = []
    while pos < len(body) and magic == MANIFEST_MAGIC:
        if pos + _MANIFEST_DELETES.size > len(body):
            raise CorruptPack("manifest deletion runs past its end")
        name_len, n = _MANIFEST_DELETES.unpack_from(body, pos)
        pos += _MANIFEST_DELETES.size
        name = bytes(body[pos : pos + name_len]).decode(errors="replace")
        if pos + name_len > len(body) or parse_pack_name(name) is None:
            raise CorruptPack(f"manifest deletion names {name!r}, not a pack")
        chunks, pos = _read_tomb_items(body, pos + name_len, n)
        deleted.append((name, chunks))
    if pos != len(body):
        raise CorruptPack("manifest longer than its items")
    return Manifest(packs, deleted)


def time_marker(created_ms: int) -> str:
    """A name that sorts before every pack created at or after `created_ms` (for StartAfter)."""
    return f"{max(created_ms, 0):012x}"


def encode_index(entries: Sequence[PackEntry], records_end: int) -> bytes:
    """The index block and trailer that end a pack whose records end at `records_end`."""
    parts = []
    for e in entries:
        ns = e.chunk[0].encode()
        parts.append(_ENTRY.pack(e.offset, e.size, e.checksum, len(ns), len(e.chunk[1])) + ns + e.chunk[1])
    index = b"".join(parts)
    trailer = _TRAILER.pack(MAGIC, VERSION, 0, len(entries), len(index), zlib.crc32(index), records_end)
    return index + trailer + struct.pack("<I", zlib.crc32(trailer))


def decode_index(tail: bytes | memoryview, object_bytes: int) -> list[PackEntry] | NeedTail:
    """The entries of a pack of `object_bytes` from its last len(tail) bytes; NeedTail when the
    index starts before them. Raises CorruptPack unless trailer, index and every entry's bounds
    hold together (records inside the object, in order, not overlapping, before the index)."""
    if len(tail) > object_bytes or len(tail) < TRAILER_BYTES:
        raise CorruptPack(f"pack of {object_bytes} bytes cannot end in {len(tail)} bytes of index")
    raw = memoryview(tail)
    trailer = raw[len(raw) - TRAILER_BYTES :]
    (crc,) = struct.unpack_from("<I", trailer, _TRAILER.size)
    if zlib.crc32(trailer[: _TRAILER.size]) != crc:
        raise CorruptPack("pack trailer checksum mismatch (truncated or not a pack)")
    magic, version, _flags, count, index_len, index_crc, records_end = _TRAILER.unpack_from(trailer)
    if magic != MAGIC:
        raise CorruptPack("bad pack magic")
    if version != VERSION:
        raise UnsupportedPack(f"pack format version {version}")
    if records_end + index_len + TRAILER_BYTES != object_bytes:
        raise CorruptPack(f"pack index says {records_end + index_len + TRAILER_BYTES} bytes, object has {object_bytes}")
    if index_len + TRAILER_BYTES > len(raw):
        return NeedTail(index_len + TRAILER_BYTES)
    index = raw[len(raw) - TRAILER_BYTES - index_len : len(raw) - TRAILER_BYTES]
    if zlib.crc32(index) != index_crc:
        raise CorruptPack("pack index checksum mismatch")
    entries: list[PackEntry] = []
    pos, next_free = 0, 0
    for _ in range(count):
        if pos + _ENTRY.size > index_len:
            raise CorruptPack("pack index shorter than its entry count")
        offset, size, checksum, ns_len, key_len = _ENTRY.unpack_from(index, pos)
        pos += _ENTRY.size
        if pos + ns_len + key_len > index_len:
            raise CorruptPack("pack index entry runs past the index")
        try:
            ns = bytes(index[pos : pos + ns_len]).decode()
        except UnicodeDecodeError:
            raise CorruptPack("pack index entry has a bad namespace") from None
        key = bytes(index[pos + ns_len : pos + ns_len + key_len])
        pos += ns_len + key_len
        entry = PackEntry((ns, key), offset, size, checksum)
        if offset < next_free or offset + entry.record_bytes > records_end:
            raise CorruptPack(f"pack record at {offset} overlaps another or runs past the records")
        next_free = offset + entry.record_bytes
        entries.append(entry)
    if pos != index_len:
        raise CorruptPack("pack index longer than its entries")
    return entries


# Tombstones: chunks deleted from a pack whose record stays in it, one small object per batch
# under TOMBSTONES_DIR/<pack name without suffix>/, so a rebuild does not serve them again.
TOMBSTONES_DIR = "_kvstored/tombstones"
TOMBSTONE_SUFFIX = ".kvt"
TOMBSTONE_MAGIC = b"KVSTOMB1"
_TOMB_ITEM = struct.Struct("<HH")
_TOMB_TRAILER = struct.Struct("<8sII")  # magic, count, crc32 of the items


def _tomb_items(chunks: Sequence[ChunkId]) -> bytes:
    parts = []
    for ns, key in chunks:
        raw = ns.encode()
        parts.append(_TOMB_ITEM.pack(len(raw), len(key)) + raw + key)
    return b"".join(parts)


def _read_tomb_items(body: memoryview, pos: int, count: int) -> tuple[list[ChunkId], int]:
    out = []
    for _ in range(count):
        if pos + _TOMB_ITEM.size > len(body):
            raise CorruptPack("tombstone shorter than its count")
        ns_len, key_len = _TOMB_ITEM.unpack_from(body, pos)
        pos += _TOMB_ITEM.size
        if pos + ns_len + key_len > len(body):
            raise CorruptPack("tombstone item runs past its end")
        ns = bytes(body[pos : pos + ns_len]).decode(errors="replace")
        out.append((ns, bytes(body[pos + ns_len : pos + ns_len + key_len])))
        pos += ns_len + key_len
    return out, pos


def encode_tombstone(chunks: Sequence[ChunkId]) -> bytes:
    body = _tomb_items(chunks)
    return body + _TOMB_TRAILER.pack(TOMBSTONE_MAGIC, len(chunks), zlib.crc32(body))


def decode_tombstone(data: bytes | memoryview) -> list[ChunkId]:
    raw = memoryview(data)
    if len(raw) < _TOMB_TRAILER.size:
        raise CorruptPack("tombstone too short")
    magic, count, crc = _TOMB_TRAILER.unpack_from(raw, len(raw) - _TOMB_TRAILER.size)
    body = raw[: len(raw) - _TOMB_TRAILER.size]
    if magic != TOMBSTONE_MAGIC or zlib.crc32(body) != crc:
        raise CorruptPack("tombstone damaged (magic or checksum)")
    out, pos = _read_tomb_items(body, 0, count)
    if pos != len(body):
        raise CorruptPack("tombstone longer than its items")
    return out
