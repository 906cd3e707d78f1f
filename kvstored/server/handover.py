# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Hand the RAM tier to the next daemon, so a restart keeps what RAM holds.

What is handed over: the pool memfd, each tenant arena's memfd and a memfd holding the state
(format, layout, the namespaces, the tenants, every arena's page map, the RAM index in LRU
order with each chunk's dirty/clean state, and an xxh3-64 of each chunk's bytes: known since
it was last checked or sent to a peer, else computed at the stop), framed with an xxh3-128 of
itself. The state is written only at hand-over time, complete, after the daemon
has quiesced, so a crashed daemon leaves nothing that could be adopted.

Two ways, the same payload (fds by name):
- a unix socket beside the gRPC one (`<socket>.handover`, SOCK_SEQPACKET, the daemon's own user
  only): the new daemon connects and asks; the running one stops as on SIGTERM (dirty chunks are
  written down first, within flush_on_stop_seconds, so a refused adoption loses nothing a cold
  restart keeps), sends the fds with SCM_RIGHTS, removes its socket files and closes the
  connection: that end of file tells the new daemon the sockets are free;
- systemd's fd store (kvstored/server/systemd.py): stored at stop, passed back as LISTEN_FDS.

The new daemon checks what it gets (state checksum, format, layout) and serves as soon as the
index and page map check out; each chunk's bytes are checked against its xxh3-64 before its first
read and by a background sweep (kvstored/chain/verify.py). Anything doubtful is dropped, never
served, and a refused state means a cold start.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import fcntl
import itertools
import json
import logging
import os
import signal
import socket
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvstored.namespaces import Namespace
from kvstored.server.credentials import client_credentials
from kvstored.server.held_writes import HeldRecord
from kvstored.shm.allocator import PageRun
from kvstored.tiers.ram import ArenaPages, ChunkRecord, HeldPages, RamSnapshot

log = logging.getLogger(__name__)

FORMAT = 1  # of the state; a daemon adopts only its own format
MAGIC = b"KVSTHO01"
_FRAME = struct.Struct("<8sQ16s")  # magic, payload length, xxh3-128 of the payload
REQUEST = b"kvstored-handover 1"
STATE_FD, POOL_FD, ARENA_FD = "kvstored-state", "kvstored-pool", "kvstored-arena-"
EXIT_WAIT_S = 5.0  # for a daemon that went away mid-hand-over to finish exiting (its sockets with it)
MAX_FDS_PER_MESSAGE = 200  # the kernel takes at most 253 per SCM_RIGHTS message
PAUSE_ENV = "KVSTORED_TEST_HANDOVER_PAUSE"


class HandoverRefused(Exception):
    """What was handed over cannot be adopted; the message says why (the daemon starts cold)."""


class HandoverStep(enum.Enum):
    """Named steps, where a test can stop the daemon (PAUSE_ENV) to kill it there."""

    REQUESTED = "requested"  # the old daemon heard the request, before it quiesces
    QUIESCED = "quiesced"  # the old daemon stopped serving, before its snapshot
    SNAPSHOT = "snapshot"  # the state memfd is written, before it is sent
    SENT = "sent"  # the fds are sent, before the old daemon removes its sockets
    RECEIVED = "received"  # the new daemon has the fds, before it checks them
    VERIFIED = "verified"  # the state checked out, before the pool is mapped
    ADOPTED = "adopted"  # the RAM index is adopted, before serving


def pause_at(step: HandoverStep) -> None:
    """A test hook: stop this process (SIGSTOP) at `step` if PAUSE_ENV names it; the test sees
    the stopped state in /proc and kills the process or lets it go on (SIGCONT)."""
    if os.environ.get(PAUSE_ENV) == step.value:
        log.warning("hand-over: stopping at step %s (%s)", step.value, PAUSE_ENV)
        os.kill(os.getpid(), signal.SIGSTOP)


def handover_path(socket_path: Path) -> Path:
    return Path(f"{socket_path}.handover")


@dataclass(frozen=True)
class Layout:
    """What the pool's bytes mean: both daemons must agree on all of it."""

    cpu_bytes: int
    page_bytes: int
    pool_pages: str
    tenant_arena_bytes: int


@dataclass(frozen=True)
class PoolState:
    version: str  # of the daemon that wrote it (for the log: any version of the same FORMAT is adopted)
    layout: Layout
    namespaces: list[tuple[Namespace, tuple[str, ...]]]  # and the tiers it was recovered from
    tenants: dict[int, str]  # arena id -> tenant key
    ram: RamSnapshot  # its ChunkRecords carry their xxh3-64 (None: not taken)
    held: list[HeldRecord] = field(default_factory=list)  # pages clients of ended sessions may still use
    pid_ns: int = 0  # the writer's pid namespace, which the held records' pids are of (0: unknown)
    next_arena: int = 0  # the next arena id to give out on this pool (0: not known)


