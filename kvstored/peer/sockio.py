# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Socket I/O straight into and out of pool views (no buffering layer in between: asyncio
streams would copy every byte once more): on the event loop for handshakes and chunk bytes, and
in the data plane's threads on non-blocking sockets, each wait a poll() (kvstored/peer/tcp.py
says why)."""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence

import xxhash

from kvstored.chunks.views import advance, as_bytes, trim
from kvstored.peer.digest import StreamDigest
from kvstored.peer.errors import PeerError, PeerUnreachable

try:
    import kvstored.peer._rxframe as _rxframe
except ImportError:  # (built without it, or no libxxhash on this system: frames are read in Python)
    _rxframe = None  # type: ignore[assignment]

_PROBE = b"kvstored: the system's xxh3 must be the chunk format's"
if _rxframe is not None and _rxframe.xxh3(_PROBE) != xxhash.xxh3_64_intdigest(_PROBE):
    # (a libxxhash older than 0.8 computes another XXH3: every frame would look corrupt)
    logging.getLogger(__name__).warning("the system's libxxhash disagrees with xxhash: peer frames are read in Python")
    _rxframe = None  # type: ignore[assignment]

HASHED_RECV = _rxframe is not None  # recv_hashed reads in C
_CLOSED, _TIMED_OUT, _FAILED = 1, 2, 3  # _rxframe.recv_frame's outcomes

_IOV_MAX = 1024
# A reader waiting for more of a frame is woken once this much of it (or all of it) is there, not
# at every segment: each wake-up costs a loop turn, and each read a Python call, whatever they
# carry (over loopback a 2 MiB chunk took ~10 reads and ~3 wake-ups without it, ~5 and ~2 with it).
RCVLOWAT_MAX = 4 << 20
# A data-plane thread's reads (recv_exactly): at most this much per call, each hashed at once.
RECV_STEP = 512 << 10


async def recv_into_all(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    views: Sequence[memoryview],
    moved: Callable[[int], None] | None = None,
) -> None:
    """Fill every view in order, scattering each read across them (recvmsg_into), and reading on
    while data is there before waiting for more (a wait costs more than a read); `moved(n)` after
    each read. PeerUnreachable if the peer closes the connection first. Cancelling it stops the
    reads at once: nothing is written into the views afterwards."""
    pending = [as_bytes(v) for v in views if len(v)]
    while pending:
        try:
            n = sock.recvmsg_into(pending[:_IOV_MAX])[0]
        except (BlockingIOError, InterruptedError):
            _expect(sock, sum(len(v) for v in pending))
            await _ready(loop, sock, reading=True)
            continue
        if n == 0:
            raise PeerUnreachable("the peer closed the connection mid-transfer")
        if moved is not None:
            moved(n)
        pending = advance(pending, n)


async def send_all(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    bufs: Sequence[memoryview],
    moved: Callable[[int], None] | None = None,
) -> int:
    """Write every buffer in order, gathered (sendmsg), waiting for room as needed; `moved(n)`
    after each write. Cancelling it stops the writes at once (the stream is then broken: close
    the socket)."""
    pending = [as_bytes(b) for b in bufs if len(b)]
    total = 0
    while pending:
        try:
            n = sock.sendmsg(pending[:_IOV_MAX])
        except (BlockingIOError, InterruptedError):
            await _ready(loop, sock, reading=False)
            continue
        total += n
        if moved is not None:
            moved(n)
        pending = advance(pending, n)
    return total


def _expect(sock: socket.socket, nbytes: int) -> None:
    """Make the socket readable (for the loop) only once `nbytes` (at most RCVLOWAT_MAX) are
    queued, or the peer closed it (the kernel caps it by the receive buffer)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, max(1, min(nbytes, RCVLOWAT_MAX)))


