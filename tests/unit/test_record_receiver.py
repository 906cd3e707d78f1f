# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""RecordReceiver: a chunk record fed in pieces of any size lands byte-exact in views of any
split, and anything that is not the chunk's record is named, never taken for it."""

from __future__ import annotations

import os
import zlib

import pytest

from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored.chunks.receiver import RecordReceiver

CHUNK = ("ns", b"k" * 32)
SIZE = 3 * 4096 + 123


def record(chunk=CHUNK, payload: bytes | None = None) -> tuple[bytes, bytes]:
    payload = os.urandom(SIZE) if payload is None else payload
    header = chunkfile.encode_header(chunk, len(payload), chunkfile.checksum([payload], len(payload)))
    return header + payload, payload


def views(split: list[int]) -> tuple[bytearray, list[memoryview]]:
    buf = bytearray(sum(split))
    whole, out, at = memoryview(buf), [], 0
    for n in split:
        out.append(whole[at : at + n])
        at += n
    return buf, out


def feed(receiver: RecordReceiver, body: bytes, piece: int) -> None:
    for at in range(0, len(body), piece):
        receiver.feed(body[at : at + piece])


@pytest.mark.parametrize("piece", [1, 7, 4095, 4096, 4097, 65536, 10**7])
@pytest.mark.parametrize("split", [[SIZE], [4096, SIZE - 4096], [1, 2, SIZE - 3]])
def test_pieces_of_any_size_land_byte_exact_in_views_of_any_split(piece, split):
    body, payload = record()
    buf, targets = views(split)
    receiver = RecordReceiver(CHUNK, SIZE, targets)
    feed(receiver, body, piece)
    assert receiver.problem() is None
    assert bytes(buf) == payload


def flipped(body: bytes, at: int) -> bytes:
    return body[:at] + bytes([body[at] ^ 1]) + body[at + 1 :]


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda b: b[:-1], "record is"),
        (lambda b: b + b"x", "record is"),
        (lambda b: b[:HEADER_BYTES], "record is"),
        (lambda b: flipped(b, HEADER_BYTES + 5), "checksum mismatch"),
        (lambda b: flipped(b, len(b) - 1), "checksum mismatch"),
        (lambda b: flipped(b, 20), "header"),
        (lambda b: b"\0" * len(b), "bad magic"),
        (lambda b: record(("ns", b"o" * 32))[0], "another chunk"),
    ],
    ids=["short", "long", "header-only", "payload-byte", "last-byte", "header-byte", "zeros", "other-chunk"],
)
def test_anything_but_the_record_is_named(damage, named):
    body, _ = record()
    _, targets = views([SIZE])
    receiver = RecordReceiver(CHUNK, SIZE, targets)
    feed(receiver, damage(body), 1000)
    problem = receiver.problem()
    assert problem is not None and named in problem


def test_a_header_whose_crc_fits_a_namespace_that_is_not_utf8_is_named_corrupt():
    """Another writer can make a header's CRC fit any bytes: a namespace that does not decode is a
    corrupt record (deleted, counted), not an error that escapes the read."""
    body, _ = record()
    ns_at = chunkfile._FIXED.size
    forged = bytearray(body[:HEADER_BYTES])
    forged[ns_at : ns_at + 2] = b"\xff\xfe"  # CHUNK's namespace "ns", now not UTF-8
    end = ns_at + 2 + 32
    forged[end : end + 4] = chunkfile._CRC.pack(zlib.crc32(bytes(forged[:end])))
    _, targets = views([SIZE])
    receiver = RecordReceiver(CHUNK, SIZE, targets)
    feed(receiver, bytes(forged) + body[HEADER_BYTES:], 4096)
    problem = receiver.problem()
    assert problem is not None and "not UTF-8" in problem


def test_a_record_of_another_length_is_refused_by_its_header():
    body, _ = record(payload=os.urandom(SIZE - 1))
    _, targets = views([SIZE - 1])
    receiver = RecordReceiver(CHUNK, SIZE - 1, targets)
    receiver.feed(body)
    assert receiver.problem() is None
    _, targets = views([SIZE])
    receiver = RecordReceiver(CHUNK, SIZE, targets)
    receiver.feed(body + b"\0")  # the right length on the wire, the wrong payload length inside
    assert "payload is" in (receiver.problem() or "")