@dataclass
class HandedOver:
    """Fds received by name (the caller takes the ones it adopts; close() closes the rest)."""

    fds: dict[str, int]
    source: str

    def take(self, name: str) -> int:
        try:
            return self.fds.pop(name)
        except KeyError:
            raise HandoverRefused(f"{name} was not handed over") from None

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


# -- the state ------------------------------------------------------------------------------------


def encode_state(state: PoolState) -> bytes:
    ns_index = {ns.namespace_id: i for i, (ns, _) in enumerate(state.namespaces)}
    # Several sessions may hold the same pages (a chunk they all leased): "held" names each page
    # set once, with the first of them, and "held_shared" the others.
    seen: set[HeldPages] = set()
    own_pages, shared_pages = [], []
    for h in state.held:
        pages = list(dict.fromkeys(h.pages))
        own_pages.append([p for p in pages if p not in seen])
        shared_pages.append([p for p in pages if p in seen])
        seen.update(pages)
    chunks = [
        [
            ns_index[r.chunk[0]],
            r.chunk[1],
            r.size,
            r.arena,
            _flat(r.runs),
            r.persisted | r.probation << 1,
        ]
        for r in state.ram.chunks
    ]
    body = {
        "format": FORMAT,
        "version": state.version,
        "layout": [
            state.layout.cpu_bytes,
            state.layout.page_bytes,
            state.layout.pool_pages,
            state.layout.tenant_arena_bytes,
        ],
        "namespaces": [
            [
                ns.namespace_id,
                ns.model,
                ns.dtype,
                ns.chunk_bytes,
                ns.layout,
                ns.key_bytes,
                ns.block_tokens,
                ns.tenant,
                list(tiers),
            ]
            for ns, tiers in state.namespaces
        ],
        "tenants": [[arena, key] for arena, key in state.tenants.items()],
        "ram": [state.ram.page_bytes, state.ram.capacity_bytes],
        "arenas": [[arena, pages.total_pages, _flat(pages.holes)] for arena, pages in state.ram.arenas.items()],
        "chunks": chunks,
        "checksums": [r.checksum for r in state.ram.chunks],  # (a None: that chunk has none)
        # (a daemon that predates it ignores the key: it takes those pages as free, as it did)
        "pid_ns": state.pid_ns,
        "next_arena": state.next_arena,
        "held": [
            [h.session_id, h.pid, h.seconds_left, [[p.arena, _flat(p.runs), p.namespace_id] for p in own]]
            for h, own in zip(state.held, own_pages, strict=True)
        ],
        # (apart from "held", whose records a daemon that predates them unpacks in fours, and
        # whose pages it takes as each held once)
        "held_shared": {
            h.session_id: [[p.arena, _flat(p.runs), p.namespace_id] for p in shared]
            for h, shared in zip(state.held, shared_pages, strict=True)
            if shared
        },
        "held_leases": {h.session_id: [[ns, key] for ns, key in h.leased] for h in state.held if h.leased},
    }
    import msgpack
    import xxhash

    payload = msgpack.packb(body, use_bin_type=True)
    return _FRAME.pack(MAGIC, len(payload), xxhash.xxh3_128_digest(payload)) + payload


