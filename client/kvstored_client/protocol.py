# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The client's side of a session with the daemon, without I/O: written once for the blocking
clients (client.Client, aio.AsyncClient, through session.PoolSession) and the polled vLLM driver
(vllm/driver.DaemonLink), which only differ in how they move the packets.

- the gRPC channel's target and options (its reconnect backoff);
- the session socket's packets: Hello -> Welcome (with the pool's memfd), then AttachRegion (with
  a region's fd) -> RegionAttached and OpenArena -> ArenaOpened (with a tenant arena's memfd), any
  of them answered by an error instead (`Handshake`);
- when to try a new session after a failure (`Backoff`);
- noticing that this process is a fork of the one that set the session up (`ForkGuard`);
- whether the daemon is reachable and why not (`LinkHealth`: one WARNING per change of condition,
  one INFO when it is back; session.diagnose() finds the condition);
- the standard gRPC health check's wire format (`HEALTH_CHECK`), without grpcio-health-checking.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from os import PathLike

from google.protobuf.message import DecodeError

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.errors import Unavailable, from_code

log = logging.getLogger(__name__)

MAX_PACKET = 64 << 10  # one session socket packet (SEQPACKET keeps message boundaries)
MAX_FDS = 4  # file descriptors accepted with one packet (a reply carries at most one)

# The fast path: these gRPC methods can also travel over the session socket, one packet each way
# (the SessionRequest / SessionReply field of each). A daemon that serves them says so in Welcome.
FAST_METHODS = {
    "Lookup": "lookup",
    "Reserve": "reserve",
    "Commit": "commit",
    "Acquire": "acquire",
    "Release": "release",
    "StoreFromRegion": "store_from_region",
    "LoadToRegion": "load_to_region",
    "Delete": "delete",
    "Touch": "touch",
}
# Region copies joined the fast path later: a daemon serves them there only if its Welcome says
# fast_regions (an older one would refuse them), else they go over gRPC.
FAST_REGION_METHODS = frozenset({"StoreFromRegion", "LoadToRegion"})
# Delete joined later still (so that a delete after a posted Commit is ordered behind it on the
# same connection, and costs no gRPC call): only where Welcome says fast_delete.
FAST_DELETE_METHODS = frozenset({"Delete"})
# Touch came with the key indexes (OpenIndex): only where Welcome says key_index.
FAST_INDEX_METHODS = frozenset({"Touch"})
REPLY_TOO_LARGE = "ReplyTooLarge"  # SessionError.kind: the answer did not fit a packet; ask over gRPC
FAST_REPLY_MAX = 1 << 20  # the largest fast-path answer a daemon sends (clients receive into this much)

# Reconnect quickly after a daemon restart instead of gRPC's default backoff (up to 120 s).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 << 20),
)


def channel_target(socket_path: str | PathLike[str]) -> str:
    """The gRPC target of the daemon's unix socket."""
    return f"unix:{os.fspath(socket_path)}"


@dataclass(frozen=True)
class Packet:
    """One session socket message and the fds that travel with it (the sender keeps its own)."""

    data: bytes
    fds: tuple[int, ...] = ()


@dataclass(frozen=True)
class Welcome:
    """A new session, and the daemon's pool: `pool_fd` (a memfd) belongs to the receiver."""

    session_id: str
    pool_bytes: int
    page_bytes: int
    pool_fd: int
    fast_path: bool = False  # the daemon serves FAST_METHODS on the session socket
    fast_regions: bool = False  # ... FAST_REGION_METHODS included
    fast_delete: bool = False  # ... FAST_DELETE_METHODS included
    key_index: bool = False  # ... FAST_INDEX_METHODS included, and OpenIndex answered

    def serves_fast(self, method: str) -> bool:
        """Whether `method` may go over this session's fast path."""
        if not self.fast_path or method not in FAST_METHODS:
            return False
        if method in FAST_REGION_METHODS:
            return self.fast_regions
        if method in FAST_INDEX_METHODS:
            return self.key_index
        return self.fast_delete or method not in FAST_DELETE_METHODS


@dataclass(frozen=True)
class RegionAttached:
    region_id: int  # valid in this session only
    size: int


@dataclass(frozen=True)
class ArenaOpened:
    """A tenant's arena (its chunks' pool slots): `fd` (a memfd) belongs to the receiver."""

    arena_id: int
    size: int
    fd: int


@dataclass(frozen=True)
class IndexOpened:
    """A namespace's key index: `fd` (read-only) belongs to the receiver."""

    namespace_id: str
    size: int
    key_bytes: int
    fd: int


class Awaiting(enum.Enum):
    NOTHING = "nothing"
    WELCOME = "welcome"  # Hello sent
    REGION_ATTACHED = "region_attached"  # AttachRegion sent
    ARENA_OPENED = "arena_opened"  # OpenArena sent
    INDEX_OPENED = "index_opened"  # OpenIndex sent


