# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Synchronous client. Every call has a deadline; when the daemon is down or slow, lookups report a
miss, stores and loads report nothing done, and nothing raises or hangs (a region transfer, once
sent, is waited for up to ops.REGION_COPY_GRACE_S longer: the daemon may be copying). It reconnects by itself:
a restarted daemon is noticed (unknown session/namespace) and the session, the namespaces and the
regions are set up again."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import grpc

from kvstored_client import keyindex, ops
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.blocks import BlockIdentity
from kvstored_client.copy_policy import client_copy_threads
from kvstored_client.droplog import DropLog
from kvstored_client.errors import (
    DeadlineExceeded,
    KvstoredError,
    TierUnavailable,
    TransferNotStarted,
    TransferOutcomeUnknown,
    Unavailable,
    UnknownNamespace,
    UnknownRegion,
    UnknownSession,
    from_rpc_error,
    may_have_run,
    never_sent,
)
from kvstored_client.fast import FastLink, fast_path_default
from kvstored_client.kinds import DropReason, LoadInto
from kvstored_client.ops import Health, LookupResult, Namespace, NamespaceSpec, Region, StoreResult
from kvstored_client.paths import default_socket_path
from kvstored_client.protocol import (
    CHANNEL_OPTIONS,
    HEALTH_CHECK,
    Condition,
    ForkGuard,
    LinkHealth,
    Reason,
    channel_target,
    decode_health_response,
    encode_health_request,
)
from kvstored_client.session import PoolSession, diagnose, open_region_fd, probe

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 2.0
RAISE = object()  # fallback marker: the error is the caller's to see

RESTART_ERRORS = (UnknownSession, UnknownRegion, UnknownNamespace)
OPEN_SESSION = object()  # plan effect: "give me a session" -> (session, newly opened)
MAX_RELEASED = 8  # closed sessions named in the next Hello (one a hand-over ended is among the last)
HANDLE_METHODS = frozenset({"Reserve", "Commit", "Acquire", "Release"})  # calls that grant or end handles
# Calls that reserve RAM, which may evict: the key index's hits are posted before them.
MAKES_ROOM = frozenset({"Reserve", "Commit", "StoreFromRegion"})
_INHERITED_AT_FORK: list[tuple[Any, ...]] = []  # see _check_fork
Plan = Generator[Any, Any, Any]


