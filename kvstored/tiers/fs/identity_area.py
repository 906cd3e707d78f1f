# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A chunk's identity record kept in its file's header, so a restarted daemon can tell routers
what its disk holds (kvstored/events/identity.py encodes the record; to this tier it is bytes).

The chunk header (kvstored.chunks.chunkfile) fills the first few hundred bytes of its 4096 and
pads the rest with zeros; the record goes at the end of that padding, followed by a 16-byte
footer at the header's very end: magic "KVID", version, length, crc32 of the record. Costs no
extra file, write or read of the chunk (the header is written and read anyway), and readers
that know nothing of it (older daemons) ignore the padding as before. A record that does not
fit beside the header (a chunk of more than ~950 tokens of 32-bit ids) is not kept.

Reading it back is separate from reading the chunk and never touches it: a footer of another
version, a length that overlaps the header, a crc that does not match only make the record
doubtful (the chunk is served, not published); a header that does not check out, or names
another chunk, makes it doubtful too (the chunk's own read finds out about the chunk).
"""

from __future__ import annotations

import struct
import zlib

from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES, CorruptChunk
from kvstored.chunks.ids import ChunkId

MAGIC = b"KVID"
VERSION = 1
_FOOTER = struct.Struct("<4sHHII")  # magic, version, reserved, record length, crc32 of the record
FOOTER_AT = HEADER_BYTES - _FOOTER.size
DOUBTFUL = b""  # what a read-back gives for a record that did not check out (no record: None)


def room(chunk: ChunkId) -> int:
    """The largest record a chunk's header has room for."""
    return FOOTER_AT - chunkfile.header_used(chunk)


def place(header: memoryview, record: bytes) -> None:
    """Write `record` and its footer into a header buffer that already holds the encoded
    header (the caller checked room())."""
    start = FOOTER_AT - len(record)
    header[start:FOOTER_AT] = record
    header[FOOTER_AT:HEADER_BYTES] = _FOOTER.pack(MAGIC, VERSION, 0, len(record), zlib.crc32(record))


def take(chunk: ChunkId, header: bytes | memoryview) -> bytes | None:
    """The record a chunk file's first HEADER_BYTES hold: None if it keeps none, DOUBTFUL if
    what it keeps does not check out."""
    if len(header) < HEADER_BYTES:
        return DOUBTFUL
    magic, version, _reserved, length, crc = _FOOTER.unpack_from(header, FOOTER_AT)
    if magic != MAGIC:
        return None if not any(header[FOOTER_AT:HEADER_BYTES]) else DOUBTFUL
    try:
        parsed = chunkfile.decode_header(header)
    except CorruptChunk:
        return DOUBTFUL
    if (parsed.namespace_id, parsed.key) != chunk or version != VERSION or length > room(chunk):
        return DOUBTFUL
    record = bytes(header[FOOTER_AT - length : FOOTER_AT])
    return record if zlib.crc32(record) == crc else DOUBTFUL
