# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The session socket: a SOCK_SEQPACKET unix socket beside the gRPC one.

gRPC cannot carry file descriptors, and the data path needs them: the daemon hands each client
its pool (a memfd) and the arenas of the tenants it registered (OpenArena), and a client hands
the daemon a region file it may not be able to open by path (vLLM's region is mode 0600 under
another user). One packet is one protobuf message; fds ride
along as SCM_RIGHTS. The connection *is* the session: when it closes, for any reason, the
session's leases, reservations and regions are given back.

The data path's hot calls also travel here (fast_path.py): they are answered by tasks of the
connection, so that the connection closing is noticed (and the session ended) while one waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

from kvstored.errors import KvstoredError
from kvstored.logs import LogLimiter
from kvstored.server.broker import SessionBroker
from kvstored.server.credentials import client_credentials
from kvstored.server.errors import status_for
from kvstored.server.fast_path import KINDS as FAST_KINDS
from kvstored.server.fast_path import NEVER_WAIT, FastPath
from kvstored.server.sessions import Session
from kvstored.server.tenants import Tenancy
from kvstored.shm.keyindex import KeyIndex
from kvstored.shm.mapping import SharedPool
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.protocol import FAST_REPLY_MAX

log = logging.getLogger(__name__)
limited = LogLimiter(log)  # (EMFILE repeats every ACCEPT_RETRY_S while it lasts)

MAX_PACKET = 64 << 10
ACCEPT_RETRY_S = 0.1
SEND_BUFFER = 1 << 20  # asked for, so that large fast-path answers fit a packet (the kernel caps it)
MAX_IN_FLIGHT = 64  # fast-path requests answered at once per connection; more wait to be read


IndexOpener = Callable[[Session, str], KeyIndex]  # (session, namespace id) -> its key index

_MSG_TRUNC = int(socket.MSG_TRUNC)  # (an IntFlag: `&` on it costs microseconds a packet)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
MAX_FDS = 4  # fds read with one packet (a client sends at most one)


