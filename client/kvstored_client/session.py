# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The session socket's I/O (blocking or not) and the blocking clients' session: opens a session,
maps the daemon's pool and the arenas of its tenants, attaches regions. What is said over the
socket is protocol.Handshake's.

Mappings are made from the memfds the daemon sends (never by name: a client must not be able to
unlink the daemon's memory, and access follows the socket's permissions). A tenant arena is not
populated: it is sparse, and populating it would allocate all of it.
"""

from __future__ import annotations

import contextlib
import grp
import mmap
import os
import pwd
import select
import socket
import stat
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from kvstored_client import keyindex
from kvstored_client.ahead import AheadSlots
from kvstored_client.buffers import ChunkCopier, PoolArrays
from kvstored_client.errors import InvalidArgument, KvstoredError, RegionFileMissing, Unavailable
from kvstored_client.fast import FastLink
from kvstored_client.keyindex import KeyIndexView, Touches, open_view
from kvstored_client.paths import session_socket_path
from kvstored_client.protocol import MAX_FDS, MAX_PACKET, Condition, Handshake, Packet, Reason

SETTLE_S = 5.0  # a blocking session socket's bound on reading the posted calls' answers
COPY_END_S = 10.0  # how long closing a session waits for its copies into the pool to end


_HUNG_UP = select.POLLHUP | select.POLLRDHUP | select.POLLERR | select.POLLNVAL


class CopyGate:
    """The copies between caller buffers and a session's pool slots under way. The session closes
    only once they have ended, so that a session its client names released (Hello.released_sessions)
    is one it never writes again."""

    def __init__(self) -> None:
        self._copies = 0
        self._done = threading.Condition()
        self._closed = False

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Around one copy: Unavailable once close() has begun."""
        counted = False
        try:
            with self._done:
                if self._closed:
                    raise Unavailable("this session is closed: its slots and leases are gone")
                self._copies += 1
                counted = True
            yield
        finally:
            if counted:
                with self._done:
                    self._copies -= 1
                    self._done.notify_all()

    def close(self, timeout: float = COPY_END_S) -> bool:
        """No copy starts from now on; True once those under way have ended (memcpys), False if
        one is still running after `timeout` (its session must not be named released then)."""
        with self._done:
            self._closed = True
            return self._done.wait_for(lambda: self._copies == 0, timeout)