def decode_state(frame: bytes) -> PoolState:
    """The state a frame holds; HandoverRefused for anything that is not one, complete and intact."""
    if len(frame) < _FRAME.size:
        raise HandoverRefused("the state is truncated")
    magic, length, digest = _FRAME.unpack_from(frame)
    payload = frame[_FRAME.size : _FRAME.size + length]
    if magic != MAGIC or len(payload) != length:
        raise HandoverRefused("the state is not a complete kvstored hand-over state")
    import msgpack  # (here: the GPU machine's lean installs start daemons without them)
    import xxhash

    if xxhash.xxh3_128_digest(payload) != digest:
        raise HandoverRefused("the state's checksum does not match its bytes")
    try:
        body = msgpack.unpackb(payload, raw=False)
        if body["format"] != FORMAT:
            raise HandoverRefused(f"the state is of format {body['format']}, this daemon reads format {FORMAT}")
        namespaces = [
            (Namespace(i, m, d, int(c), lay, int(k), int(b), t), tuple(tiers))
            for i, m, d, c, lay, k, b, t, tiers in body["namespaces"]
        ]
        ids = [ns.namespace_id for ns, _ in namespaces]
        checksums = body["checksums"]
        if checksums is not None and len(checksums) != len(body["chunks"]):
            raise HandoverRefused("the state has a checksum count that does not match its chunks")
        sums = checksums if checksums is not None else itertools.repeat(None)
        chunks = [
            ChunkRecord(
                (ids[n], bytes(key)),
                int(size),
                int(arena),
                _runs(runs),
                bool(flags & 1),
                bool(flags & 2),
                None if digest is None else int(digest),
            )
            for (n, key, size, arena, runs, flags), digest in zip(body["chunks"], sums)
        ]
        arenas = {int(a): ArenaPages(int(total), _runs(holes)) for a, total, holes in body["arenas"]}
        leases, shared = body.get("held_leases", {}), body.get("held_shared", {})
        held = [
            HeldRecord(
                str(session),
                int(pid),
                tuple(HeldPages(int(a), _runs(r), str(ns)) for a, r, ns in [*pages, *shared.get(session, ())]),
                float(left),
                tuple((str(ns), bytes(key)) for ns, key in leases.get(session, ())),
            )
            for session, pid, left, pages in body.get("held", ())
        ]
        return PoolState(
            str(body["version"]),
            Layout(*body["layout"]),
            namespaces,
            {int(a): str(key) for a, key in body["tenants"]},
            RamSnapshot(int(body["ram"][0]), int(body["ram"][1]), arenas, chunks),
            held,
            int(body.get("pid_ns", 0)),
            int(body.get("next_arena", 0)),
        )
    except HandoverRefused:
        raise
    except (KeyError, IndexError, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise HandoverRefused(f"the state does not decode: {exc!r}") from None


def _flat(runs: Sequence[PageRun]) -> list[int]:
    return [n for run in runs for n in (run.start, run.count)]


def _runs(flat: Sequence[int]) -> tuple[PageRun, ...]:
    return tuple(PageRun(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat) - 1, 2))


def check_layout(state: PoolState, layout: Layout) -> None:
    """HandoverRefused naming each setting that differs between the two daemons."""
    differ = [
        f"{name} {getattr(state.layout, name)} (handed over) != {getattr(layout, name)} (configured)"
        for name in ("cpu_bytes", "page_bytes", "pool_pages", "tenant_arena_bytes")
        if getattr(state.layout, name) != getattr(layout, name)
    ]
    if differ:
        raise HandoverRefused("the layout differs: " + ", ".join(differ))