class ClientBase:
    """State shared by the sync and async clients: namespaces, regions, recovery decisions."""

    def __init__(
        self,
        socket: str | os.PathLike | None,
        deadline_s: float,
        client_name: str | None,
        populate: bool,
        copy_threads: int | None,
    ):
        self.socket = Path(socket) if socket else default_socket_path()
        self.deadline_s = deadline_s
        self.client_name = client_name or f"pid-{os.getpid()}"
        self.populate = populate
        self.copy_threads = copy_threads or client_copy_threads()
        self._namespaces: dict[str, NamespaceSpec] = {}
        self._regions: list[Region] = []
        self._session: PoolSession | None = None
        self._released: list[str] = []  # sessions it closed, for the next one's Hello (a hand-over holds their slots)
        self._fork = ForkGuard()
        self.link_health = LinkHealth(self.socket)  # why calls degrade: logged once per change
        self.drop_log = DropLog(f"kvstored at {self.socket}")  # stores dropped while it serves

    def _namespace_local(self, spec: NamespaceSpec) -> Namespace:
        ns_id = spec.namespace_id()
        self._namespaces[ns_id] = spec
        return Namespace(ns_id, spec)

    def _open_region(self, path_or_fd: str | os.PathLike | int, name: str | None) -> Region:
        fd = os.dup(path_or_fd) if isinstance(path_or_fd, int) else open_region_fd(path_or_fd)
        region = Region(name or str(path_or_fd), os.fstat(fd).st_size, fd)
        self._regions.append(region)
        return region

    def _public_specs(self) -> list[NamespaceSpec]:
        return [spec for spec in self._namespaces.values() if not spec.tenant_salt]

    def _private_specs(self) -> list[NamespaceSpec]:
        """Tenant namespaces: registered again in every new session."""
        return [spec for spec in self._namespaces.values() if spec.tenant_salt]

    def _worth_waiting(self, exc: grpc.RpcError) -> bool:
        """UNAVAILABLE while something listens on the socket: the daemon is (re)starting or the
        channel is in its reconnect backoff, so wait for it within the deadline. Nobody
        listening (no socket, or a stale one): fail fast, so callers degrade at once."""
        return exc.code() == grpc.StatusCode.UNAVAILABLE and probe(self.socket) is None

    def _unreachable(self) -> Condition:
        """Why the daemon did not serve the last call; logged once per change (LinkHealth)."""
        condition = diagnose(self.socket) or Condition(
            Reason.RESTARTING,
            f"{self.socket} accepts connections but kvstored does not serve (starting, stopping or restarting)",
        )
        self.link_health.unreachable(condition)
        return condition

    def _health_of(self, status: str | None, error: grpc.RpcError | None) -> Health:
        """health()'s answer from the check's status, or from why it failed."""
        if status == "SERVING":
            self.link_health.reachable()
            return Health(str(self.socket), status)
        if status is not None:
            return Health(str(self.socket), status, "kvstored is shutting down" if status == "NOT_SERVING" else "")
        if error is not None and error.code() != grpc.StatusCode.UNAVAILABLE:
            return Health(str(self.socket), "UNREACHABLE", f"{error.code().name}: {error.details()}")
        return Health(str(self.socket), "UNREACHABLE", str(self._unreachable()))

    def _unattached(self) -> bool:
        return any(r.region_id == 0 and r.refused is None for r in self._regions)

    def _attach_regions(self, session: PoolSession) -> None:
        """Attach the regions this session does not know yet (all of them after a reconnect). One
        the daemon refuses now (its file shrank to nothing...) fails the calls that use it, not
        every call of this client."""
        for region in self._regions:
            if region.region_id == 0 and region.refused is None:
                try:
                    region.region_id, region.size = session.attach_region(region.fd, region.name)
                except Unavailable:
                    raise
                except KvstoredError as exc:
                    log.warning("kvstored refused region %s on reconnect: %s", region.name, exc)
                    region.refused = exc

    def _failed(self, plan: Plan, effect: Any, exc: BaseException) -> Any:
        """Where an effect's failure goes, for both drivers: RPC and domain errors, and a failed
        copy (the plan gives its slots back), are thrown into the plan, whose next effect is
        returned; anything else (an interrupt, a cancellation) abandons the plan and is raised."""
        if isinstance(exc, grpc.RpcError):
            return plan.throw(self._rpc_failed(effect, exc))
        if isinstance(exc, KvstoredError) or (isinstance(exc, Exception) and isinstance(effect, ops.Copy)):
            return plan.throw(exc)
        self._abandon(plan, effect)
        raise exc

    def _set_up_failed(self, exc: Unavailable, deadline: float) -> KvstoredError:
        """A set-up exchange on the session socket (mapping an arena or a key index) that failed:
        its answer may still come, so the session goes (a new one next call, which frees what
        this one held); the call's time running out is its deadline, not the daemon gone."""
        self._drop_session()
        if time.monotonic() >= deadline:
            return DeadlineExceeded(f"deadline exceeded while mapping ({exc})")
        return exc

    def _rpc_failed(self, effect: Any, exc: grpc.RpcError) -> KvstoredError:
        """The error a failed call raises into its plan. A handle call that timed out may have
        been granted: the session goes, which frees whatever it was. A region transfer that was
        sent and got no answer may have copied (part of) its batch: say so rather than degrade
        (0 / dropped means nothing was copied)."""
        error = from_rpc_error(exc)
        if effect.copy_grace_s and may_have_run(exc):
            if not isinstance(error, DeadlineExceeded):
                self._drop_session()  # the daemon is gone or the connection broke: a new session next time
            return _outcome_unknown(effect, error, exc.details())
        if isinstance(error, DeadlineExceeded) and effect.method in HANDLE_METHODS:
            self._drop_session()
        return error

    def _fast_failed(self, effect: ops.Call, exc: KvstoredError, link: FastLink) -> KvstoredError:
        """A fast call's failure as its gRPC call's would be: a region transfer sent and never
        answered has an unknown outcome (the broken link ends the session either way)."""
        if effect.copy_grace_s and link.broken and link.sent:
            return _outcome_unknown(effect, exc, str(exc))
        return exc

    def _retry_when_ready(self, effect: Any, exc: grpc.RpcError) -> bool:
        """Whether to send the call again, waiting for the daemon: only if it may be coming up
        and, for a region transfer, only if the first try was never sent (a sent one may have
        copied, and its retry would report the second try's count)."""
        if effect.copy_grace_s and not never_sent(exc):
            return False
        return self._worth_waiting(exc)

    def _drop_session(self) -> None:
        if self._session is not None:
            if self._session.close():  # (after its copies: it is never written again, so say so)
                self._released = [*self._released[-(MAX_RELEASED - 1) :], self._session.session_id]
            self._session = None
        for region in self._regions:
            region.region_id = 0

    def _check_fork(self) -> None:
        """A forked child must not use its parent's channel, session or lock (another thread may
        have held it at fork time): it starts afresh. Call before taking the lock."""
        if not self._fork.forked():
            return
        # The parent's channel and session are kept alive, never freed: gRPC skips its fork
        # handlers when another thread was inside it, and freeing its objects here then crashes.
        _INHERITED_AT_FORK.append((self._session, getattr(self, "_channel", None), getattr(self, "_stub", None)))
        self._session = None  # the parent's: not ours to close
        for region in self._regions:
            region.region_id = 0
        self._new_transport()

    def _new_transport(self) -> None:
        """Forget the channel and lock (a forked child's parent's) without closing them."""
        raise NotImplementedError

    def _forget_region(self, region: Region) -> None:
        self._regions.remove(region)
        os.close(region.fd)

    def _abandon(self, plan: Plan, effect: Any) -> None:
        """Interrupted mid-call (task cancelled, KeyboardInterrupt): the daemon may have granted
        reservations or leases we will never hear of. Closing the session is what frees them."""
        plan.close()
        local = isinstance(effect, (ops.Copy, ops.MapArena, ops.MapIndex, ops.Settle))
        if effect is OPEN_SESSION or local or effect.method in HANDLE_METHODS:
            self._drop_session()

    def _close_regions(self) -> None:
        for region in self._regions:
            os.close(region.fd)
        self._regions.clear()

    def _plan(self, build: Callable[[PoolSession | None], ops.Op], fallback: Any, session: bool) -> Plan:
        """One call with its failure policy, written once for both clients: the drivers run the
        RPCs (`Call`) and open sessions (`OPEN_SESSION`) it yields.

        Daemon down or slow -> `fallback` (a miss, a dropped store...) unless it is RAISE. A
        restarted daemon (it forgot our session, namespace or region) -> set everything up again
        and retry once."""
        restarted = False
        for attempt in (1, 2):
            try:
                if restarted:
                    self._drop_session()
                    for spec in self._public_specs():
                        yield from ops.register(spec)
                opened = None
                if session:
                    opened, fresh = yield OPEN_SESSION
                    if fresh:  # tenant namespaces live in the session that registered them
                        for spec in self._private_specs():
                            yield from ops.register(spec, opened)
                result = yield from build(opened)
                self.link_health.reachable()
                if isinstance(result, StoreResult):
                    self._log_drops(result, "the daemon committed fewer chunks than it had reserved for them")
                return result
            except Unavailable as exc:
                busy = isinstance(exc, (DeadlineExceeded, TransferNotStarted, TierUnavailable))
                if not busy:
                    self._drop_session()  # the daemon is gone (a slow answer leaves the session be)
                    self._unreachable()  # (logged: "... stores are dropped until it is back")
                if fallback is RAISE:
                    raise
                log.debug("kvstored unavailable, degrading: %s", exc)
                if busy and isinstance(fallback, StoreResult):
                    self._log_drops(fallback, self._busy(exc))
                return fallback
            except RESTART_ERRORS as exc:
                if attempt == 2:
                    raise
                log.info("kvstored restarted? (%s); setting the session up again", exc)
                restarted = True

    def _log_drops(self, result: StoreResult, why: str) -> None:
        """Chunks this client dropped itself (the daemon logs its own reasons): one rate-limited
        WARNING, as a store degrades without raising."""
        self.drop_log.record(DropReason.UNAVAILABLE.label, result.dropped_by_reason.get(DropReason.UNAVAILABLE, 0), why)

    def _busy(self, exc: Unavailable) -> str:
        if isinstance(exc, DeadlineExceeded):
            return (
                f"kvstored serves but did not answer within the {self.deadline_s:g} s deadline ({exc}): it is "
                "busy, or a tier below is slow (a larger deadline_s waits longer)"
            )
        return f"kvstored serves but could not carry the store out ({type(exc).__name__}: {exc})"

    def _session_step(self, timeout: float) -> tuple[PoolSession, bool]:
        """Blocking: the current session (opened if needed, regions attached) and whether it is new."""
        session, fresh = self._session, self._session is None
        if session is None:
            session = self._session = PoolSession.open(
                self.socket, self.client_name, timeout, self.populate, self.copy_threads, self._released
            )
            self._released = []
        if self._unattached():
            try:
                self._attach_regions(session)
            except BaseException:
                self._drop_session()
                raise
        return session, fresh