class PoolSession:
    """A session opened and used with blocking calls (each bounded by the socket's timeout)."""

    def __init__(self, sock: socket.socket, handshake: Handshake, populate: bool, copy_threads: int = 1) -> None:
        if handshake.welcome is None:
            raise ValueError("PoolSession needs a welcomed handshake")
        welcome = handshake.welcome
        self._sock = sock
        self._handshake = handshake
        self.copier = ChunkCopier(copy_threads)
        self.session_id = welcome.session_id
        self.pool_bytes = welcome.pool_bytes
        self.page_bytes = welcome.page_bytes
        self.fast = FastLink(sock, welcome.serves_fast) if welcome.fast_path else None  # None: no fast path
        self.ahead = AheadSlots()  # slots reserved ahead for stores (off unless its client turns it on)
        try:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            self._map = mmap.mmap(welcome.pool_fd, self.pool_bytes, flags=flags)
        finally:
            os.close(welcome.pool_fd)
        self.arrays = PoolArrays(self._map)
        self._arenas: dict[int, tuple[mmap.mmap, PoolArrays]] = {}  # tenant arenas mapped
        self.serves_index = welcome.key_index and keyindex.available  # key indexes can be mapped
        self._indexes: dict[str, KeyIndexView | None] = {}  # namespace id -> its key index (None: refused)
        self.touches = Touches()  # hits found in the key indexes, not yet told to the daemon
        self.copies = CopyGate()

    def check_alive(self) -> None:
        """Unavailable if the daemon has ended this session (a restart, a hand-over): its slots
        and leases are gone with it, and their pages may hold other chunks now. A copy into the
        pool asks first, one out of it after, so it never writes, or keeps, another chunk's bytes."""
        # A poll, not a read (the fast link may be reading the socket), and a new one per call:
        # copies run in threads, and a poll object refuses to be polled from two at once.
        if self._sock.fileno() < 0:  # (closed here: as ended as the daemon ending it)
            raise Unavailable("this session is closed: its slots and leases are gone")
        hangup = select.poll()
        hangup.register(self._sock, select.POLLRDHUP)
        if any(events & _HUNG_UP for _fd, events in hangup.poll(0)):
            raise Unavailable("the daemon ended this session (restarted or handed over): its slots and leases are gone")

    @classmethod
    def open(
        cls,
        socket: Path | str,
        client_name: str,
        timeout: float,
        populate: bool = True,
        copy_threads: int = 1,
        released: Sequence[str] = (),
    ) -> PoolSession:
        """released: ids of this client's earlier sessions, closed (see Hello.released_sessions)."""
        sock = connect(session_socket_path(socket), timeout)
        try:
            handshake = Handshake(client_name, released=released)
            handshake.welcome_from(*_exchange(sock, handshake.hello()))
            return cls(sock, handshake, populate, copy_threads)
        except BaseException:
            sock.close()
            raise

    def map_arena(self, arena_id: int, timeout: float | None = None) -> None:
        """Map a tenant arena (this session registered one of its namespaces) unless mapped; the
        exchange within `timeout` (None: the socket's own)."""
        if arena_id == 0 or arena_id in self._arenas:
            return
        if timeout is not None:
            self._sock.settimeout(timeout)
        opened = self._handshake.arena_from(*self._exchange(self._handshake.open_arena(arena_id)))
        try:
            mapped = mmap.mmap(opened.fd, opened.size, flags=mmap.MAP_SHARED)
        finally:
            os.close(opened.fd)
        self._arenas[arena_id] = (mapped, PoolArrays(mapped))

    def index(self, namespace_id: str) -> KeyIndexView | None:
        """The namespace's key index if mapped (no I/O; see map_index)."""
        return self._indexes.get(namespace_id)

    def index_tried(self, namespace_id: str) -> bool:
        return not self.serves_index or namespace_id in self._indexes

    def map_index(self, namespace_id: str, timeout: float = SETTLE_S) -> None:
        """Map the namespace's key index, once per session: one exchange on the session socket
        (within `timeout`). One the daemon refuses (a namespace this session may not see, not
        registered yet) is not asked for again in this session: its lookups ask the daemon."""
        if self.index_tried(namespace_id):
            return
        self._sock.settimeout(timeout)  # (not what the last call left: its time may have been short)
        try:
            opened = self._handshake.index_from(*self._exchange(self._handshake.open_index(namespace_id)))
        except Unavailable:
            raise
        except KvstoredError:
            self._indexes[namespace_id] = None
            return
        self._indexes[namespace_id] = open_view(namespace_id, opened.fd, opened.size, opened.key_bytes)

    def arena_arrays(self, arena_id: int) -> PoolArrays:
        """The arrays of an arena's mapping (0: the pool); a tenant arena is mapped on first use."""
        if arena_id == 0:
            return self.arrays
        self.map_arena(arena_id)
        return self._arenas[arena_id][1]

    def attach_region(self, fd: int, name: str) -> tuple[int, int]:
        """Hand the daemon an open region file; returns (region id, size)."""
        attached = self._handshake.attached_from(*self._exchange(self._handshake.attach_region(name, fd)))
        return attached.region_id, attached.size

    def _exchange(self, packet: Packet) -> tuple[bytes, list[int]]:
        """One set-up exchange; the posted fast calls' answers come first (they are read here)."""
        if self.fast is not None:
            self.fast.settle(self._sock.gettimeout() or SETTLE_S)
        return _exchange(self._sock, packet)

    @property
    def pool(self) -> np.ndarray | None:
        """The pool as a flat numpy uint8 array (None once closed)."""
        return self.arrays.numpy

    def close(self) -> bool:
        """Close the session once the copies under way have ended (memcpys: milliseconds); False
        if one had not ended within COPY_END_S."""
        copies_ended = self.copies.close()
        self.copier.close()
        if self.fast is not None:
            self.fast.close()
        self._sock.close()
        self.arrays.release()
        for mapped, arrays in [(self._map, self.arrays), *self._arenas.values()]:
            arrays.release()
            try:
                mapped.close()
            except BufferError:  # a caller still holds a view into the pool; freed with it
                pass
        self._arenas.clear()
        for index in self._indexes.values():
            if index is not None:
                index.close()
        self._indexes.clear()
        return copies_ended


# -- session socket I/O, for both kinds of caller --------------------------------------------------


