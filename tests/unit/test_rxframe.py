# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The data threads' frame reader (sockio.recv_hashed: in C, kvstored/peer/_rxframe.c, and in
Python where that is not built): a frame's bytes land in the given buffers whatever way the
kernel splits them, the payload's xxh3-64 is the chunk format's checksum, and a peer that
closes, a deadline that passes and a socket error each end the read with the bytes moved so
far."""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time

import pytest
import xxhash

from kvstored.chunks.chunkfile import checksum
from kvstored.peer import sockio
from kvstored.peer.errors import PeerUnreachable


def test_it_is_used_wherever_libxxhash_is_there():
    try:
        ctypes.CDLL("libxxhash.so.0")  # (Debian's libxxhash0: apt itself needs it)
    except OSError:  # elsewhere frames are read in Python
        assert not sockio.HASHED_RECV
    else:
        assert sockio.HASHED_RECV, "kvstored.peer._rxframe was not built: `make setup` builds it"


@pytest.fixture
def c_pair():
    """Two ends of a stream, for the C reader itself (built by `make setup` where libxxhash0 is
    installed, as on every Debian and Ubuntu system)."""
    assert sockio.HASHED_RECV, "kvstored.peer._rxframe is not built here"
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(params=["c", "python"])
def pair(request, c_pair, monkeypatch):
    """The same, read by recv_hashed in C and in Python (where the C reader is not built)."""
    if request.param == "python":
        monkeypatch.setattr(sockio, "_rxframe", None)
    return c_pair


def _send_slowly(sock: socket.socket, data: bytes, pieces: int) -> threading.Thread:
    def run() -> None:
        step = -(-len(data) // pieces)
        for start in range(0, len(data), step):
            sock.sendall(data[start : start + step])
            time.sleep(0.001)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("pieces", [1, 7, 300])
def test_a_frame_lands_in_its_buffers_and_its_payload_is_hashed(pair, pieces):
    a, b = pair
    payload = os.urandom((3 << 20) + 123)
    trailer = xxhash.xxh3_64_intdigest(payload).to_bytes(8, "little")
    head = os.urandom(24)
    # a payload split across uneven views (a fragmented slot), then SUM, then the next HEAD
    cuts = [0, 4096, 4096 + 1, 1 << 20, (2 << 20) + 5, len(payload)]
    views = [memoryview(bytearray(cuts[i + 1] - cuts[i])) for i in range(len(cuts) - 1)]
    sum_view, head_view = memoryview(bytearray(8)), memoryview(bytearray(24))
    sender = _send_slowly(a, payload + trailer + head, pieces)
    moved, digest, error = sockio.recv_hashed(b, [*views, sum_view, head_view], len(payload), time.monotonic() + 10)
    sender.join()
    assert error is None and moved == len(payload) + 32
    assert b"".join(bytes(v) for v in views) == payload
    assert (bytes(sum_view), bytes(head_view)) == (trailer, head)
    assert digest == checksum(views, len(payload)) == int.from_bytes(trailer, "little")


def test_a_peer_that_closes_mid_frame_ends_the_read_with_what_came(pair):
    a, b = pair
    a.sendall(b"x" * 1000)
    a.close()
    moved, digest, error = sockio.recv_hashed(b, [memoryview(bytearray(4096))], 4096, time.monotonic() + 10)
    assert moved == 1000 and isinstance(error, PeerUnreachable)
    assert digest == xxhash.xxh3_64_intdigest(b"x" * 1000)


def test_a_shutdown_from_another_thread_ends_a_waiting_read_at_once(pair):
    a, b = pair
    threading.Timer(0.2, sockio.stop, (b,)).start()
    moved, _, error = sockio.recv_hashed(b, [memoryview(bytearray(4096))], 4096, time.monotonic() + 30)
    assert moved == 0 and isinstance(error, PeerUnreachable)


def test_a_deadline_ends_a_read_that_waits(pair):
    a, b = pair
    a.sendall(b"y" * 10)
    moved, _, error = sockio.recv_hashed(b, [memoryview(bytearray(100))], 100, time.monotonic() + 0.2)
    assert moved == 10 and isinstance(error, TimeoutError)


def test_a_socket_error_is_an_os_error(pair):
    _, b = pair
    os.close(b.detach())  # (b's fileno is now -1: EBADF)
    moved, _, error = sockio.recv_hashed(b, [memoryview(bytearray(8))], 8, time.monotonic() + 1)
    assert moved == 0 and isinstance(error, OSError) and "Bad file descriptor" in str(error)


def test_bad_arguments_are_refused(c_pair):
    _, b = c_pair
    from kvstored.peer import _rxframe

    with pytest.raises(ValueError, match="longer than the buffers"):
        _rxframe.recv_frame(b.fileno(), [memoryview(bytearray(8))], 9, 4096, time.monotonic() + 1)
    with pytest.raises(BufferError):  # a read-only buffer
        _rxframe.recv_frame(b.fileno(), [b"12345678"], 8, 4096, time.monotonic() + 1)


def test_empty_buffers_anywhere_take_no_byte(c_pair):
    from kvstored.peer import _rxframe

    a, b = c_pair
    a.sendall(b"abcdefgh")
    bufs = [bytearray(0), bytearray(3), bytearray(0), bytearray(5), bytearray(0)]
    outcome, moved, digest, _ = _rxframe.recv_frame(
        b.fileno(), [memoryview(x) for x in bufs], 4, 1, time.monotonic() + 5
    )
    assert (outcome, moved) == (0, 8)
    assert b"".join(bufs) == b"abcdefgh" and digest == xxhash.xxh3_64_intdigest(b"abcd")


def test_its_xxh3_is_the_chunk_formats():
    from kvstored.peer import _rxframe

    assert sockio.HASHED_RECV
    for data in (b"", b"x", os.urandom(240), os.urandom(1 << 20)):
        assert _rxframe.xxh3(data) == xxhash.xxh3_64_intdigest(data)