def in_session(session: PoolSession | None) -> PoolSession:
    """The session a call run with session=True is built with (the plan opens it first)."""
    if session is None:
        raise RuntimeError("a call that needs a session was built without one")
    return session


class Client(ClientBase):
    def __init__(
        self,
        socket: str | os.PathLike | None = None,
        *,
        deadline_s: float = DEFAULT_DEADLINE_S,
        client_name: str | None = None,
        populate: bool = True,
        copy_threads: int | None = None,
        fast_path: bool | None = None,
        store_ahead: bool = True,
        key_index: bool = True,
    ) -> None:
        """copy_threads: threads splitting a large store/load between your buffers and the pool
        (default: up to 4, one per core). fast_path: send lookups, stores' and loads' calls over
        the session socket rather than gRPC once a session is open (default: KVSTORED_FAST_PATH,
        on unless set to 0). store_ahead (with the fast path, where the daemon grants them):
        hold a few pool slots per namespace reserved ahead, so that a store copies at once and
        posts its Commit. key_index (with the fast path): answer lookups of keys the daemon's
        RAM holds from the namespace's key index, with no round trip; slots ahead need it (see
        docs/client.md)."""
        super().__init__(socket, deadline_s, client_name, populate, copy_threads)
        self.fast_path = fast_path_default() if fast_path is None else fast_path
        self.key_index = key_index and keyindex.available
        self.store_ahead = store_ahead and self.key_index
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.KVStoreStub | None = None
        self._lock = threading.Lock()  # one operation at a time per client

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._check_fork()
        with self._lock:  # not under a call's copy into the pool
            if self._session is not None:
                # the hits told and the posted Commits answered before the connection ends: once
                # close() returns, every store it reported is committed for any other connection
                # (a watcher, another process) to see
                with contextlib.suppress(KvstoredError):
                    self._settle(time.monotonic() + self.deadline_s)
            self._drop_session()
            self._close_regions()
            if self._channel is not None:
                self._channel.close()
                self._channel = self._stub = None

    # -- public API -------------------------------------------------------------------------

    def register_namespace(self, spec: NamespaceSpec | None = None, **fields: Any) -> Namespace:
        """Declare a namespace. Works while the daemon is down: the id is computed locally and
        the namespace is registered when the daemon is reachable."""
        spec = spec or NamespaceSpec(**fields)
        ns = self._namespace_local(spec)
        # A tenant namespace is registered inside the session (and again in every new one).
        result = self._run(lambda s: ops.register(spec, s), None, session=ns.private)
        return result or ns

    def lookup(self, ns: Namespace, keys: Sequence[bytes], load_into: LoadInto = LoadInto.POOL) -> LookupResult:
        """Where each key is. `load_into`: what the load that follows uses, load (POOL) or
        load_to_region (REGION); it decides how the daemon readies the hits below RAM. With a
        session open, a lookup whose keys RAM holds all is answered from the namespace's key
        index, without asking the daemon (see docs/client.md)."""
        self._check_fork()
        deadline = time.monotonic() + self.deadline_s  # (one deadline for the index and the daemon)
        with self._lock:
            local = self._local_lookup(ns, keys, deadline)
        if local is not None and time.monotonic() <= deadline:
            return local
        miss = LookupResult.miss(len(keys))
        return self._run(lambda s: ops.lookup(ns, keys, s, load_into), miss, session=ns.private, deadline=deadline)

    def store(
        self, ns: Namespace, keys: Sequence[bytes], data: Any, blocks: Sequence[BlockIdentity | None] | None = None
    ) -> StoreResult:
        """Copy chunks into the daemon's pool. `data`: one buffer of len(keys) chunks, or a list."""
        return self._run(
            lambda s: ops.store(in_session(s), ns, keys, data, blocks), StoreResult.all_dropped(len(keys)), session=True
        )

    def load(self, ns: Namespace, keys: Sequence[bytes], out: Any) -> int:
        """Copy the leading cached chunks into `out`; returns how many were loaded."""
        return self._run(lambda s: ops.load(in_session(s), ns, keys, out), fallback=0, session=True)

    def register_region(self, path_or_fd: str | os.PathLike | int, name: str | None = None) -> Region:
        """Register a shared-memory file (by path, or an open fd which is dup'ed)."""
        region = self._open_region(path_or_fd, name)
        try:
            self._run(lambda _s: ops.nothing(), fallback=None, session=True)  # attach now if reachable
            if region.refused is not None:
                raise region.refused
        except KvstoredError:  # refused (empty file...): forget it, or every later call fails too
            self._forget_region(region)
            raise
        return region

    def store_from_region(
        self,
        ns: Namespace,
        region: Region,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        blocks: Sequence[BlockIdentity | None] | None = None,
    ) -> StoreResult:
        return self._run(
            lambda s: ops.store_from_region(in_session(s), ns, region, keys, offsets, blocks),
            StoreResult.all_dropped(len(keys)),
            session=True,
        )

    def load_to_region(self, ns: Namespace, region: Region, keys: Sequence[bytes], offsets: Sequence[int]) -> int:
        """Copy the leading cached chunks into the region; returns how many. Returns 0 (nothing
        written) when the daemon is down or could not start within the deadline; raises
        TransferOutcomeUnknown if the request was sent and no answer came (see REGION_COPY_GRACE_S;
        the daemon died or the connection broke)."""
        return self._run(
            lambda s: ops.load_to_region(in_session(s), ns, region, keys, offsets), fallback=0, session=True
        )

    def delete(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return self._run(lambda s: ops.delete(ns, keys, s), fallback=RAISE, session=ns.private)

    def stats(self) -> pb.StatsResponse:
        return self._run(lambda _s: ops.stats(), fallback=RAISE)

    def health(self) -> Health:
        """Ask the daemon's standard gRPC health check (within the deadline); never raises. Not
        serving: `reason` says why (no socket, refused, permission denied naming the group...)."""
        self._check_fork()
        with self._lock:
            check = self._get_channel().unary_unary(
                HEALTH_CHECK, request_serializer=encode_health_request, response_deserializer=decode_health_response
            )
            try:
                return self._health_of(check(None, timeout=self.deadline_s), None)
            except grpc.RpcError as exc:
                return self._health_of(None, exc)

    # -- machinery --------------------------------------------------------------------------

    def _run(
        self,
        build: Callable[[PoolSession | None], ops.Op],
        fallback: Any,
        session: bool = False,
        deadline: float | None = None,
    ) -> Any:
        deadline = time.monotonic() + self.deadline_s if deadline is None else deadline
        self._check_fork()
        with self._lock:
            if self._session is not None and self._session.touches.due(time.monotonic()):
                self._flush_touches()
            return self._drive(self._plan(build, fallback, session), deadline)

    def _flush_touches(self) -> None:
        session = self._session
        if session is None or not session.touches:
            return
        try:
            self._send_touches(session)
        except KvstoredError as exc:  # the link broke: the call finds no session and opens one
            log.debug("posting touches: %s", exc)
            self._drop_session()

    def _new_transport(self) -> None:
        self._lock = threading.Lock()
        self._channel = self._stub = None

    def _get_channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(channel_target(self.socket), options=CHANNEL_OPTIONS)
        return self._channel

    def _get_stub(self) -> pb_grpc.KVStoreStub:
        if self._stub is None:
            self._stub = pb_grpc.KVStoreStub(self._get_channel())
        return self._stub

    def _drive(self, plan: Plan, deadline: float) -> Any:
        stub = self._get_stub()
        try:
            effect = next(plan)
            while True:
                result: Any = None
                try:
                    if effect is OPEN_SESSION:
                        result = self._session_step(_remaining(deadline))
                        self._ready_ahead(result[0])
                    elif isinstance(effect, (ops.MapArena, ops.MapIndex)):
                        try:
                            effect.run(_remaining(deadline))
                        except Unavailable as exc:
                            raise self._set_up_failed(exc, deadline) from None
                    elif isinstance(effect, ops.Copy):
                        effect.run()
                    elif isinstance(effect, ops.Settle):
                        self._settle(deadline)
                    else:
                        result = self._fast_call(effect, deadline)
                        if result is None:
                            result = self._call(getattr(stub, effect.method), effect, deadline)
                except BaseException as exc:
                    effect = self._failed(plan, effect, exc)
                else:
                    effect = plan.send(result)
        except StopIteration as stop:
            return stop.value
        except BaseException as exc:
            if not isinstance(exc, Exception):  # interrupted in the plan's own code: handles may be held
                self._drop_session()
            raise

    def _fast_call(self, effect: ops.Call, deadline: float) -> Any | None:
        """The call over the session's fast path; None: it goes over gRPC (no session yet, the
        fast path off, or a call it does not carry)."""
        session = self._session
        if not self.fast_path or session is None or session.fast is None or not session.fast.serves(effect.method):
            return None
        link = session.fast
        if effect.method in MAKES_ROOM and session.touches:
            self._flush_touches()  # (their recency first: the room this call makes may evict)
            if self._session is not session:  # the link broke (and the session went with it)
                raise Unavailable(f"{effect.method}: the session socket failed")
        request, timeout = _bounded(effect, deadline)
        try:
            if effect.postable and link.post(effect.method, request, timeout, effect.on_answer):
                return ops.POSTED
            return link.call(effect.method, request, timeout, to_the_end=bool(effect.copy_grace_s))
        except KvstoredError as exc:
            raise self._fast_failed(effect, exc, link) from None
        finally:
            if link.broken:  # an answer may still come: never use this session again
                self._drop_session()

    def _local_lookup(self, ns: Namespace, keys: Sequence[bytes], deadline: float) -> LookupResult | None:
        """The lookup answered from the key index when RAM holds every key (its hits then
        posted to the daemon as a Touch); None: ask the daemon. Needs an open session with the
        fast path (the index is mapped on the first lookup of the namespace)."""
        session = self._session
        link = session.fast if session is not None else None
        if not (self.fast_path and self.key_index) or session is None or link is None or not keys:
            return None
        if not link.serves("Touch"):
            return None
        try:
            link.drain()  # (the answers of earlier Touches, so they never pile up)
            if link.closed():  # a stopped daemon's index may say anything: its next daemon's answers
                self._drop_session()
                return None
            session.map_index(ns.namespace_id, max(deadline - time.monotonic(), 0.001))
            index = session.index(ns.namespace_id)
            if index is None or index.leading(keys) != len(keys):
                return None
            now = time.monotonic()
            session.touches.add(ns.namespace_id, keys, now)
            if session.touches.due(now):
                self._send_touches(session)
        except KvstoredError as exc:  # the session broke: the daemon answers (or the plan degrades)
            log.debug("local lookup: %s", exc)
            self._drop_session()
            return None
        finally:
            if link.broken:
                self._drop_session()
        self.link_health.reachable()
        return LookupResult(len(keys), [ops.Tier.RAM] * len(keys))

    def _send_touches(self, session: PoolSession) -> None:
        """Post the hits the key indexes answered, batched (Touch: recency and the daemon's
        lookup counters): once due (keyindex.TOUCH_KEYS, TOUCH_DELAY_S, checked at each call),
        before a call that reserves RAM (its room may evict: MAKES_ROOM), before a gRPC call and
        at close. (Not before every call: a load right after lookups would wait for the daemon
        to count them first.)"""
        link = session.fast
        if link is None:
            return
        for namespace_id, keys, lookups in session.touches.take():
            request = pb.TouchRequest(
                session_id=session.session_id, namespace_id=namespace_id, keys=keys, lookups=lookups
            )
            link.post("Touch", request, self.deadline_s)  # (False: too large for a packet; a hint, dropped)

    def _ready_ahead(self, session: PoolSession) -> None:
        """Slots reserved ahead are used only where Commits are posted (the fast path); those
        the posted Commits reserved join the session's when their answers are read (with the
        next call's, or by the store that runs short: ops.Settle)."""
        link = session.fast
        session.ahead.enabled = self.store_ahead and self.fast_path and link is not None and link.serves("Commit")

    def _settle(self, deadline: float) -> None:
        """Before a gRPC call: post the hits the key indexes answered, and read the answers of
        the posted fast calls, so that the daemon has done them before it sees this one (a
        Delete after a store must find it committed, Stats the lookups counted)."""
        self._flush_touches()
        session = self._session
        if session is None or session.fast is None or not session.fast.owed:
            return
        try:
            session.fast.settle(_remaining(deadline))
        finally:
            if session.fast.broken:
                self._drop_session()

    def _call(self, method: Any, effect: ops.Call, deadline: float) -> Any:
        self._settle(deadline)
        request, timeout = _bounded(effect, deadline)
        try:
            if effect.copy_grace_s:
                return _to_the_end(method, request, timeout, False)
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            if not self._retry_when_ready(effect, exc):
                raise
            request, timeout = _bounded(effect, deadline)
            if effect.copy_grace_s:
                return _to_the_end(method, request, timeout, True)
            return method(request, timeout=timeout, wait_for_ready=True)


def _to_the_end(method: Any, request: Any, timeout: float, wait_for_ready: bool) -> Any:
    """A region transfer: once sent, the daemon may be copying into the caller's region, so an
    interrupt (Ctrl-C) waits for the answer (bounded by the call's timeout) before it is raised."""
    future = method.future(request, timeout=timeout, wait_for_ready=wait_for_ready)
    interrupted: BaseException | None = None
    while True:
        try:
            result = future.result()
            break
        except grpc.RpcError:
            if interrupted is not None:
                raise interrupted from None
            raise
        except BaseException as exc:  # KeyboardInterrupt
            interrupted = exc
    if interrupted is not None:
        raise interrupted
    return result


def _outcome_unknown(effect: ops.Call, error: KvstoredError, detail: str) -> TransferOutcomeUnknown:
    """A region transfer that was sent and got no answer, over either transport."""
    region = effect.request.region_id
    if isinstance(error, DeadlineExceeded):
        return TransferOutcomeUnknown(
            f"{effect.method} got no answer {effect.copy_grace_s:.0f} s past its deadline: the daemon may "
            f"still be copying, so region {region}'s bytes are undefined for now"
        )
    return TransferOutcomeUnknown(
        f"{effect.method} was sent, but the daemon did not answer ({detail}): it may have copied "
        f"part of the batch, so region {region}'s bytes at the transfer's offsets are undefined"
    )


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("deadline exceeded")
    return left


def _bounded(effect: ops.Call, deadline: float) -> tuple[Any, float]:
    """The request and the gRPC timeout for one call. A region transfer tells the daemon to start
    within the deadline and is waited for a grace period longer (a started copy runs to the end)."""
    left = _remaining(deadline)
    if not effect.copy_grace_s:
        return effect.request, left
    effect.request.start_within_ms = max(1, int(left * 1000))
    return effect.request, left + effect.copy_grace_s
