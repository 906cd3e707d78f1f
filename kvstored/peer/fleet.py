# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fetching side's connections to every peer: one supervising task per peer, the DNS refresh,
and the index sweeper. I/O only; who the peers are and how they are doing is membership.py.

A peer's supervisor loops: handshake (Hello over its control channel) -> pick the data transport
-> make (or keep) the data link -> follow its events (follow.py) until the stream ends or fails
-> mark it DOWN and try again after a backoff (0.1 s doubling to `reconnect_s`). A peer that is
down at start is simply retried: the daemon never waits for its peers. A new incarnation (the
peer restarted) retires its index slot (O(1)) and is read whole again; a peer that turns out to
be this daemon (same incarnation) is marked SELF and left alone; one whose chunk format or
namespace-id derivation differs is marked INCOMPATIBLE, logged once (again only if the reason
changes), and asked again every 12 x reconnect_s (it may be upgraded).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from kvstored.peer import ucx_runtime
from kvstored.peer.control import ClientTls, ControlChannel
from kvstored.peer.errors import PeerError, TransportUnavailable
from kvstored.peer.factory import choose_transport, local_transports, make_link
from kvstored.peer.follow import Follower, PeerRestarted
from kvstored.peer.handshake import LocalHello, hello_from_proto, incompatibility
from kvstored.peer.index import PeerIndex
from kvstored.peer.membership import Membership, PeerRecord, PeerState
from kvstored.peer.transport import PeerAddress, PeerLink, TransportConfig, TransportKind, TransportPreference

log = logging.getLogger(__name__)

FIRST_RETRY_S = 0.1
INCOMPATIBLE_RETRIES = 12  # a peer that cannot share chunks is asked again after 12 x reconnect_s (an upgrade)


class _Incompatible(Exception):
    pass


class _Itself(Exception):
    pass


@dataclass(frozen=True)
class FleetSettings:
    preference: TransportPreference
    transport: TransportConfig
    connect_timeout_s: float
    reconnect_s: float
    peers_dns: str = ""  # NAME:PORT
    dns_interval_s: float = 10.0
    coalesce_events: bool = True  # follow peers' net changes per interval, not every event


LinkFactory = Callable[[TransportKind, PeerAddress, TransportConfig], PeerLink]


