# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A non-blocking link to the local daemon, for code that must never wait (vLLM's scheduler).

The sync `Client` blocks on every call. Code that runs inside vLLM's scheduler step cannot, so this
driver is polled instead: `poll()` advances the session handshake one non-blocking step at a time,
RPCs are issued with gRPC's `stub.Method.future(...)` and collected later with `done()`. There is
no thread and no event loop of our own: gRPC's channel does the I/O, and the fast path's answers
(FastCall) are read by poll() and done() with non-blocking receives, matched to calls by id.

State machine:  DOWN --(retry time reached)--> HELLO --(Welcome)--> ATTACH --(RegionAttached)--> READY
Any failure returns to DOWN with an exponential backoff. A link that maps the pool (keep_pool_fd)
also opens, while READY, the arenas of the tenant namespaces it registers (OpenArena, one at a
time): such a namespace is ready only once its arena is (`arena_fds`). A daemon restart shows up as the session
socket closing (or as unknown-session errors) and starts a new session: the region is attached
again and namespaces are registered again (`epoch` counts sessions). UNAVAILABLE on a call ends
the session only where the session socket is gone too: gRPC stops before the session socket does.

A session that ends (for the client's own reasons) while region copies it sent on the session
socket are unanswered does not end them at once: the daemon may be copying them right now, into
or out of slots the caller would then reuse. Its socket is half-closed instead and read on (one
`_Closing` per such session, beside the next session) until the daemon closes its side, which it
does once its copies have ended; those copies end then, or with their own answers (outcome
unknown: UNAVAILABLE, after ops.REGION_COPY_GRACE_S at most).

The channel and the session are created lazily in the process that uses them, and dropped when a
fork is noticed: vLLM builds its scheduler-side objects after forking EngineCore.

What is said to the daemon (the handshake, the channel's options, the backoff, fork detection) is
kvstored_client.protocol's, shared with the blocking clients; this module only polls it along.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import select
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError

from kvstored_client import fast, keyindex, session
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KvstoredError,
    Unavailable,
    UnknownNamespace,
    UnknownRegion,
    UnknownSession,
    from_rpc_error,
)
from kvstored_client.keyindex import KeyIndexView, open_view
from kvstored_client.ops import REGION_COPY_GRACE_S, NamespaceSpec
from kvstored_client.paths import session_socket_path
from kvstored_client.protocol import (
    CHANNEL_OPTIONS,
    FAST_REPLY_MAX,
    MAX_FDS,
    REPLY_TOO_LARGE,
    Backoff,
    Condition,
    ForkGuard,
    Handshake,
    LinkHealth,
    Reason,
    channel_target,
)

log = logging.getLogger(__name__)

# The server has dropped what this session set up: start a new session at once.
SESSION_LOST = (UnknownSession, UnknownRegion)
# Calls that copy between the client's region and the daemon: outstanding, they keep an ended
# session's socket open (half-closed) until the daemon has ended them (see _Closing).
REGION_COPIES = frozenset({"LoadToRegion", "StoreFromRegion"})


def arena_key(pool_id: str, arena: int) -> str:
    """Names one arena of one daemon run: the pool's id for the public arena (0), else the pool's
    id and the arena's (arena ids are never reused within a run)."""
    return pool_id if arena == 0 else f"{pool_id}#{arena}"


def run_of(key: str) -> str:
    """The pool id (daemon run) an arena key belongs to."""
    return key.partition("#")[0]


class LinkState(enum.Enum):
    DOWN = "down"
    HELLO = "hello"  # connected, Hello sent, waiting for Welcome
    ATTACH = "attach"  # region fd sent, waiting for RegionAttached
    READY = "ready"


@dataclass(frozen=True)
class LinkOptions:
    connect_timeout_s: float = 1.0  # one handshake step may take this long before giving up
    backoff_min_s: float = 0.05
    backoff_max_s: float = 2.0
    rpc_timeout_s: float = 1.0  # control RPCs (namespace registration)


@dataclass
class _NamespaceState:
    spec: NamespaceSpec
    namespace_id: str
    epoch: int = -1  # session epoch it was registered in
    future: grpc.Future | None = None
    future_epoch: int = -1
    broken: str = ""  # a permanent error (invalid spec): never usable
    arena_id: int = 0  # the arena its chunks live in (0: the public pool)


@dataclass
class Outcome:
    """The end of one RPC future: a response, or a mapped error (with its raw gRPC code)."""

    response: Any = None
    error: KvstoredError | None = None
    code: grpc.StatusCode | None = None
    stale: bool = False  # the link already ended the session this call was on: nothing more to do

    @property
    def ok(self) -> bool:
        return self.error is None


def outcome(future: grpc.Future | GrpcCall | FastCall) -> Outcome:
    """Collect a finished future without raising."""
    fast_outcome = getattr(future, "fast_outcome", None)  # (also through a wrapper that forwards)
    if fast_outcome is not None:
        return fast_outcome()
    assert not isinstance(future, FastCall | GrpcCall)  # (both answer through fast_outcome)
    try:
        return Outcome(response=future.result())
    except grpc.RpcError as exc:
        return Outcome(error=from_rpc_error(exc), code=exc.code())
    except grpc.FutureCancelledError:
        return Outcome(error=Unavailable("call cancelled"), code=grpc.StatusCode.CANCELLED)


class FastCall:
    """A call in flight on the session socket's fast path, read like the grpc.Future it stands
    for (done, exception, cancel; collect it with `outcome`). Its answer is read by the link's
    poll step, or by done() itself, never blocking; an answer too large for a packet is asked
    again over gRPC (`fallback`)."""

    def __init__(self, link: DaemonLink, method: str, request: Any, timeout: float | None) -> None:
        self.method = method
        self.request = request
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.started = time.perf_counter()
        self.answer: Outcome | None = None
        self.fallback: GrpcCall | None = None
        self._link = link

    def done(self) -> bool:
        if self.fallback is not None:
            return bool(self.fallback.done())
        if self.answer is None:
            self._link.collect()
        return self.answer is not None or (self.fallback is not None and self.fallback.done())

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait (blocking: for shutdown and drain code only) until done; grpc.FutureTimeoutError
        when `timeout` passes first."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise grpc.FutureTimeoutError()
            if self.fallback is not None:
                try:
                    return self.fallback.exception(timeout=left)
                except grpc.FutureCancelledError:
                    return None
            self._link.wait_readable(0.01 if left is None else min(left, 0.01))
        return self.fast_outcome().error

    def cancel(self) -> bool:
        if self.fallback is not None:
            return bool(self.fallback.cancel())
        if self.answer is not None:
            return False
        self._link.forget(self)
        self.answer = Outcome(error=Unavailable("call cancelled"), code=grpc.StatusCode.CANCELLED, stale=True)
        return True

    def fast_outcome(self) -> Outcome:
        if self.fallback is not None:
            return outcome(self.fallback)
        if self.answer is None:  # blocks until done, as a gRPC future's result() does
            self.exception()
            return self.fast_outcome()
        return self.answer


class GrpcCall:
    """A call over gRPC and the session it was sent in, read like its grpc.Future (collect it
    with `outcome`). Once its session has ended, its failure says nothing of the next one, so it
    ends none (Outcome.stale): a call of the session before, failing while a new one was being
    opened or once it was, used to end that one too."""

    def __init__(self, link: DaemonLink, future: grpc.Future, epoch: int) -> None:
        self._link = link
        self._future = future
        self.epoch = epoch

    def done(self) -> bool:
        return bool(self._future.done())

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout=timeout)

    def cancel(self) -> bool:
        return bool(self._future.cancel())

    def fast_outcome(self) -> Outcome:
        result = outcome(self._future)
        if not result.ok and not (self._link.ready and self.epoch == self._link.epoch):
            result.stale = True  # (its session ended already: the next one's handshake may be under way)
        return result


