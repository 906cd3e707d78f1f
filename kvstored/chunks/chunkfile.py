# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""On-disk / in-object chunk format shared by the fs and s3 tiers.

One 4096-byte header, then the payload, so the payload starts page-aligned (O_DIRECT can read it
straight into the pool). The header names the chunk (namespace, key) and carries the payload
length and its xxh3-64 checksum; the header guards itself with a crc32. A reader verifies all of
it before a byte is served.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from kvstored.chunks.ids import ChunkId

MAGIC = b"KVSTORD1"
VERSION = 1
HEADER_BYTES = 4096
_FIXED = struct.Struct("<8sHHIQQHH")  # magic, version, flags, header_len, payload_len, checksum, ns_len, key_len
_CRC = struct.Struct("<I")


class CorruptChunk(ValueError):
    """The bytes are not a valid chunk, or not the chunk that was asked for."""


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    namespace_id: str
    key: bytes
    payload_len: int
    checksum: int


def checksum(views, size: int) -> int:
    """xxh3-64 of the first `size` bytes across `views`."""
    h = xxhash.xxh3_64()
    remaining = size
    for view in views:
        if remaining <= 0:
            break
        part = view[:remaining]
        h.update(part)
        remaining -= len(part)
    return h.intdigest()


def encode_header(chunk: ChunkId, payload_len: int, payload_checksum: int) -> bytes:
    ns = chunk[0].encode()
    body = _FIXED.pack(MAGIC, VERSION, 0, HEADER_BYTES, payload_len, payload_checksum, len(ns), len(chunk[1]))
    body += ns + chunk[1]
    body += _CRC.pack(zlib.crc32(body))
    return body.ljust(HEADER_BYTES, b"\0")


def header_used(chunk: ChunkId) -> int:
    """The bytes of the header encode_header() fills for `chunk` (the rest is zero padding)."""
    return _FIXED.size + len(chunk[0].encode()) + len(chunk[1]) + _CRC.size


def decode_header(raw: bytes | memoryview) -> ChunkHeader:
    if len(raw) < _FIXED.size:
        raise CorruptChunk("truncated header")
    magic, version, _flags, header_len, payload_len, payload_sum, ns_len, key_len = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptChunk("bad magic")
    if version != VERSION or header_len != HEADER_BYTES:
        raise CorruptChunk(f"unsupported format version {version}")
    end = _FIXED.size + ns_len + key_len
    if end + _CRC.size > len(raw):
        raise CorruptChunk("truncated header")
    (crc,) = _CRC.unpack_from(raw, end)
    if zlib.crc32(bytes(raw[:end])) != crc:
        raise CorruptChunk("header checksum mismatch")
    try:
        ns = bytes(raw[_FIXED.size : _FIXED.size + ns_len]).decode()
    except UnicodeDecodeError:  # (a header whose CRC another writer made to fit)
        raise CorruptChunk("namespace in the header is not UTF-8") from None
    key = bytes(raw[_FIXED.size + ns_len : end])
    return ChunkHeader(ns, key, payload_len, payload_sum)


def verify(header: ChunkHeader, chunk: ChunkId, size: int, views) -> None:
    """Raise CorruptChunk unless the header names `chunk`, the length matches and the checksum holds."""
    verify_digest(header, chunk, size, lambda: checksum(views, size))


def verify_digest(header: ChunkHeader, chunk: ChunkId, size: int, digest: Callable[[], int]) -> None:
    """verify(), with the payload's xxh3-64 from `digest` (called once the header checks out)."""
    if (header.namespace_id, header.key) != chunk:
        raise CorruptChunk("header names another chunk")
    if header.payload_len != size:
        raise CorruptChunk(f"payload is {header.payload_len} bytes, expected {size}")
    if digest() != header.checksum:
        raise CorruptChunk("payload checksum mismatch")


def chunk_relpath(chunk: ChunkId) -> str:
    """Content-addressed name with two levels of fan-out: <ns>/<k[0:2]>/<k[2:4]>/<key hex>.kv"""
    hexkey = chunk[1].hex()
    return f"{chunk[0]}/{hexkey[0:2]}/{hexkey[2:4]}/{hexkey}.kv"


def parse_relpath(relpath: str) -> ChunkId | None:
    """The chunk a relative name holds, if it is exactly a name chunk_relpath() writes."""
    parts = relpath.split("/")
    if len(parts) != 4 or not parts[0] or parts[0].startswith(".") or not parts[3].endswith(".kv"):
        return None
    ns, d1, d2, leaf = parts
    hexkey = leaf[:-3]
    if len(hexkey) < 4 or hexkey[0:2] != d1 or hexkey[2:4] != d2:
        return None
    try:
        key = bytes.fromhex(hexkey)
    except ValueError:
        return None
    return (ns, key) if key.hex() == hexkey else None  # upper case or other spellings: not ours


# Namespace records (kvstored.namespaces.encode_record) live beside the chunks, under a name no
# chunk can have (chunk names are <namespace id>/<k0k1>/<k2k3>/<key hex>.kv).
RECORDS_DIR = "_kvstored/namespaces"
RECORD_SUFFIX = ".json"
MAX_RECORD_BYTES = 64 << 10  # a record is a few hundred bytes; anything bigger is not one


def record_relpath(namespace_id: str) -> str:
    if not namespace_id or namespace_id[0] == "." or "/" in namespace_id or "\0" in namespace_id:
        raise ValueError(f"namespace id {namespace_id!r} cannot name a record")
    return f"{RECORDS_DIR}/{namespace_id}{RECORD_SUFFIX}"


def parse_record_name(name: str) -> str | None:
    """The namespace id a record's file/object name (within RECORDS_DIR) is for, if it is one."""
    if name.startswith(".") or not name.endswith(RECORD_SUFFIX) or "/" in name:
        return None
    return name[: -len(RECORD_SUFFIX)] or None