class _Packets:
    """A connection's incoming packets. Its fd stays watched while packets keep coming, instead
    of being watched anew for each one (two epoll_ctl calls a packet, on the fast path's clock)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future | None = None
        self._watching = False

    async def next(self) -> tuple[bytes, list[int], bool]:
        """The next packet, its fds, and whether it was cut to MAX_PACKET (SEQPACKET truncates)
        or carried more than MAX_FDS fds (the kernel closed the rest: -1 stands for them)."""
        while True:
            try:
                data, fds, flags, _addr = socket.recv_fds(self._sock, MAX_PACKET, MAX_FDS)
                if flags & _MSG_CTRUNC:
                    fds.append(-1)
                return data, fds, bool(flags & _MSG_TRUNC)
            except BlockingIOError:
                pass
            if not self._watching:
                self._loop.add_reader(self._sock.fileno(), self._readable)
                self._watching = True
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _readable(self) -> None:
        if self._waiter is not None:
            if not self._waiter.done():
                self._waiter.set_result(None)
        else:  # nobody reads now: stop watching (a readable fd would call this every iteration)
            self.close()

    def close(self) -> None:
        if self._watching:
            self._loop.remove_reader(self._sock.fileno())
            self._watching = False


def _send(sock: socket.socket, reply: pb.SessionReply, fds: list[int] | None = None) -> None:
    # Replies are tiny; a fresh SEQPACKET socket always has room for one.
    socket.send_fds(sock, [reply.SerializeToString()], fds or [])


class SessionSocketServer:
    def __init__(
        self,
        path: Path,
        mode: int,
        broker: SessionBroker,
        pool: SharedPool,
        page_bytes: int,
        tenancy: Tenancy,
        fast: FastPath | None = None,
        open_index: IndexOpener | None = None,
    ) -> None:
        self._fast = fast  # None: the fast path is refused (clients fall back to gRPC)
        self._open_index = open_index if fast is not None else None  # None: no key indexes
        self._path = path
        self._mode = mode
        self._broker = broker
        self._tenancy = tenancy
        self._pool = pool
        self._page_bytes = page_bytes
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._conn_tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.bind(str(self._path))
        os.chmod(self._path, self._mode)
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self._accept_task = asyncio.create_task(self._accept_loop(sock), name="session-accept")

    async def stop_accepting(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task  # the loop never ends with an error: see _accept_loop
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()

    async def close(self) -> None:
        """Stop accepting, then end every session (their handles and regions are released)."""
        await self.stop_accepting()
        for task in list(self._conn_tasks):
            task.cancel()
        await asyncio.gather(*self._conn_tasks, return_exceptions=True)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE, ENFILE, ECONNABORTED...: keep accepting once it passes
                limited.log("accept", logging.ERROR, "session socket: cannot accept a connection: %s", exc)
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            conn.setblocking(False)
            task = asyncio.create_task(self._serve(conn), name="session")
            self._conn_tasks.add(task)
            task.add_done_callback(self._conn_tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        session = None
        packets = _Packets(conn)
        in_flight: set[asyncio.Task] = set()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        # The largest answer a packet can carry here (less the kernel's per-packet overhead).
        limit = min(conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) - 1024, FAST_REPLY_MAX)
        try:
            while True:
                if len(in_flight) >= MAX_IN_FLIGHT:
                    await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                data, fds, truncated = await packets.next()
                if not data:  # the peer closed (clients never send an empty message): the session ends
                    for fd in fds:  # a zero-length packet may still carry fds
                        if fd >= 0:
                            os.close(fd)
                    return
                try:
                    if truncated:
                        _send_error(conn, "INVALID_ARGUMENT", f"session message exceeds {MAX_PACKET} bytes")
                        continue
                    request = pb.SessionRequest.FromString(data)
                    kind = request.WhichOneof("kind")
                    if kind in FAST_KINDS and session is not None and self._fast is not None:
                        answer = self._fast.answer(session, request, kind, limit)
                        if kind in NEVER_WAIT:
                            await _reply(conn, session, answer)
                        else:  # may wait (room, a promotion): the connection keeps being read meanwhile
                            # A task of its own from the first step: a deadline it enters (the
                            # directory's, a peer fetch's) must cancel it, never this connection's.
                            task = asyncio.get_running_loop().create_task(_reply(conn, session, answer), name=kind)
                            in_flight.add(task)
                            task.add_done_callback(in_flight.discard)
                    elif kind == "hello" and session is None:
                        hello = request.hello
                        session = self._broker.open(hello.client_name, hello.arenas, hello.pins_pool)
                        session.client = client_credentials(conn)
                        self._broker.released(session, hello.released_sessions)
                        log.info("session %s opened by %r", session.session_id[:8], session.client_name)
                        welcome = pb.Welcome(
                            session_id=session.session_id,
                            pool_bytes=self._pool.size,
                            page_bytes=self._page_bytes,
                            fast_path=self._fast is not None,
                            fast_regions=self._fast is not None,
                            fast_delete=self._fast is not None,
                            key_index=self._open_index is not None,
                        )
                        _send(conn, pb.SessionReply(welcome=welcome), [self._pool.fd])
                    elif kind == "attach_region" and session is not None:
                        if len(fds) != 1:
                            got = f"more than {MAX_FDS}" if -1 in fds else str(len(fds))
                            _send_error(conn, "INVALID_ARGUMENT", f"AttachRegion needs exactly one fd, got {got}")
                            continue
                        region = self._broker.attach_region(session, request.attach_region.name, fds[0])
                        attached = pb.RegionAttached(region_id=region.region_id, size=region.size)
                        _send(conn, pb.SessionReply(region_attached=attached))
                    elif kind == "open_index" and session is not None and self._open_index is not None:
                        index = self._open_index(session, request.open_index.namespace_id)
                        info = index.info
                        opened = pb.IndexOpened(
                            namespace_id=info.namespace_id, size=info.size, key_bytes=info.key_bytes
                        )
                        fd = index.read_only_fd()
                        try:
                            _send(conn, pb.SessionReply(index_opened=opened), [fd])
                        finally:
                            os.close(fd)
                    elif kind == "open_arena" and session is not None:
                        arena = self._tenancy.open_arena(session, request.open_arena.arena_id)
                        opened = pb.ArenaOpened(arena_id=arena.arena_id, size=arena.size)
                        _send(conn, pb.SessionReply(arena_opened=opened), [arena.fd])
                    else:
                        _send_error(conn, "FAILED_PRECONDITION", f"unexpected session message {kind!r}")
                except KvstoredError as exc:
                    _send_error(conn, status_for(exc).name, str(exc))
                except Exception as exc:  # a malformed packet must not end other sessions
                    log.warning("bad session message: %s", exc)
                    _send_error(conn, "INVALID_ARGUMENT", f"malformed session message: {exc}")
                finally:
                    for fd in fds:
                        if fd >= 0:
                            os.close(fd)
        except (ConnectionError, OSError) as exc:
            log.debug("session connection error: %s", exc)
        finally:
            # Requests still waiting are cut short, as gRPC cancels a call whose client went away.
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            packets.close()
            conn.close()
            if session is not None:
                self._broker.close_session(session)
                log.info("session %s closed", session.session_id[:8])


async def _reply(conn: socket.socket, session: Session, answer: Awaitable[bytes]) -> None:
    reply = await answer
    try:
        await asyncio.get_running_loop().sock_sendall(conn, reply)
    except OSError as exc:  # the client went away: the session ends with its connection
        log.debug("session %s: cannot send a fast-path answer: %s", session.session_id[:8], exc)


def _send_error(conn: socket.socket, code: str, message: str) -> None:
    _send(conn, pb.SessionReply(error=pb.SessionError(code=code, message=message)))