Call: TypeAlias = "GrpcCall | FastCall"  # what DaemonLink.call starts


@dataclass
class _Closing:
    """An ended session whose region copies were unanswered: its socket, half-closed (nothing more
    is sent on it), is read until the daemon closes its side (it does once the copies it runs
    have ended) or until `until`; its copies end with their answers, or then."""

    sock: socket.socket
    pending: dict[int, FastCall]  # the region copies not answered yet, by call id
    until: float
    epoch: int


@dataclass
class LinkCounters:
    sessions_opened: int = 0
    failures: int = 0
    fast_calls: int = 0  # calls sent over the session socket's fast path
    grpc_calls: int = 0  # calls sent over gRPC
    last_error: str = ""
    errors_by_code: dict[str, int] = field(default_factory=dict)


class DaemonLink:
    """One process' control connection to the daemon: gRPC channel + session + one optional region."""

    def __init__(
        self,
        socket_path: str | os.PathLike,
        client_name: str,
        *,
        region_fd: int | None = None,
        region_name: str = "",
        keep_pool_fd: bool = False,
        pins_pool: bool = False,
        options: LinkOptions = LinkOptions(),
        fast_path: bool | None = None,
    ) -> None:
        """keep_pool_fd: keep the pool's memfd (and open tenant arenas) to map them; pins_pool:
        the pool is pinned for DMA (told to the daemon, which then keeps the pool's memory);
        fast_path: send Lookup, Reserve, Commit, Acquire, Release and the region copies over
        the session socket when the daemon serves them there (default: KVSTORED_FAST_PATH, on)."""
        self.fast_path = fast.fast_path_default() if fast_path is None else fast_path
        self.socket_path = Path(socket_path)
        self.client_name = client_name
        self.options = options
        self._region_fd = region_fd  # owned by the caller; sent (dup'ed by the kernel) on every new session
        self._region_name = region_name
        self._keep_pool_fd = keep_pool_fd
        self._pins_pool = pins_pool
        self.state = LinkState.DOWN
        self.epoch = 0  # sessions opened so far; state tied to a session records its epoch
        self.session_id = ""
        self.region_id = 0
        self.region_size = 0
        self.pool_bytes = 0
        self.page_bytes = 0
        self.pool_fd: int | None = None  # the daemon's pool (only with keep_pool_fd); owned by the link
        self.pool_id = ""  # identity of the daemon's pool (its memfd's inode): changes when the daemon restarts
        self.arena_fds: dict[int, tuple[int, int]] = {}  # tenant arena -> (memfd, size); only with keep_pool_fd
        self._arenas_wanted: list[int] = []
        self._arena_asked: int | None = None  # OpenArena sent, reply not read yet
        self.indexes: dict[str, KeyIndexView | None] = {}  # namespace -> its key index (None: refused)
        self._indexes_wanted: list[str] = []
        self._index_asked: str | None = None  # OpenIndex sent, reply not read yet
        self._serves_index = False  # this session's daemon hands out key indexes
        self.counters = LinkCounters()
        # Called with (method, seconds from issue to answer) for each answered call (benches
        # time calls with it); None: nothing is timed.
        self.observe: Callable[[str, float], None] | None = None
        self.health = LinkHealth(self.socket_path)
        self._sock: socket.socket | None = None
        self._handshake: Handshake | None = None
        self._step_deadline = 0.0
        self._backoff = Backoff(options.backoff_min_s, options.backoff_max_s)
        self._fork = ForkGuard()
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.KVStoreStub | None = None
        self._namespaces: dict[str, _NamespaceState] = {}
        self._serves_fast: Callable[[str], bool] = _nothing_fast  # what this session's daemon serves there
        self._pending: dict[int, FastCall] = {}  # fast calls sent, by call id
        self._call_ids = itertools.count(1)
        self._control: deque[tuple[bytes, list[int]]] = deque()  # session replies without a call id
        self._closing: list[_Closing] = []  # ended sessions the daemon may still be copying for

    # -- connection -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state is LinkState.READY

    def poll(self) -> bool:
        """Advance the connection without blocking; True when the session is ready."""
        self._check_fork()
        self._read_closing()
        now = time.monotonic()
        try:
            if self.state is LinkState.READY:
                self.collect()
                if self._control and self._arena_asked is None and self._index_asked is None:
                    raise Unavailable("kvstored sent an unexpected session message")
                if self.state is not LinkState.READY:
                    return self._start_if_due(time.monotonic())
                if self._control_wanted:
                    self._open_arenas(now)
                    if self.state is not LinkState.READY:
                        return self._start_if_due(time.monotonic())
                if self._sock is None or session.peer_closed(self._sock):
                    self.fail(Unavailable("kvstored closed the session (stopped or restarted)"), backoff=False)
                    return self._start_if_due(time.monotonic())
                return True
            if self.state is LinkState.DOWN:
                return self._start_if_due(now)
            if now > self._step_deadline:
                raise Unavailable(
                    f"kvstored did not answer the session handshake within "
                    f"{self.options.connect_timeout_s}s ({self.state.value})"
                )
            self._advance()
        except KvstoredError as exc:
            self.fail(exc)
        return self.ready

    def settle(self, timeout: float, namespace_ids: tuple[str, ...] = ()) -> bool:
        """Bring the session (and namespaces) up, waiting at most `timeout`: for start-up code,
        never for code on the scheduler's step. Returns at once when the daemon is unreachable."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.poll() and all([self.namespace_ready(ns) for ns in namespace_ids]):
                return True
            if self.state is LinkState.DOWN:
                return False
            time.sleep(0.001)
        return False

    def reconnect_soon(self) -> None:
        """Skip the rest of the backoff: the caller knows the daemon is back (e.g. another
        process of this engine got leases from it)."""
        if self.state is LinkState.DOWN:
            self._backoff.skip()

    def fail(self, exc: BaseException, backoff: bool = True) -> None:
        """Drop the session; the next poll after the backoff starts a new one. Why is logged once
        per change of condition (protocol.LinkHealth), the return once."""
        self.counters.failures += 1
        self.counters.last_error = str(exc)
        self._close_session()
        self.health.unreachable(session.diagnose(self.socket_path) or _listening_but(self.socket_path, exc))
        self._backoff.failed(time.monotonic(), wait=backoff)

    def on_rpc_error(self, result: Outcome) -> None:
        """React to a failed RPC: connection problems drop the session, restarts reconnect at once."""
        code = result.code.name if result.code is not None else "UNKNOWN"
        self.counters.errors_by_code[code] = self.counters.errors_by_code.get(code, 0) + 1
        if result.stale:
            return
        if isinstance(result.error, SESSION_LOST):
            self.fail(result.error, backoff=False)
        elif isinstance(result.error, UnknownNamespace):
            for ns in self._namespaces.values():
                ns.epoch = -1  # the daemon forgot them: register again
        elif result.code is grpc.StatusCode.UNAVAILABLE and not self._session_alive():
            # (With the session socket up, the session is: this call failed alone, e.g. gRPC
            # stopping before the session socket in a graceful stop, which then ends the session.)
            self.fail(result.error or Unavailable("UNAVAILABLE"))

    def _session_alive(self) -> bool:
        """Whether this session's socket is open at both ends (a handshake under way included)."""
        return self._sock is not None and self.state is not LinkState.DOWN and not session.peer_closed(self._sock)

    @property
    def closing(self) -> int:
        """Region copies of ended sessions the daemon may still be running (see _Closing)."""
        return sum(len(c.pending) for c in self._closing)

    def close(self) -> None:
        if self._fork.forked():
            self._channel = self._stub = None  # the parent's: not ours to close
        self._close_session(linger=False)
        for closing in self._closing:
            self._end_closing(closing, "the link was closed")
        self._closing = []
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None
        self.state = LinkState.DOWN

    # -- RPCs -------------------------------------------------------------------------------

    def call(self, method: str, request: Any, timeout: float | None = None) -> Call:
        """Start an RPC (over the fast path where it can go); collect it with `outcome(future)`
        once `future.done()`."""
        if self.fast_path and self._serves_fast(method) and self.ready and self._sock is not None:
            call_id = next(self._call_ids)
            data = fast.packet(method, request, call_id)
            if data is not None:  # (else: too large for a packet, over gRPC)
                try:
                    self._sock.send(data)
                except BlockingIOError:
                    pass  # the socket's buffer is full: this one goes over gRPC
                except OSError as exc:
                    self.fail(Unavailable(f"the session socket failed: {exc}"), backoff=False)
                else:
                    call = FastCall(self, method, request, timeout)
                    self._pending[call_id] = call
                    self.counters.fast_calls += 1
                    return call
        return self._grpc_call(method, request, timeout)

    def _grpc_call(self, method: str, request: Any, timeout: float | None) -> GrpcCall:
        self.counters.grpc_calls += 1
        started = time.perf_counter()
        future = getattr(self._get_stub(), method).future(request, timeout=timeout)
        observe = self.observe
        if observe is not None:  # (the callback runs on gRPC's thread, or here when already done)
            future.add_done_callback(lambda _f: observe(method, time.perf_counter() - started))
        return GrpcCall(self, future, self.epoch)

    def collect(self) -> None:
        """Read the fast path's answers that have come (never blocking) and end the calls whose
        deadline passed. A late answer is recognised by its call id and dropped, so a Lookup past
        its deadline ends alone (it grants nothing); any other call ends the session, since what
        its late answer grants (slots, leases) would be held by nobody."""
        self._read_closing()
        self._read()
        if not self._pending:
            return
        now = time.monotonic()
        late = [c for c in self._pending.values() if c.deadline is not None and now > c.deadline]
        for call in late:
            self.forget(call)
            call.answer = Outcome(
                error=DeadlineExceeded(f"{call.method}: no answer on the session socket within {call.timeout:.3f} s"),
                code=grpc.StatusCode.DEADLINE_EXCEEDED,
                stale=True,
            )
        granting = [c.method for c in late if c.method not in ("Lookup", "Touch")]
        if granting:
            self.fail(DeadlineExceeded(f"{granting[0]}: no answer on the session socket in time"), backoff=False)

    def forget(self, call: FastCall) -> None:
        """Stop waiting for a call's answer (cancelled); an answer still coming is dropped."""
        for calls in [self._pending] + [c.pending for c in self._closing]:
            for call_id, pending in list(calls.items()):
                if pending is call:
                    del calls[call_id]

    def wait_readable(self, timeout: float) -> None:
        """Block until the session socket has something to read, at most `timeout` (drain and
        shutdown code only)."""
        socks = [c.sock for c in self._closing] + ([self._sock] if self._sock is not None else [])
        if not socks:
            time.sleep(timeout)
            return
        select.select(socks, [], [], max(timeout, 0.0))

    def _read(self) -> None:
        """Every packet waiting on the session socket: fast-path answers end their calls, the rest
        (OpenArena's answers) wait in `_control`."""
        sock = self._sock
        if sock is None or self.state is not LinkState.READY:
            return
        while True:
            try:  # a one-byte peek first: most polls find nothing, and a receive needs a 1 MiB buffer
                if not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    self.fail(Unavailable("kvstored closed the session (stopped or restarted)"), backoff=False)
                    return
                data, fds, flags, _addr = socket.recv_fds(sock, FAST_REPLY_MAX + 1, MAX_FDS, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as exc:
                self.fail(Unavailable(f"kvstored closed the session (stopped or restarted): {exc}"), backoff=False)
                return
            if not data:
                for fd in fds:
                    os.close(fd)
                self.fail(Unavailable("kvstored closed the session (stopped or restarted)"), backoff=False)
                return
            try:
                if flags & socket.MSG_TRUNC:
                    raise Unavailable(f"a session answer exceeds {FAST_REPLY_MAX} bytes")
                reply = pb.SessionReply.FromString(data)
            except (DecodeError, Unavailable) as exc:
                for fd in fds:
                    os.close(fd)
                self.fail(Unavailable(f"undecodable answer on the session socket: {exc}"), backoff=False)
                return
            if not reply.call_id:
                self._control.append((data, fds))
                continue
            call = self._pending.pop(reply.call_id, None)
            if call is not None:  # (else cancelled meanwhile)
                self._answer(call, reply, stale=False)

    def _answer(self, call: FastCall, reply: pb.SessionReply, stale: bool) -> None:
        """End a fast call with its answer. `stale`: read on an ended session's socket (nothing
        for the link to act on, and no asking over gRPC in a session that is gone)."""
        if self.observe is not None and reply.error.kind != REPLY_TOO_LARGE:  # (else timed as gRPC's)
            self.observe(call.method, time.perf_counter() - call.started)
        try:
            response = fast.response_of(call.method, reply)
        except KvstoredError as exc:
            code = getattr(grpc.StatusCode, reply.error.code, grpc.StatusCode.UNKNOWN)
            code = code if reply.HasField("error") else grpc.StatusCode.UNAVAILABLE
            call.answer = Outcome(error=exc, code=code, stale=stale)
            return
        if response is None and stale:
            _end_call(call, "its answer did not fit a packet after its session ended")
        elif response is None:  # the answer did not fit a packet: ask over gRPC
            left = None if call.deadline is None else max(call.deadline - time.monotonic(), 0.0)
            call.fallback = self._grpc_call(call.method, call.request, left)
        else:
            call.answer = Outcome(response=response, stale=stale)

    def _end_pending(self, linger: bool) -> None:
        """The session ended: its fast calls end as gRPC's do when the daemon goes away, but for
        its region copies when `linger`: those end once the daemon is done with them (_Closing)."""
        sock, self._sock = self._sock, None
        pending, self._pending = self._pending, {}
        copies = {i: c for i, c in pending.items() if linger and c.method in REGION_COPIES}
        for call_id, call in pending.items():
            if call_id not in copies:
                _end_call(call, "the session ended before the answer (kvstored restarted or stopped)")
        if sock is None:
            for call in copies.values():
                _end_call(call, "the session ended before the answer (kvstored restarted or stopped)")
            return
        if copies:
            try:
                sock.shutdown(socket.SHUT_WR)  # the daemon reads the end of the session, and answers on
            except OSError:
                pass  # (already broken: the read below sees it)
            now = time.monotonic()
            ends = [now] + [c.deadline for c in copies.values() if c.deadline is not None]
            closing = _Closing(sock, copies, max(ends) + REGION_COPY_GRACE_S, self.epoch)
            log.debug(
                "kvstored session %d ended with %d region copies unanswered: awaiting them", self.epoch, len(copies)
            )
            self._closing.append(closing)
            self._read_closing()
        else:
            sock.close()

    def _read_closing(self) -> None:
        """Read the ended sessions' sockets (never blocking): answers end their copies; the
        daemon's end of the session, or the bound, ends the rest and the socket."""
        if not self._closing:
            return
        still = []
        for closing in self._closing:
            ended = self._read_ended(closing)
            if ended is None and time.monotonic() > closing.until:
                ended = f"no answer within {REGION_COPY_GRACE_S:.0f} s after the session ended (outcome unknown)"
                log.warning("kvstored session %d: %d region copies %s", closing.epoch, len(closing.pending), ended)
            if ended is None and not closing.pending:
                ended = ""  # every copy answered: nothing more to read
            if ended is None:
                still.append(closing)
            else:
                self._end_closing(closing, ended)
        self._closing = still

    def _read_ended(self, closing: _Closing) -> str | None:
        """Every packet waiting on an ended session's socket; why its copies end (the daemon
        closed the session), or None while it is open."""
        while True:
            try:
                data, fds, flags, _addr = socket.recv_fds(
                    closing.sock, FAST_REPLY_MAX + 1, MAX_FDS, socket.MSG_DONTWAIT
                )
            except BlockingIOError:
                return None
            except OSError as exc:
                return f"the session ended before the answer ({exc})"
            for fd in fds:
                os.close(fd)  # (OpenArena's, OpenIndex's: of no use in an ended session)
            if not data:
                return "the session ended before the answer (kvstored closed it once its copies ended)"
            if flags & socket.MSG_TRUNC:
                continue
            try:
                reply = pb.SessionReply.FromString(data)
            except DecodeError:
                continue
            call = closing.pending.pop(reply.call_id, None) if reply.call_id else None
            if call is not None:
                self._answer(call, reply, stale=True)

    @staticmethod
    def _end_closing(closing: _Closing, why: str) -> None:
        for call in closing.pending.values():
            _end_call(call, why)
        closing.pending = {}
        closing.sock.close()

    def namespace(self, spec: NamespaceSpec) -> str:
        """The namespace id (computed locally, like every daemon does); starts tracking it."""
        ns_id = spec.namespace_id()
        if ns_id not in self._namespaces:
            self._namespaces[ns_id] = _NamespaceState(spec, ns_id)
        return ns_id

    def namespace_ready(self, namespace_id: str) -> bool:
        """True once the namespace is registered in the current session; starts the registration
        (non-blocking) when it is not. Call poll() first."""
        ns = self._namespaces[namespace_id]
        if ns.broken or not self.ready:
            return False
        if ns.epoch == self.epoch:
            return self._arena_open(ns.arena_id)
        if ns.future is not None and ns.future.done():
            result, issued_in = outcome(ns.future), ns.future_epoch
            ns.future = None
            if result.ok and issued_in == self.epoch:
                ns.epoch = self.epoch
                ns.arena_id = result.response.arena_id
                return self._arena_open(ns.arena_id)
            if isinstance(result.error, InvalidArgument):
                ns.broken = str(result.error)
                log.error("kvstored refused namespace %s: %s", namespace_id, result.error)
                return False
            if not result.ok:
                self.on_rpc_error(result)
        if ns.future is None and self.ready:
            request = pb.RegisterNamespaceRequest(spec=ns.spec.to_proto(), session_id=self.session_id)
            ns.future = self.call("RegisterNamespace", request, timeout=self.options.rpc_timeout_s)
            ns.future_epoch = self.epoch
        return False

    def namespace_broken(self, namespace_id: str) -> str:
        return self._namespaces[namespace_id].broken

    def arena_of(self, namespace_id: str) -> int:
        """The arena of a namespace registered in this session (0 until it is)."""
        return self._namespaces[namespace_id].arena_id

    # -- tenant arenas ----------------------------------------------------------------------

    def _arena_open(self, arena_id: int) -> bool:
        """Whether this link has what it needs of the arena: nothing unless it maps the pool."""
        if arena_id == 0 or not self._keep_pool_fd or arena_id in self.arena_fds:
            return True
        if arena_id not in self._arenas_wanted and arena_id != self._arena_asked:
            self._arenas_wanted.append(arena_id)
            self._open_arenas(time.monotonic())
        return arena_id in self.arena_fds

    def key_index(self, namespace_id: str) -> KeyIndexView | None:
        """The namespace's key index, once mapped; until then (and where the daemon hands out
        none) None, and its OpenIndex is sent, without blocking. Call namespace_ready() first:
        a namespace is asked for once registered in the session."""
        if namespace_id in self.indexes:
            return self.indexes[namespace_id]
        if not (self.serves_index and self.ready):
            return None
        if namespace_id not in self._indexes_wanted and namespace_id != self._index_asked:
            self._indexes_wanted.append(namespace_id)
            self._open_arenas(time.monotonic())
        return self.indexes.get(namespace_id)

    @property
    def serves_index(self) -> bool:
        """Whether this session can map key indexes (the daemon hands them out, the fast path is on)."""
        return self._serves_index and self.fast_path and keyindex.available

    @property
    def _control_wanted(self) -> bool:
        return bool(self._arena_asked is not None or self._arenas_wanted or self._index_asked or self._indexes_wanted)

    def _open_arenas(self, now: float) -> None:
        """One OpenArena or OpenIndex at a time on the session socket, without blocking."""
        sock, handshake = self._sock, self._handshake
        try:
            if sock is None or handshake is None:
                raise Unavailable("no session socket")
            if self._arena_asked is not None or self._index_asked is not None:
                what = "OpenArena" if self._arena_asked is not None else "OpenIndex"
                if now > self._step_deadline:
                    raise Unavailable(f"kvstored did not answer {what} within {self.options.connect_timeout_s}s")
                self._read()
                if not self._control:
                    return
                if self._arena_asked is not None:
                    opened = handshake.arena_from(*self._control.popleft())
                    self.arena_fds[opened.arena_id] = (opened.fd, opened.size)
                    self._arena_asked = None
                else:
                    self._index_opened(handshake)
            if self._arenas_wanted:
                self._arena_asked = self._arenas_wanted.pop(0)
                session.send(sock, handshake.open_arena(self._arena_asked))
                self._step_deadline = now + self.options.connect_timeout_s
            elif self._indexes_wanted:
                self._index_asked = self._indexes_wanted.pop(0)
                session.send(sock, handshake.open_index(self._index_asked))
                self._step_deadline = now + self.options.connect_timeout_s
        except KvstoredError as exc:
            self.fail(exc)

    def _index_opened(self, handshake: Handshake) -> None:
        namespace_id, self._index_asked = self._index_asked or "", None
        try:
            opened = handshake.index_from(*self._control.popleft())
        except Unavailable:
            raise
        except KvstoredError as exc:  # refused (not a namespace this session may see): lookups ask
            log.debug("kvstored refused the key index of %s: %s", namespace_id, exc)
            self.indexes[namespace_id] = None
            return
        self.indexes[namespace_id] = open_view(namespace_id, opened.fd, opened.size, opened.key_bytes)

    # -- internals --------------------------------------------------------------------------

    def _check_fork(self) -> None:
        if self._fork.forked():  # a forked child must not touch its parent's channel or session
            self._channel = self._stub = None
            self._sock = None
            self._handshake = None
            self.pool_fd = None
            self.arena_fds = {}  # the parent's fds: not ours to close
            self._arenas_wanted, self._arena_asked = [], None
            self.indexes = {}  # (the parent's mappings stay, unused)
            self._indexes_wanted, self._index_asked = [], None
            self._pending = {}  # the parent's calls
            self._closing = []  # (the parent's sockets: not ours to close)
            self._control.clear()
            self.state = LinkState.DOWN
            self._backoff.skip()

    def _get_stub(self) -> pb_grpc.KVStoreStub:
        self._check_fork()
        if self._stub is None:
            self._channel = grpc.insecure_channel(channel_target(self.socket_path), options=CHANNEL_OPTIONS)
            self._stub = pb_grpc.KVStoreStub(self._channel)
        return self._stub

    def _start_if_due(self, now: float) -> bool:
        if not self._backoff.due(now):
            return False
        handshake = Handshake(self.client_name, self._pins_pool)
        try:
            sock = session.connect(session_socket_path(self.socket_path), timeout=None)
        except Unavailable as exc:
            self.fail(exc)
            return False
        try:
            session.send(sock, handshake.hello())
        except Unavailable as exc:
            sock.close()
            self.fail(exc)
            return False
        self._sock, self._handshake = sock, handshake
        self.state = LinkState.HELLO
        self._step_deadline = now + self.options.connect_timeout_s
        self._get_stub()  # channel ready for the first RPCs
        self._advance()  # a local daemon usually answers at once
        return self.ready

    def _advance(self) -> None:
        sock, handshake = self._sock, self._handshake
        if sock is None or handshake is None:
            raise Unavailable("no session socket")
        if self.state is LinkState.HELLO:
            reply = session.receive(sock)
            if reply is None:
                return
            welcome = handshake.welcome_from(*reply)
            self.session_id = welcome.session_id
            self._serves_fast = welcome.serves_fast
            self._serves_index = welcome.key_index
            self.pool_bytes, self.page_bytes = welcome.pool_bytes, welcome.page_bytes
            pool = os.fstat(welcome.pool_fd)
            self.pool_id = f"{pool.st_dev}:{pool.st_ino}"  # the same memfd in every process: one daemon run
            if self._keep_pool_fd:
                self.pool_fd = welcome.pool_fd
            else:
                os.close(welcome.pool_fd)
            if self._region_fd is None:
                self._become_ready()
                return
            session.send(sock, handshake.attach_region(self._region_name, self._region_fd))
            self.state = LinkState.ATTACH
            self._step_deadline = time.monotonic() + self.options.connect_timeout_s
        if self.state is LinkState.ATTACH:
            reply = session.receive(sock)
            if reply is None:
                return
            attached = handshake.attached_from(*reply)
            self.region_id, self.region_size = attached.region_id, attached.size
            self._become_ready()

    def _become_ready(self) -> None:
        self.state = LinkState.READY
        self.epoch += 1
        self.counters.sessions_opened += 1
        self._backoff.succeeded()
        self.health.reachable()

    def _close_session(self, linger: bool = True) -> None:
        """End the session (see _end_pending for `linger`)."""
        self._handshake = None
        if self.pool_fd is not None:
            os.close(self.pool_fd)
            self.pool_fd = None
        for fd, _size in self.arena_fds.values():
            os.close(fd)
        self.arena_fds.clear()
        self._arenas_wanted, self._arena_asked = [], None
        for index in self.indexes.values():
            if index is not None:
                index.close()
        self.indexes.clear()
        self._indexes_wanted, self._index_asked = [], None
        self._serves_index = False
        for _data, fds in self._control:
            for fd in fds:
                os.close(fd)
        self._control.clear()
        self._end_pending(linger)
        self._serves_fast = _nothing_fast
        self.state = LinkState.DOWN
        self.session_id = ""
        self.region_id = 0


def _nothing_fast(method: str) -> bool:
    return False


def _end_call(call: FastCall, why: str) -> None:
    """End a fast call whose answer will not come: UNAVAILABLE, as gRPC's when the daemon goes away."""
    call.answer = Outcome(error=Unavailable(f"{call.method}: {why}"), code=grpc.StatusCode.UNAVAILABLE, stale=True)


def _listening_but(socket_path: Path, exc: BaseException) -> Condition:
    """The condition when both sockets accept connections and the session failed anyway."""
    if isinstance(exc, Unavailable):  # closed, not answering the handshake, UNAVAILABLE
        return Condition(
            Reason.RESTARTING,
            f"{socket_path} accepts connections but kvstored does not serve (starting, stopping or restarting)",
            str(exc),
        )
    return Condition(Reason.REJECTED, f"kvstored at {socket_path} refused the session", str(exc))