def write_state_memfd(frame: bytes) -> int:
    """A memfd holding `frame`, its size sealed."""
    fd = os.memfd_create("kvstored-handover-state", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(frame)
        while view:
            view = view[os.write(fd, view) :]
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # (its checksum guards its bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_state_memfd(fd: int) -> PoolState:
    size = os.fstat(fd).st_size
    chunks = []
    offset = 0
    while offset < size:
        data = os.pread(fd, size - offset, offset)
        if not data:
            break
        chunks.append(data)
        offset += len(data)
    return decode_state(b"".join(chunks))


# -- the chunks' bytes ---------------------------------------------------------------------------


def with_checksums(
    chunks: Sequence[ChunkRecord], view_of: Callable[[int], memoryview], page_bytes: int, threads: int
) -> list[ChunkRecord]:
    """The records, each with its xxh3-64: those not known yet computed (chunk_checksums).
    Blocking: run it in a thread."""
    missing = [r for r in chunks if r.checksum is None]
    sums = iter(chunk_checksums(missing, view_of, page_bytes, threads))
    return [r if r.checksum is not None else replace(r, checksum=next(sums)) for r in chunks]


def chunk_checksums(
    chunks: Sequence[ChunkRecord], view_of: Callable[[int], memoryview], page_bytes: int, threads: int
) -> list[int]:
    """xxh3-64 of each chunk's bytes (its runs, up to its size), in `threads` threads (xxhash
    hashes without the GIL: ~9 GiB/s a thread here). Blocking: run it in a thread."""

    import xxhash

    def one(record: ChunkRecord) -> int:
        view, h, remaining = view_of(record.arena), xxhash.xxh3_64(), record.size
        for run in record.runs:
            length = min(run.count * page_bytes, remaining)
            h.update(view[run.start * page_bytes : run.start * page_bytes + length])
            remaining -= length
        return h.intdigest()

    if threads <= 1 or len(chunks) < 2:
        return [one(r) for r in chunks]
    with ThreadPoolExecutor(threads, thread_name_prefix="kvstored-checksum") as pool:
        return list(pool.map(one, chunks, chunksize=max(1, len(chunks) // (threads * 8))))


# -- the socket: the running daemon's side -------------------------------------------------------


class HandoverListener:
    """Listens on `<socket>.handover` for a new daemon's request; `on_request` stops this one."""

    def __init__(self, path: Path, on_request: Callable[[], None]) -> None:
        self.path = path
        self._on_request = on_request
        self._sock: socket.socket | None = None
        self._conn: socket.socket | None = None
        self._task: asyncio.Task | None = None

    @property
    def requested(self) -> bool:
        return self._conn is not None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # (stale: the gRPC socket was claimed, so no daemon serves here)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o600)  # the pool goes only to a daemon of this user
            sock.listen(4)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._task = asyncio.create_task(self._accept(), name="kvstored-handover-listener")

    async def _accept(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            if self._conn is not None or not _same_user(conn):
                conn.close()
                continue
            try:
                request = await asyncio.wait_for(loop.sock_recv(conn, 256), 10.0)
            except (TimeoutError, OSError):
                request = b""
            if request != REQUEST:
                log.warning("hand-over: ignored a request that is not %r", REQUEST.decode())
                conn.close()
                continue
            log.info("hand-over requested by a new daemon")
            self._conn = conn
            pause_at(HandoverStep.REQUESTED)
            self._on_request()

    async def stop_listening(self) -> None:
        """No more requests (the one taken, if any, stays open until finish())."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def send(self, fds: dict[str, int]) -> None:
        """The fds, by name, to the daemon that asked (OSError if it went away)."""
        assert self._conn is not None
        self._conn.setblocking(True)
        self._conn.settimeout(10.0)
        items = list(fds.items())
        for start in range(0, max(1, len(items)), MAX_FDS_PER_MESSAGE):
            part = items[start : start + MAX_FDS_PER_MESSAGE]
            more = start + MAX_FDS_PER_MESSAGE < len(items)
            header = json.dumps({"names": [name for name, _ in part], "more": more}).encode()
            socket.send_fds(self._conn, [header], [fd for _, fd in part])

    def finish(self) -> None:
        """Close the connection: the new daemon takes it as "the sockets are gone"."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _same_user(conn: socket.socket) -> bool:
    uid = client_credentials(conn).uid
    if uid not in (os.geteuid(), 0):
        log.warning("hand-over: refused a request from uid %d (this daemon runs as %d)", uid, os.geteuid())
        return False
    return True


# -- the socket: the new daemon's side -------------------------------------------------------------


@dataclass
class _Reader:
    sock: socket.socket
    names: list[str] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    async def readable(self) -> None:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.add_reader(self.sock.fileno(), ready.set_result, None)
        try:
            await ready
        finally:
            loop.remove_reader(self.sock.fileno())

    async def message(self) -> bytes:
        while True:
            await self.readable()
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, 65536, MAX_FDS_PER_MESSAGE + 1)
            except BlockingIOError:
                continue
            self.fds += fds
            return data


async def request_handover(path: Path, timeout_s: float) -> HandedOver | None:
    """Ask the daemon serving beside `path` for its RAM tier. None when no daemon listens there
    (nothing to adopt); HandoverRefused when one answered but the hand-over did not complete
    (it went away first: it may have been killed mid-way). Returns once that daemon has
    removed its sockets."""
    try:
        if not path.is_socket():
            return None
    except OSError:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    reader = _Reader(sock)
    try:
        try:
            sock.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("hand-over: no daemon listens on %s (a stale socket): starting cold", path)
            return None
        sock.sendall(REQUEST)
        sock.setblocking(False)
        serving = client_credentials(sock).pid
        log.info("hand-over: asked the running daemon for its RAM tier (it stops first)")
        async with asyncio.timeout(timeout_s):
            more = True
            while more:
                data = await reader.message()
                if not data:
                    # (killed mid-way: its other sockets close as it exits, not with this one)
                    await _exited(serving, EXIT_WAIT_S)
                    raise HandoverRefused("the running daemon went away before it handed everything over")
                header = json.loads(data)
                reader.names += header["names"]
                more = bool(header["more"])
            if len(reader.names) != len(reader.fds):
                raise HandoverRefused(f"{len(reader.names)} fds named, {len(reader.fds)} received")
            while await reader.message():  # to the end: then its socket files are gone
                pass
    except TimeoutError:
        _close_all(reader.fds)
        raise HandoverRefused(f"no hand-over within {timeout_s:.0f} s") from None
    except (OSError, ValueError, KeyError) as exc:
        _close_all(reader.fds)
        raise HandoverRefused(f"the hand-over failed: {exc}") from None
    except BaseException:
        _close_all(reader.fds)
        raise
    finally:
        sock.close()
    return HandedOver(dict(zip(reader.names, reader.fds, strict=True)), "the previous daemon (socket)")


async def _exited(pid: int, timeout_s: float) -> None:
    """Returns once process `pid` has exited (every fd it had closed), or after `timeout_s`."""
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, OverflowError):  # (gone already, or not to be watched: nothing to wait for)
        return
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        async with asyncio.timeout(timeout_s):
            await exited
    except TimeoutError:
        log.warning("hand-over: the running daemon (pid %d) has not exited after %.0f s", pid, timeout_s)
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