class PeerFleet:
    def __init__(
        self,
        settings: FleetSettings,
        membership: Membership,
        index: PeerIndex,
        tls: ClientTls | None,
        make: LinkFactory = make_link,
    ) -> None:
        self.settings = settings
        self.membership = membership
        self.index = index
        self._tls = tls
        self._make_link = make
        self.local: LocalHello | None = None  # set by serve_as() before start()
        self.links: dict[PeerAddress, PeerLink] = {}
        self._channels: dict[PeerAddress, ControlChannel] = {}
        self._tasks: dict[PeerAddress, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self._sweep_wanted = asyncio.Event()
        self._ucx_held = False
        self._closed = False
        self.transports = (
            local_transports() if settings.preference is not TransportPreference.TCP else frozenset({TransportKind.TCP})
        )

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start UCX now if it may be used (importing ucxx blocks ~0.5 s: better here than in a
        transfer), then reach every peer in the background. Raises TransportUnavailable only
        when transport = "ucx" and UCX cannot start."""
        if self.local is None:
            raise RuntimeError("serve_as() first: peers are told who this daemon is")
        if TransportKind.UCX in self.transports:
            try:
                ucx_runtime.acquire(self.settings.transport.ucx.options(), self.settings.connect_timeout_s)
                self._ucx_held = True
            except TransportUnavailable as exc:
                if self.settings.preference is TransportPreference.UCX:
                    raise
                log.warning("peer tier: UCX unavailable, fetching over TCP: %s", exc)
                self.transports = frozenset({TransportKind.TCP})
        for record in self.membership.records():
            self._supervise(record)
        self._keep(self._sweeper(), "peer-index-sweep")
        if self.settings.peers_dns:
            self._keep(self._resolve_forever(), "peer-dns")

    async def close(self) -> None:
        """Stop following (supervisors end), close every data link, then the channels."""
        self._closed = True
        tasks = [*self._tasks.values(), *self._background]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        await self._close_links(list(self.links.values()))
        self.links.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        if self._ucx_held:
            self._ucx_held = False
            ucx_runtime.release()

    def _keep(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("peer tier: %s stopped: %r", task.get_name(), task.exception())

    def channel(self, record: PeerRecord) -> ControlChannel:
        channel = self._channels.get(record.address)
        if channel is None:
            channel = self._channels[record.address] = ControlChannel(
                record.address, self._tls, self.settings.reconnect_s
            )
        return channel

    # -- one peer ---------------------------------------------------------------------------

    def _supervise(self, record: PeerRecord) -> None:
        task = asyncio.get_running_loop().create_task(self._supervisor(record), name=f"peer-{record.address}")
        self._tasks[record.address] = task

        def done(t: asyncio.Task) -> None:
            if self._tasks.get(record.address) is t:
                del self._tasks[record.address]
            if not t.cancelled() and t.exception() is not None:
                log.error("peer %s: supervisor stopped: %r", record.address, t.exception())

        task.add_done_callback(done)

    async def _supervisor(self, record: PeerRecord) -> None:
        wait = FIRST_RETRY_S
        failures = 0  # in a row, of a holder found in the directory
        while not self._closed:
            was_up = False
            try:
                await self._session(record)
                self._set(record, PeerState.DOWN, "it ended the event stream (stopping)")
                wait = FIRST_RETRY_S
            except _Itself:
                self._set(record, PeerState.SELF, "this daemon itself")
                self._retire(record)
                return
            except _Incompatible as exc:
                self._set(record, PeerState.INCOMPATIBLE, str(exc), level=logging.ERROR)
                self._retire(record)
                await asyncio.sleep(INCOMPATIBLE_RETRIES * self.settings.reconnect_s)
                continue
            except (grpc.aio.AioRpcError, PeerError, PeerRestarted, OSError, TimeoutError) as exc:
                was_up = record.state is PeerState.UP
                self._set(record, PeerState.DOWN, _describe(exc))
            except Exception as exc:  # a bug: say so loudly (once per reason), and keep trying
                if record.detail != _describe(exc):
                    log.error("peer %s: unexpected error, retrying", record.address, exc_info=exc)
                was_up = record.state is PeerState.UP
                self._set(record, PeerState.DOWN, _describe(exc))
            if not record.follows:
                # A holder found in the directory that stays unreachable is let go (the directory
                # names it again if it comes back): a churning fleet leaves no retry loops behind.
                failures = 0 if was_up else failures + 1
                if failures >= INCOMPATIBLE_RETRIES:
                    await self._let_go(record)
                    return
            await asyncio.sleep(wait)
            wait = min(wait * 2, self.settings.reconnect_s)

    async def _session(self, record: PeerRecord) -> None:
        assert self.local is not None
        channel = self.channel(record)
        try:
            remote = await channel.hello(self.local.to_proto(), self.settings.connect_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                raise _Incompatible(f"it refused this daemon: {exc.details()}") from None
            raise
        if remote.incarnation == self.local.incarnation:
            raise _Itself()
        why = incompatibility(remote)
        if why:
            raise _Incompatible(why)
        hello = hello_from_proto(remote)
        if record.hello is not None and record.hello.incarnation != hello.incarnation:
            log.info("peer %s restarted (a new incarnation): its chunks are indexed anew", record.address)
            self._retire(record)
            record.breaker.reset()  # the failures were the old process's: the new one starts trusted
        try:
            kind = choose_transport(self.settings.preference, self.transports, hello.transports)
        except TransportUnavailable as exc:
            raise _Incompatible(str(exc)) from None
        port = hello.ucx_port if kind is TransportKind.UCX else hello.tcp_port
        record.hello = hello
        await self._ensure_link(record, kind, PeerAddress(record.address.host, port))
        record.transport = kind
        follower = Follower(
            channel, record, self.index, self.local.incarnation, self._sweep_wanted.set, self.settings.coalesce_events
        )
        if not record.follows:
            self._set(record, PeerState.UP, f"over {kind.value}, found in the directory")
            await self._keep_checking(record, channel)
            return
        if record.slot is None:
            await follower.resync()
        self._set(record, PeerState.UP, f"over {kind.value}, {self.index.count(record.slot or 0)} chunks indexed")
        await follower.run()

    async def _keep_checking(self, record: PeerRecord, channel: ControlChannel) -> None:
        """A holder found in the directory is not followed: a handshake every reconnect_s tells
        that it is still there (an error ends the session: DOWN, retried) and still the same."""
        assert self.local is not None
        while True:
            await asyncio.sleep(self.settings.reconnect_s)
            remote = await channel.hello(self.local.to_proto(), self.settings.connect_timeout_s)
            if record.hello is not None and remote.incarnation != record.hello.incarnation:
                raise PeerRestarted(f"{record.address} restarted")

    # -- holders found in the directory -------------------------------------------------------

    def add_found(self, address: PeerAddress) -> None:
        """Reach a holder the directory named (handshake and data link, in the background)."""
        if self._closed:
            return
        record = self.membership.add_found(address)
        if record is not None:
            log.info("peer %s found in the directory", address)
            self._supervise(record)

    async def _let_go(self, record: PeerRecord) -> None:
        """(From its own supervisor, which then ends.)"""
        if self.membership.drop_found(record.address) is None:
            return
        log.info("peer %s found in the directory is unreachable: let go until it is named again", record.address)
        self._retire(record)
        link = self.links.pop(record.address, None)
        if link is not None:
            await self._close_links([link])
        channel = self._channels.pop(record.address, None)
        if channel is not None:
            await channel.close()

    def drop_found_soon(self, address: PeerAddress) -> None:
        if not self._closed:
            self._keep(self.drop_found(address), f"peer-drop-{address}")

    async def drop_found(self, address: PeerAddress) -> None:
        record = self.membership.drop_found(address)
        if record is not None:
            await self._forget(record)

    async def _ensure_link(self, record: PeerRecord, kind: TransportKind, data: PeerAddress) -> None:
        link = self.links.get(record.address)
        if link is not None and link.kind is kind and link.address == data:
            return
        if link is not None:
            del self.links[record.address]
            await self._close_links([link])
        link = self._make_link(kind, data, self.settings.transport)
        await link.start()  # (UCX: the runtime is up already)
        self.links[record.address] = link

    def _retire(self, record: PeerRecord) -> None:
        if record.slot is not None:
            self.index.retire(record.slot)
            record.slot = None
            self._sweep_wanted.set()
        record.last_seq = 0

    def _set(self, record: PeerRecord, state: PeerState, detail: str, level: int = logging.INFO) -> None:
        """A new state is logged once (an incompatible peer again only if the reason changes)."""
        changed = record.state is not state or (state is PeerState.INCOMPATIBLE and record.detail != detail)
        record.state = state
        record.detail = "" if state is PeerState.UP else detail
        if changed:
            log.log(level, "peer %s is %s: %s", record.address, state.name.lower(), detail)

    async def _close_links(self, links: Sequence[PeerLink]) -> None:
        for link in links:
            try:
                await link.close()
            except Exception as exc:  # closing must not stop the others from closing
                log.warning("closing the data link to %s: %r", link.address, exc)

    # -- membership by DNS ------------------------------------------------------------------

    async def _resolve_forever(self) -> None:
        name, _, port = self.settings.peers_dns.rpartition(":")
        while True:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
                addresses = {PeerAddress(str(info[4][0]), int(port)) for info in infos}
            except OSError as exc:
                log.debug("peers_dns %s: %s", self.settings.peers_dns, exc)
                addresses = None  # a failed lookup keeps the peers we know
            if addresses is not None:
                added, gone = self.membership.update_dns(addresses)
                for record in gone:
                    await self._forget(record)
                for record in added:
                    log.info("peer %s found through %s", record.address, self.settings.peers_dns)
                    self._supervise(record)
            await asyncio.sleep(self.settings.dns_interval_s)

    async def _forget(self, record: PeerRecord) -> None:
        where = self.settings.peers_dns if record.follows else "the directory"
        log.info("peer %s left %s", record.address, where)
        task = self._tasks.pop(record.address, None)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        self._retire(record)
        link = self.links.pop(record.address, None)
        if link is not None:
            await self._close_links([link])
        channel = self._channels.pop(record.address, None)
        if channel is not None:
            await channel.close()

    # -- the index sweeper ------------------------------------------------------------------

    async def _sweeper(self) -> None:
        while True:
            await self._sweep_wanted.wait()
            self._sweep_wanted.clear()
            for _ in self.index.sweep():
                await asyncio.sleep(0)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