class Handshake:
    """One session's messages, in order: `hello()` first, `attach_region()` once welcomed, each
    answered by one packet the caller hands to `welcome_from()` / `attached_from()`.

    Those take ownership of the fds that came with the packet: an fd the reply carries is
    returned, every other one is closed. An error reply raises its mapped KvstoredError (a
    refused region leaves the session usable); a closed socket, an unexpected or undecodable
    reply raises Unavailable (the session is unusable)."""

    def __init__(self, client_name: str, pins_pool: bool = False, released: Sequence[str] = ()) -> None:
        """pins_pool: this client pins the pool for DMA (the daemon then keeps its memory);
        released: its earlier sessions it will never copy into again (Hello.released_sessions)."""
        self.client_name = client_name
        self.pins_pool = pins_pool
        self.released = tuple(released)
        self.awaiting = Awaiting.NOTHING
        self.welcome: Welcome | None = None

    def hello(self) -> Packet:
        self._expect(Awaiting.NOTHING, welcomed=False)
        self.awaiting = Awaiting.WELCOME
        hello = pb.Hello(
            client_name=self.client_name, arenas=True, pins_pool=self.pins_pool, released_sessions=self.released
        )
        return Packet(pb.SessionRequest(hello=hello).SerializeToString())

    def attach_region(self, name: str, fd: int) -> Packet:
        """Hand the daemon an open region file (the fd is sent, not given away)."""
        self._expect(Awaiting.NOTHING, welcomed=True)
        self.awaiting = Awaiting.REGION_ATTACHED
        return Packet(pb.SessionRequest(attach_region=pb.AttachRegion(name=name)).SerializeToString(), (fd,))

    def open_arena(self, arena_id: int) -> Packet:
        """Ask for a tenant arena this session registered a namespace of."""
        self._expect(Awaiting.NOTHING, welcomed=True)
        self.awaiting = Awaiting.ARENA_OPENED
        return Packet(pb.SessionRequest(open_arena=pb.OpenArena(arena_id=arena_id)).SerializeToString())

    def open_index(self, namespace_id: str) -> Packet:
        """Ask for a namespace's key index (a daemon whose Welcome says key_index)."""
        self._expect(Awaiting.NOTHING, welcomed=True)
        self.awaiting = Awaiting.INDEX_OPENED
        return Packet(pb.SessionRequest(open_index=pb.OpenIndex(namespace_id=namespace_id)).SerializeToString())

    def index_from(self, data: bytes, fds: list[int]) -> IndexOpened:
        reply = self._reply(Awaiting.INDEX_OPENED, data, fds)
        if reply.WhichOneof("kind") != "index_opened" or len(fds) != 1:
            _close_all(fds)
            raise Unavailable(f"unexpected session reply to OpenIndex: {reply}")
        opened = reply.index_opened
        return IndexOpened(opened.namespace_id, opened.size, opened.key_bytes, fds[0])

    def welcome_from(self, data: bytes, fds: list[int]) -> Welcome:
        reply = self._reply(Awaiting.WELCOME, data, fds)
        if reply.WhichOneof("kind") != "welcome" or len(fds) != 1:
            _close_all(fds)
            raise Unavailable(f"unexpected session reply to Hello: {reply}")
        welcome = reply.welcome
        self.welcome = Welcome(
            welcome.session_id,
            welcome.pool_bytes,
            welcome.page_bytes,
            fds[0],
            welcome.fast_path,
            welcome.fast_regions,
            welcome.fast_delete,
            welcome.key_index,
        )
        return self.welcome

    def attached_from(self, data: bytes, fds: list[int]) -> RegionAttached:
        reply = self._reply(Awaiting.REGION_ATTACHED, data, fds)
        _close_all(fds)
        if reply.WhichOneof("kind") != "region_attached":
            raise Unavailable(f"unexpected session reply to AttachRegion: {reply}")
        return RegionAttached(reply.region_attached.region_id, reply.region_attached.size)

    def arena_from(self, data: bytes, fds: list[int]) -> ArenaOpened:
        reply = self._reply(Awaiting.ARENA_OPENED, data, fds)
        if reply.WhichOneof("kind") != "arena_opened" or len(fds) != 1:
            _close_all(fds)
            raise Unavailable(f"unexpected session reply to OpenArena: {reply}")
        return ArenaOpened(reply.arena_opened.arena_id, reply.arena_opened.size, fds[0])

    def _reply(self, expected: Awaiting, data: bytes, fds: list[int]) -> pb.SessionReply:
        self._expect(expected, welcomed=expected is not Awaiting.WELCOME)
        self.awaiting = Awaiting.NOTHING
        if not data:
            _close_all(fds)
            raise Unavailable("kvstored closed the session")
        try:
            reply = pb.SessionReply.FromString(data)
        except DecodeError as exc:
            _close_all(fds)
            raise Unavailable(f"undecodable session reply: {exc}") from None
        if reply.WhichOneof("kind") == "error":
            _close_all(fds)
            raise from_code(reply.error.code, reply.error.message)
        return reply

    def _expect(self, awaiting: Awaiting, welcomed: bool) -> None:
        if self.awaiting is not awaiting or (self.welcome is not None) != welcomed:
            raise RuntimeError(
                f"session handshake out of order: awaiting {self.awaiting.value}, "
                f"{'welcomed' if self.welcome else 'not welcomed'}"
            )


