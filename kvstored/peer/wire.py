# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Byte layouts of the peer data plane (pure: no I/O), shared by the TCP and UCX transports.

- HELLO (server -> fetcher, once per connection/endpoint): magic, version, the link id the server
  gave this connection. Orders name it, so the server knows where to send.
- TCP frame: HEAD (magic, version, status OK / MISSING, transfer id, payload length), the payload,
  SUM (the payload's xxh3-64, the chunk format's checksum, kvstored.chunks.chunkfile). SUM comes
  last so both sides hash each piece as it moves, while it is still in the CPU cache (from
  memory, hashing 2 MiB costs about half a raw transfer's CPU here). A MISSING frame is HEAD
  alone. The fetcher checks all of it before the bytes are served. (UCX has no frame: the
  pieces are bare messages and the Receipt comes back through the control plane.)
- UCX_HELLO (fetcher -> server on the UCX transport's TCP lifeline): magic, version, the fetcher's
  UCX worker address; the server answers HELLO followed by its own worker address (both
  length-prefixed), and each side makes its endpoint from the other's address.
- UCX tags: (transfer id << 16) | piece index.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvstored.chunks.views import as_bytes
from kvstored.peer.errors import ProtocolError

VERSION = 1
HELLO_MAGIC = b"KVPEERH1"
FRAME_MAGIC = b"KVPF"
_HELLO = struct.Struct("<8sHHIQ")  # magic, version, reserved, reserved, link id
_HEAD = struct.Struct("<4sHHQQ")  # magic, version, status, transfer id, length
_SUM = struct.Struct("<Q")
UCX_HELLO_MAGIC = b"KVPEERU1"
_UCX_HELLO = struct.Struct("<8sHHI")  # magic, version, reserved, worker address length
_ADDRESS_LEN = struct.Struct("<I")
UCX_HELLO_BYTES = _UCX_HELLO.size
ADDRESS_LEN_BYTES = _ADDRESS_LEN.size
MAX_ADDRESS_BYTES = 1 << 16
HELLO_BYTES = _HELLO.size
HEAD_BYTES = _HEAD.size
SUM_BYTES = _SUM.size
PIECE_BITS = 16
MAX_PIECES = 1 << PIECE_BITS


class FrameStatus(enum.IntEnum):
    OK = 0
    MISSING = 1


@dataclass(frozen=True, slots=True)
class Frame:
    status: FrameStatus
    transfer_id: int
    length: int


def encode_hello(link_id: int) -> bytes:
    return _HELLO.pack(HELLO_MAGIC, VERSION, 0, 0, link_id)


def decode_hello(raw: bytes | bytearray | memoryview) -> int:
    """The link id; ProtocolError if this is not our hello."""
    if len(raw) != HELLO_BYTES:
        raise ProtocolError(f"hello of {len(raw)} bytes, expected {HELLO_BYTES}")
    magic, version, _, _, link_id = _HELLO.unpack(raw)
    if magic != HELLO_MAGIC:
        raise ProtocolError("the peer's data port does not speak the kvstored peer protocol")
    if version != VERSION:
        raise ProtocolError(f"the peer speaks peer protocol version {version}, this daemon {VERSION}")
    return link_id


def encode_ucx_hello(address: bytes) -> bytes:
    return _UCX_HELLO.pack(UCX_HELLO_MAGIC, VERSION, 0, len(address)) + address


def decode_ucx_hello(raw: bytes) -> int:
    """The length of the worker address that follows; ProtocolError if this is not our hello."""
    magic, version, _, length = _UCX_HELLO.unpack(raw)
    if magic != UCX_HELLO_MAGIC:
        raise ProtocolError("the peer is not a kvstored UCX fetcher")
    if version != VERSION:
        raise ProtocolError(f"the peer speaks peer protocol version {version}, this daemon {VERSION}")
    if not 0 < length <= MAX_ADDRESS_BYTES:
        raise ProtocolError(f"worker address of {length} bytes")
    return length


def encode_ucx_welcome(link_id: int, address: bytes) -> bytes:
    return encode_hello(link_id) + _ADDRESS_LEN.pack(len(address)) + address


def decode_address_len(raw: bytes) -> int:
    (length,) = _ADDRESS_LEN.unpack(raw)
    if not 0 < length <= MAX_ADDRESS_BYTES:
        raise ProtocolError(f"worker address of {length} bytes")
    return length


def encode_head(frame: Frame) -> bytes:
    return _HEAD.pack(FRAME_MAGIC, VERSION, frame.status, frame.transfer_id, frame.length)


def encode_sum(checksum: int) -> bytes:
    return _SUM.pack(checksum)


def decode_head(raw: bytes | bytearray | memoryview) -> Frame:
    if len(raw) != HEAD_BYTES:
        raise ProtocolError(f"frame header of {len(raw)} bytes, expected {HEAD_BYTES}")
    magic, version, status, transfer_id, length = _HEAD.unpack(raw)
    if magic != FRAME_MAGIC or version != VERSION:
        raise ProtocolError("bad frame header (magic or version)")
    try:
        status = FrameStatus(status)
    except ValueError:
        raise ProtocolError(f"unknown frame status {status}") from None
    return Frame(status, transfer_id, length)


def decode_sum(raw: bytes | bytearray | memoryview) -> int:
    return _SUM.unpack(raw)[0]


def check_frame(frame: Frame, transfer_id: int, size: int) -> None:
    """ProtocolError unless the frame answers this transfer with this many bytes (or MISSING)."""
    if frame.transfer_id != transfer_id:
        raise ProtocolError(f"frame of transfer {frame.transfer_id:#x}, expected {transfer_id:#x}")
    expected = 0 if frame.status is FrameStatus.MISSING else size
    if frame.length != expected:
        raise ProtocolError(f"frame of {frame.length} bytes, expected {expected}")


def piece_tag(transfer_id: int, index: int) -> int:
    return (transfer_id << PIECE_BITS) | index


def segments_of(pieces: Sequence[memoryview]) -> tuple[int, ...]:
    return tuple(len(p) for p in pieces)


@dataclass(frozen=True, slots=True)
class SendPlan:
    buffers: list[memoryview]  # one per fetcher segment, in order
    bounced_bytes: int  # bytes copied because a segment straddled two of our views


def plan_pieces(pieces: Sequence[memoryview], segments: Sequence[int]) -> SendPlan:
    """Cut our payload (`pieces`, in order) into the fetcher's segments. A segment inside one of
    our pieces is a slice of it (no copy); one that straddles two is gathered into a new buffer
    (only when both sides' slots are fragmented differently: slots are contiguous when possible)."""
    if sum(segments) != sum(len(p) for p in pieces):
        raise ValueError(f"segments total {sum(segments)} bytes, the payload {sum(len(p) for p in pieces)}")
    if len(segments) > MAX_PIECES:
        raise ValueError(f"{len(segments)} segments, at most {MAX_PIECES}")
    pieces = [as_bytes(p) for p in pieces if len(p)]
    out: list[memoryview] = []
    bounced = 0
    i, offset = 0, 0  # position in pieces
    for length in segments:
        if length == 0:
            out.append(memoryview(b""))
            continue
        while offset == len(pieces[i]):
            i, offset = i + 1, 0
        if offset + length <= len(pieces[i]):
            out.append(pieces[i][offset : offset + length])
            offset += length
            continue
        buf = bytearray(length)
        filled = 0
        while filled < length:
            if offset == len(pieces[i]):
                i, offset = i + 1, 0
            n = min(length - filled, len(pieces[i]) - offset)
            buf[filled : filled + n] = pieces[i][offset : offset + n]
            filled += n
            offset += n
        out.append(memoryview(buf))
        bounced += length
    return SendPlan(out, bounced)
