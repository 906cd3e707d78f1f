# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The peer data plane's pure parts: wire layouts, cutting a payload into the fetcher's pieces,
choosing a transport, quarantine bookkeeping."""

from __future__ import annotations

import asyncio
import mmap

import numpy as np
import pytest
import xxhash

from kvstored.peer import (
    TransportConfig,
    TransportKind,
    TransportPreference,
    TransportUnavailable,
    choose_transport,
    wire,
)
from kvstored.peer.digest import StreamDigest
from kvstored.peer.errors import ProtocolError
from kvstored.peer.transport import TRANSFER_ID_BITS, Quarantines, next_transfer_id

TCP, UCX = TransportKind.TCP, TransportKind.UCX


def test_frame_roundtrip_and_checks():
    frame = wire.Frame(wire.FrameStatus.OK, 0x1234, 2 << 20)
    raw = wire.encode_head(frame)
    assert len(raw) == wire.HEAD_BYTES
    assert wire.decode_head(raw) == frame
    assert wire.decode_sum(wire.encode_sum(0xDEADBEEF)) == 0xDEADBEEF
    wire.check_frame(frame, 0x1234, 2 << 20)
    with pytest.raises(ProtocolError, match="transfer"):
        wire.check_frame(frame, 0x1235, 2 << 20)
    with pytest.raises(ProtocolError, match="bytes"):
        wire.check_frame(frame, 0x1234, 1 << 20)
    missing = wire.Frame(wire.FrameStatus.MISSING, 7, 0)
    wire.check_frame(wire.decode_head(wire.encode_head(missing)), 7, 2 << 20)


@pytest.mark.parametrize("damage", ["magic", "version", "status", "short"])
def test_bad_frames_are_protocol_errors(damage):
    raw = bytearray(wire.encode_head(wire.Frame(wire.FrameStatus.OK, 1, 10)))
    if damage == "magic":
        raw[0] ^= 0xFF
    elif damage == "version":
        raw[4] += 1
    elif damage == "status":
        raw[6] = 9
    else:
        raw = raw[:-1]
    with pytest.raises(ProtocolError):
        wire.decode_head(raw)


def test_hellos():
    assert wire.decode_hello(wire.encode_hello(42)) == 42
    with pytest.raises(ProtocolError, match="does not speak"):
        wire.decode_hello(b"HTTP/1.1 400 Bad Request\r\n\r\n"[: wire.HELLO_BYTES])
    newer = bytearray(wire.encode_hello(42))
    newer[8] += 1
    with pytest.raises(ProtocolError, match="version"):
        wire.decode_hello(newer)
    raw = wire.encode_ucx_hello(b"address-bytes")
    assert wire.decode_ucx_hello(raw[: wire.UCX_HELLO_BYTES]) == len(b"address-bytes")
    welcome = wire.encode_ucx_welcome(9, b"addr")
    assert wire.decode_hello(welcome[: wire.HELLO_BYTES]) == 9
    assert wire.decode_address_len(welcome[wire.HELLO_BYTES : wire.HELLO_BYTES + wire.ADDRESS_LEN_BYTES]) == 4
    with pytest.raises(ProtocolError):
        wire.decode_address_len((wire.MAX_ADDRESS_BYTES + 1).to_bytes(4, "little"))


def test_stream_digest_hashes_the_payload_however_the_stream_is_cut():
    pool = mmap.mmap(-1, 1 << 20)
    np.frombuffer(pool, dtype=np.uint8)[:] = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    mv = memoryview(pool)
    pieces = [mv[300000:500000], mv[0:100000], mv[700000:700001]]
    want = xxhash.xxh3_64_intdigest(b"".join(bytes(p) for p in pieces))
    for steps in ([24 + 300001 + 8], [1] * 30 + [24 + 300001 + 8 - 30], [24, 65536, 1, 99999, 134465 + 8]):
        digest = StreamDigest(pieces, skip=24)
        for n in steps:
            digest.moved(n)
        assert digest.complete and digest.intdigest() == want


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def test_plan_pieces_slices_when_layouts_line_up():
    pool = mmap.mmap(-1, 1 << 20)
    mv = memoryview(pool)
    pieces = [mv[0:65536], mv[131072:262144]]
    plan = wire.plan_pieces(pieces, [65536, 65536, 65536])
    assert plan.bounced_bytes == 0
    # zero copy: each buffer is the pool's own memory
    assert [_address(b) for b in plan.buffers] == [
        _address(mv[0:1]),
        _address(mv[131072:131073]),
        _address(mv[196608:196609]),
    ]


def test_plan_pieces_gathers_straddling_segments():
    pool = mmap.mmap(-1, 1 << 20)
    arr = np.frombuffer(pool, dtype=np.uint8)
    arr[:] = np.random.default_rng(1).integers(0, 256, len(arr), dtype=np.uint8)
    mv = memoryview(pool)
    pieces = [mv[500000:600000], mv[0:100000]]  # out of order in memory
    payload = bytes(pieces[0]) + bytes(pieces[1])
    plan = wire.plan_pieces(pieces, [0, 150000, 50000])
    assert b"".join(bytes(b) for b in plan.buffers) == payload
    assert [len(b) for b in plan.buffers] == [0, 150000, 50000]
    assert plan.bounced_bytes == 150000  # the middle one straddles; the last is a slice
    assert _address(plan.buffers[2]) == _address(mv[50000:50001])


def test_plan_pieces_refuses_other_sizes():
    pool = mmap.mmap(-1, 4096)
    with pytest.raises(ValueError, match="segments total"):
        wire.plan_pieces([memoryview(pool)], [4095])


def test_transfer_ids_and_tags():
    ids = {next_transfer_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(0 <= i < 1 << TRANSFER_ID_BITS for i in ids)
    tid = (1 << TRANSFER_ID_BITS) - 1
    assert wire.piece_tag(tid, wire.MAX_PIECES - 1) < 1 << 64
    assert wire.piece_tag(tid, 0) != wire.piece_tag(tid - 1, wire.MAX_PIECES - 1)


@pytest.mark.parametrize(
    "pref, local, remote, expected",
    [
        (TransportPreference.AUTO, {TCP, UCX}, {TCP, UCX}, UCX),
        (TransportPreference.AUTO, {TCP, UCX}, {TCP}, TCP),
        (TransportPreference.AUTO, {TCP}, {TCP, UCX}, TCP),
        (TransportPreference.TCP, {TCP, UCX}, {TCP, UCX}, TCP),
        (TransportPreference.UCX, {TCP, UCX}, {TCP, UCX}, UCX),
    ],
)
def test_choose_transport(pref, local, remote, expected):
    assert choose_transport(pref, frozenset(local), frozenset(remote)) is expected


def test_explicit_transport_the_sides_dont_share():
    with pytest.raises(TransportUnavailable, match="the peer"):
        choose_transport(TransportPreference.UCX, frozenset({TCP, UCX}), frozenset({TCP}))
    with pytest.raises(TransportUnavailable, match="this daemon"):
        choose_transport(TransportPreference.UCX, frozenset({TCP}), frozenset({TCP, UCX}))


def test_config_is_range_checked():
    with pytest.raises(ValueError):
        TransportConfig(tcp_connections=0)
    with pytest.raises(ValueError):
        TransportConfig(settle_timeout_s=0)
    assert TransportConfig().ucx.options()["RNDV_FRAG_MEM_TYPE"] == "host"


async def test_quarantine_covers_its_views_until_settled():
    pool = mmap.mmap(-1, 1 << 20)
    mv = memoryview(pool)
    book = Quarantines()
    op = asyncio.get_running_loop().create_future()
    q = book.add([mv[65536:131072]], [op])
    assert book.covers([mv[100000:100001]]) is q
    assert book.covers([mv[0:65536], mv[131072:200000]]) is None
    op.set_result(None)
    assert await book.wait(5.0)
    assert book.covers([mv[100000:100001]]) is None and not book.pending()