def connect(path: Path, timeout: float | None) -> socket.socket:
    """A connection to the session socket; timeout None: a non-blocking socket."""
    kind = socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | (socket.SOCK_NONBLOCK if timeout is None else 0)
    sock = socket.socket(socket.AF_UNIX, kind)
    if timeout is not None:
        sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        raise Unavailable(f"kvstored is not reachable at {path}: {exc.strerror or exc}") from None
    return sock


def diagnose(socket_path: Path | str) -> Condition | None:
    """Why the daemon at `socket_path` cannot be reached (its gRPC socket, then its session
    socket), or None when something listens on both. Never blocks: a unix-socket connect
    answers at once (a full backlog is reported as listening)."""
    sockets = ((Path(socket_path), socket.SOCK_STREAM), (session_socket_path(socket_path), socket.SOCK_SEQPACKET))
    for path, kind in sockets:
        condition = probe(path, kind)
        if condition is not None:
            return condition
    return None


def probe(path: Path | str, kind: int = socket.SOCK_STREAM) -> Condition | None:
    """One socket (gRPC's: a stream; the session socket: seqpacket): why it cannot be connected
    to, or None when something listens on it."""
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        where = "no such socket" if path.parent.is_dir() else f"no directory {path.parent}"
        return Condition(
            Reason.NOT_FOUND, f"{path}: {where} (kvstored not running or still starting, or a different socket path?)"
        )
    except PermissionError:
        return Condition(Reason.PERMISSION_DENIED, _denied(path.parent, "directory"))
    except OSError as exc:
        return Condition(Reason.UNUSABLE, f"{path}: {exc.strerror or exc}")
    if not stat.S_ISSOCK(info.st_mode):
        return Condition(Reason.UNUSABLE, f"{path} is not a socket")
    conn = socket.socket(socket.AF_UNIX, kind | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        conn.connect(str(path))
    except (BlockingIOError, InterruptedError):
        return None  # listening, its backlog full: busy, not gone
    except ConnectionRefusedError:
        return Condition(Reason.REFUSED, f"{path}: nothing listens on it (kvstored stopped or was killed)")
    except PermissionError:
        return Condition(Reason.PERMISSION_DENIED, _denied(path, "socket"))
    except OSError as exc:
        return Condition(Reason.UNUSABLE, f"{path}: {exc.strerror or exc}")
    finally:
        conn.close()
    return None


def _denied(path: Path, what: str) -> str:
    """Whose `path` is, and whether this process is in its group (the usual fix: join it)."""
    try:
        info = path.stat()
    except OSError:
        return f"{what} {path}: access denied"
    group = _name(grp.getgrgid, info.st_gid)
    owner = _name(pwd.getpwuid, info.st_uid)
    mode = f"mode {stat.S_IMODE(info.st_mode):04o}, owner {owner}, group {group}"
    if info.st_gid not in (os.getegid(), *os.getgroups()):
        return f"not in group {group} ({what} {path}: {mode})"
    return f"{what} {path}: {mode}"


def _name(lookup, ident: int) -> str:
    try:
        return lookup(ident)[0]
    except KeyError:
        return str(ident)


def send(sock: socket.socket, packet: Packet) -> None:
    try:
        socket.send_fds(sock, [packet.data], list(packet.fds))
    except OSError as exc:  # includes timeouts
        raise Unavailable(f"session socket failed: {exc}") from None


def receive(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """The next packet and its fds (b"" when the daemon closed the session); None when a
    non-blocking socket has nothing yet."""
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_PACKET, MAX_FDS)
    except BlockingIOError:
        return None
    except OSError as exc:  # includes timeouts
        raise Unavailable(f"session socket failed: {exc}") from None
    return data, fds


def peer_closed(sock: socket.socket) -> bool:
    """Without blocking: whether the daemon has closed (or broken) the session."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return not data


def _exchange(sock: socket.socket, packet: Packet) -> tuple[bytes, list[int]]:
    """Blocking: send one packet, return the reply."""
    send(sock, packet)
    reply = receive(sock)
    if reply is None:  # only a non-blocking socket says "not yet"
        raise Unavailable("session socket is non-blocking")
    return reply


def open_region_fd(path: str | os.PathLike[str]) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RegionFileMissing(f"region file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise InvalidArgument(f"cannot open region file {str(path)!r}: {exc.strerror}") from None
