"""Client end of the session socket: opens a session, maps the daemon's pool, attaches regions.

The mapping is made from the memfd the daemon sends (never by name: a client must not be able to
unlink the daemon's memory, and access follows the socket's permissions).
"""

from __future__ import annotations

import mmap
import os
import socket
from pathlib import Path

import numpy as np

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.buffers import ChunkCopier, PoolArrays
from kvstored_client.errors import InvalidArgument, RegionFileMissing, Unavailable, from_code
from kvstored_client.paths import session_socket_path

MAX_PACKET = 64 << 10


class PoolSession:
    def __init__(self, sock: socket.socket, welcome: pb.Welcome, pool_fd: int, populate: bool,
                 copy_threads: int = 1) -> None:
        self._sock = sock
        self.copier = ChunkCopier(copy_threads)
        self.session_id = welcome.session_id
        self.pool_bytes = welcome.pool_bytes
        self.page_bytes = welcome.page_bytes
        try:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            self._map = mmap.mmap(pool_fd, self.pool_bytes, flags=flags)
        finally:
            os.close(pool_fd)
        self.arrays = PoolArrays(self._map)

    @classmethod
    def open(cls, socket: Path | str, client_name: str, timeout: float, populate: bool = True,
             copy_threads: int = 1) -> "PoolSession":
        sock = _connect(session_socket_path(socket), timeout)
        try:
            reply, fds = _request(sock, pb.SessionRequest(hello=pb.Hello(client_name=client_name)))
            if reply.WhichOneof("kind") != "welcome" or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise Unavailable(f"unexpected session reply: {reply}")
            sock.settimeout(timeout)
            return cls(sock, reply.welcome, fds[0], populate, copy_threads)
        except BaseException:
            sock.close()
            raise

    def attach_region(self, fd: int, name: str) -> tuple[int, int]:
        """Hand the daemon an open region file; returns (region id, size)."""
        reply, fds = _request(self._sock, pb.SessionRequest(attach_region=pb.AttachRegion(name=name)), [fd])
        for extra in fds:
            os.close(extra)
        return reply.region_attached.region_id, reply.region_attached.size

    @property
    def pool(self) -> np.ndarray | None:
        """The pool as a flat numpy uint8 array (None once closed)."""
        return self.arrays.numpy

    def close(self) -> None:
        self.copier.close()
        self._sock.close()
        self.arrays.release()
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view into the pool; freed with it
            pass


def _connect(path: Path, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        raise Unavailable(f"kvstored is not reachable at {path}: {exc.strerror or exc}") from None
    return sock


def _request(sock: socket.socket, request: pb.SessionRequest, fds: list[int] | None = None):
    try:
        socket.send_fds(sock, [request.SerializeToString()], fds or [])
        data, got_fds, _flags, _addr = socket.recv_fds(sock, MAX_PACKET, 4)
    except OSError as exc:  # includes timeouts
        raise Unavailable(f"session socket failed: {exc}") from None
    if not data:
        raise Unavailable("kvstored closed the session")
    reply = pb.SessionReply.FromString(data)
    if reply.WhichOneof("kind") == "error":
        for fd in got_fds:
            os.close(fd)
        raise from_code(reply.error.code, reply.error.message)
    return reply, got_fds


def open_region_fd(path: str | os.PathLike) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RegionFileMissing(f"region file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise InvalidArgument(f"cannot open region file {str(path)!r}: {exc.strerror}") from None