class Backoff:
    """When to try a new session after a failure: `min_s`, doubling per failure up to `max_s`,
    back to `min_s` once a session is up. Times are the caller's monotonic clock."""

    def __init__(self, min_s: float, max_s: float) -> None:
        self.min_s, self.max_s = min_s, max_s
        self._delay = min_s
        self._retry_at = 0.0

    def due(self, now: float) -> bool:
        return now >= self._retry_at

    def failed(self, now: float, wait: bool = True) -> None:
        """A failure at `now`; wait=False: try again at once (the daemon restarted, it is back)."""
        self._retry_at = now + (self._delay if wait else 0.0)
        if wait:
            self._delay = min(self._delay * 2, self.max_s)

    def succeeded(self) -> None:
        self._delay = self.min_s

    def skip(self) -> None:
        """Try again at the next chance (the caller knows the daemon is back)."""
        self._retry_at = 0.0


class ForkGuard:
    """Notices that its owner now runs in a forked child, which must not use its parent's channel,
    session or locks (vLLM builds its scheduler-side objects, then forks EngineCore)."""

    def __init__(self) -> None:
        self._pid = os.getpid()

    def forked(self) -> bool:
        """True once per fork: the first time it is asked in the child."""
        pid = os.getpid()
        if pid == self._pid:
            return False
        self._pid = pid
        return True


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# -- reachability ----------------------------------------------------------------------------------


class Reason(enum.Enum):
    """Why the daemon could not be reached."""

    NOT_FOUND = "not found"  # no socket at the path (not running, starting, or a wrong path)
    REFUSED = "refused"  # a socket file nobody listens on (stopped or killed)
    PERMISSION_DENIED = "permission denied"  # the socket or its directory is not ours to use
    RESTARTING = "daemon restarting"  # it accepts connections but does not serve (starting, stopping)
    REJECTED = "rejected"  # it answered the session with an error (a region it refused...)
    UNUSABLE = "unusable"  # something else is at the path


@dataclass(frozen=True)
class Condition:
    reason: Reason
    detail: str  # what was seen, naming the path (and the group, for permissions)
    cause: str = field(default="", compare=False)  # the error at hand: varies within one condition

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}" + (f": {self.cause}" if self.cause else "")


class LinkHealth:
    """The daemon's reachability as a client last saw it. Failures degrade silently (a miss, a
    dropped store), so each change of condition is logged once as a WARNING naming the socket and
    the reason, and the return as one INFO; repeats of the same condition say nothing."""

    def __init__(self, socket_path: str | PathLike[str]) -> None:
        self.socket_path = os.fspath(socket_path)
        self.condition: Condition | None = None

    def unreachable(self, condition: Condition) -> None:
        if condition != self.condition:
            log.warning(
                "kvstored at %s is unreachable: %s; lookups miss and stores are dropped until it is back",
                self.socket_path,
                condition,
            )
        self.condition = condition

    def reachable(self) -> None:
        if self.condition is not None:
            log.info("kvstored at %s is reachable again (was %s)", self.socket_path, self.condition.reason.value)
        self.condition = None


# -- the standard health check (grpc.health.v1), hand-coded: its request is empty when it asks
# for the whole server, its response one enum field -----------------------------------------------

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING_STATUS = ("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")


def encode_health_request(_: object = None) -> bytes:
    return b""  # HealthCheckRequest(service=""): the server as a whole


def decode_health_response(data: bytes) -> str:
    """HealthCheckResponse -> its status name (field 1, a varint; absent means UNKNOWN)."""
    status, i = 0, 0
    while i < len(data):
        tag, i = _varint(data, i)
        if tag >> 3 == 1 and tag & 7 == 0:
            status, i = _varint(data, i)
        elif tag & 7 == 0:
            _, i = _varint(data, i)
        elif tag & 7 == 2:
            length, i = _varint(data, i)
            i += length
        else:
            raise ValueError(f"unexpected wire type {tag & 7} in a health response")
    return SERVING_STATUS[status] if status < len(SERVING_STATUS) else f"STATUS_{status}"


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7