async def _ready(loop: asyncio.AbstractEventLoop, sock: socket.socket, reading: bool) -> None:
    ready = loop.create_future()
    fd = sock.fileno()
    if reading:
        loop.add_reader(fd, _wake, ready)
    else:
        loop.add_writer(fd, _wake, ready)
    try:
        await ready
    finally:
        if reading:
            loop.remove_reader(fd)
        else:
            loop.remove_writer(fd)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def recv_exactly(
    sock: socket.socket, views: Sequence[memoryview], end: float, moved: Callable[[int], None] | None = None
) -> None:
    """(A data-plane thread, `sock` non-blocking.) Fill every view in order, RECV_STEP bytes per
    call at most, each followed by `moved(n)` while those bytes are still in the CPU cache
    (hashing a whole 2 MiB payload after its copy read it back from further away: +60% of the
    hash's CPU, measured). When nothing is there it waits with poll() until RECV_STEP bytes (or
    the rest) are (SO_RCVLOWAT): one wake-up per step, not one per segment. (A blocking read
    waiting with SO_RCVLOWAT above 1 stalled on this kernel, with or without MSG_WAITALL:
    checked.) PeerUnreachable if the peer closes the connection first or `stop()` shut it down;
    TimeoutError past `end` (time.monotonic()); OSError for a socket error. Only bytes the peer
    will send may be asked for."""
    pending = [as_bytes(v) for v in views if len(v)]
    remaining = sum(len(v) for v in pending)
    lowat = 0
    while pending:
        try:
            n = sock.recvmsg_into(_first(pending, RECV_STEP))[0]
        except BlockingIOError:
            want = min(remaining, RECV_STEP)
            if want != lowat:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                lowat = want
            _poll(sock, select.POLLIN, end)
            continue
        if n == 0:
            raise PeerUnreachable("the peer closed the connection mid-transfer")
        if moved is not None:
            moved(n)
        remaining -= n
        pending = advance(pending, n)


def recv_hashed(
    sock: socket.socket, views: Sequence[memoryview], payload: int, end: float
) -> tuple[int, int, BaseException | None]:
    """(A data-plane thread, `sock` non-blocking.) As recv_exactly with the first `payload`
    bytes hashed as they land (xxh3-64): (bytes moved, the hash of what landed of the payload,
    None), or with the error that ended it early (PeerUnreachable, TimeoutError, OSError) in
    place of None. In one C call that holds no GIL throughout where it is built (HASHED_RECV;
    _rxframe.c says why), else in Python."""
    bufs = [as_bytes(v) for v in views if len(v)]
    if _rxframe is None:
        digest = StreamDigest(trim(bufs, payload))
        try:
            recv_exactly(sock, bufs, end, digest.moved)
        except (PeerError, OSError) as exc:
            return digest.moved_bytes, digest.intdigest(), exc
        return digest.moved_bytes, digest.intdigest(), None
    outcome, moved, checksum, errno = _rxframe.recv_frame(sock.fileno(), bufs, payload, RECV_STEP, end)
    error: BaseException | None = None
    if outcome == _CLOSED:
        error = PeerUnreachable("the peer closed the connection mid-transfer")
    elif outcome == _TIMED_OUT:
        error = TimeoutError("the data plane's deadline passed")
    elif outcome == _FAILED:
        error = OSError(errno, os.strerror(errno))
    return moved, checksum, error


def _first(bufs: list[memoryview], nbytes: int) -> list[memoryview]:
    """The leading `nbytes` of `bufs` (as views)."""
    out: list[memoryview] = []
    for buf in bufs:
        if nbytes <= 0 or len(out) == _IOV_MAX:
            break
        part = buf[:nbytes]
        out.append(part)
        nbytes -= len(part)
    return out


def send_exactly(
    sock: socket.socket, bufs: Sequence[memoryview], end: float, moved: Callable[[int], None] | None = None
) -> None:
    """(A data-plane thread, `sock` blocking.) Write every buffer in order, gathered (a blocking
    sendmsg returns once all of it is queued). `moved(n)` after each call; TimeoutError past
    `end`."""
    pending = [as_bytes(b) for b in bufs if len(b)]
    while pending:
        try:
            n = sock.sendmsg(pending[:_IOV_MAX])
        except BlockingIOError:
            _poll(sock, select.POLLOUT, end)
            continue
        if moved is not None:
            moved(n)
        pending = advance(pending, n)


def _poll(sock: socket.socket, events: int, end: float) -> None:
    remaining = end - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the data plane's deadline passed")
    poller = select.poll()
    poller.register(sock.fileno(), events)
    poller.poll(remaining * 1000)


def prepare(sock: socket.socket, end: float, blocking: bool) -> None:
    """Make `sock` ready for a data-plane thread until `end` (time.monotonic()): blocking (to
    send) or not (to receive; the event loop's reader on it, uvloop's, may have changed it), its
    sends and receives bounded by `end` in the kernel too (SO_SNDTIMEO, SO_RCVTIMEO): a backstop
    for a thread nobody stops; the caller stops it at its deadline with stop()."""
    sock.setblocking(blocking)
    seconds = max(end - time.monotonic(), 0.001)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def stop(sock: socket.socket) -> None:
    """End a blocking send or receive in another thread at once (it sees the end of the stream
    or EPIPE); the connection is unusable afterwards."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def peer_gone(sock: socket.socket) -> bool:
    """Whether an idle connection is unusable: closed by the peer, or holding bytes nobody asked
    for (a frame of an abandoned transfer)."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    return True  # b"" (closed) or unexpected bytes


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
