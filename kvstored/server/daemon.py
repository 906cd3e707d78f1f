# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Daemon lifecycle: build the parts, serve, and shut down in a fixed order.

Data flow: gRPC service (service.py) and session socket -> session broker (broker.py: sessions,
handles, regions) -> tier chain (chain/) -> tiers (tiers/) -> chunks, shm, io; events (events/)
and metrics (observability/) beside them.

Shutdown order: health NOT_SERVING -> event streams end -> the peer tier stops following its
peers and closes its data links -> stop accepting sessions -> gRPC stop with a grace period
(in-flight calls finish, fetches by peers included) -> stop serving peers (data servers) -> end
sessions (leases, regions) -> region populates -> write-downs (flush) -> namespace records ->
tiers and copy threads -> page releases -> arenas and pool -> socket files.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import secrets
import signal
import socket
import stat
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstored import __version__
from kvstored.chain.chain import ChainPolicy, TierChain
from kvstored.chain.factory import build_lower_tiers
from kvstored.chain.stats import chain_snapshot
from kvstored.chunks.ids import TierKind
from kvstored.config import Config, ConfigError
from kvstored.errors import ListenError
from kvstored.events.bus import EventBus
from kvstored.events.feed import IntervalFeeds
from kvstored.events.identity import IdentityBook
from kvstored.logs import setup_logging
from kvstored.namespaces import NamespaceRegistry
from kvstored.observability.metrics import DaemonMetrics
from kvstored.peer.control import SERVER_OPTIONS as PEER_KEEPALIVE_OPTIONS
from kvstored.server import handover
from kvstored.server.broker import SessionBroker
from kvstored.server.errors import ErrorMappingInterceptor
from kvstored.server.fast_path import FastPath
from kvstored.server.held_writes import HeldWrites, leases_as_pages, pid_namespace, unique_pages
from kvstored.server.namespace_records import NamespaceRecords
from kvstored.server.peer_service import SERVICE_NAME as PEER_SERVICE_NAME
from kvstored.server.peer_service import PeerService
from kvstored.server.preflight import preflight
from kvstored.server.service import KVStoreService, add_to_server
from kvstored.server.session_socket import SessionSocketServer
from kvstored.server.systemd import fd_store_enabled, forget_fds, listened_fds, notify, store_fds
from kvstored.server.tenants import Tenancy, TenantPolicy, visible
from kvstored.server.watch import encode_interval
from kvstored.shm import keyindex, memory
from kvstored.shm.arenas import ArenaSet, PageReleaser
from kvstored.shm.copy import GUARDED as copy_guarded
from kvstored.shm.keyindex import KeyIndexes
from kvstored.shm.mapping import SharedPool
from kvstored.shm.memory import PoolMemoryError, PoolPages, PopulateProgress
from kvstored.sizes import format_size
from kvstored.tiers.config import TierConfig, TierContext
from kvstored.tiers.ram import AdoptionError, RamEntry, RamTier
from kvstored.tiers.registry import admission_changes
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # optional features import their libraries (pyzmq, ucxx) only when enabled
    from kvstored.events.zmq_publisher import ZmqEventPublisher
    from kvstored.observability.http import MetricsServer
    from kvstored.server.peer_serving import PeerServing
    from kvstored.tiers.peer import PeerTier

log = logging.getLogger(__name__)

T = TypeVar("T")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name


class SocketInUse(RuntimeError):
    pass


def claim_socket_path(path: Path) -> None:
    """Make room for our socket: remove a stale file from a killed daemon, refuse a live one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketInUse(f"{path} exists and is not a socket: refusing to replace it (check --socket)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale socket %s", path)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    except OSError as exc:
        raise SocketInUse(f"{path} exists and is not a usable socket: {exc.strerror}") from None
    finally:
        probe.close()
    raise SocketInUse(f"another kvstored is already serving on {path}")


def add_tcp_port(server: grpc.aio.Server, cfg: Config) -> int:
    """The optional TCP listener: TLS (mutual when a client CA is given), or plain on loopback."""
    if cfg.tls_cert_file and cfg.tls_key_file:
        ca = cfg.tls_client_ca_file.read_bytes() if cfg.tls_client_ca_file else None
        creds = grpc.ssl_server_credentials(
            [(cfg.tls_key_file.read_bytes(), cfg.tls_cert_file.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )
        add, mode = (lambda: server.add_secure_port(cfg.tcp_listen, creds)), "mutual TLS" if ca else "TLS"
    else:
        add, mode = (lambda: server.add_insecure_port(cfg.tcp_listen)), "plaintext, loopback only"
    try:
        port = add()
    except RuntimeError as exc:  # grpc's "Failed to bind to address ..."
        raise ListenError(f"cannot listen on {cfg.tcp_listen} (tcp_listen): {exc}") from None
    log.info("TCP listener on %s port %d (%s)", cfg.tcp_listen.rpartition(":")[0], port, mode)
    return port


class StoppedDuringStart(Exception):
    """SIGTERM/SIGINT arrived before the daemon was serving."""


class Daemon:
    def __init__(self, config: Config, reload_config: Callable[[], Config]) -> None:
        self.config = config
        self._reload_config = reload_config
        self._stopping = asyncio.Event()
        self.metrics_server: MetricsServer | None = None
        self.incarnation = secrets.randbits(63) | 1  # this run of the daemon, as its peers know it
        self.peer_tier: PeerTier | None = None
        self.peer_serving: PeerServing | None = None
        self.handover_listener: handover.HandoverListener | None = None
        self._handed: handover.HandedOver | None = None  # fds of the previous daemon's RAM tier
        self._state: handover.PoolState | None = None  # what they hold, checked
        self._handed_names: list[str] = []
        self._prehash: asyncio.Task | None = None  # checksums taken while serving, before a hand-over's stop

    async def start(self) -> None:
        cfg = self.config
        pool_bytes = memory.pool_size(cfg.cpu_bytes, cfg.pool_pages)
        if cfg.handover:
            await self._receive_handover(pool_bytes)
        else:
            self._release_stored_fds()
        claim_socket_path(cfg.socket)
        claim_socket_path(cfg.session_socket)
        # An adopted pool's memory is held already: checked against what is left, a 16 GiB pool on
        # this 24 GiB machine was refused and the hand-over lost it (a new pool is checked then).
        if self._state is None:
            self._check_memory(pool_bytes)
        log.info(
            "kvstored %s: RAM tier %s (%s pages, NUMA %s, populate=%s)",
            __version__,
            format_size(pool_bytes),
            cfg.pool_pages.value,
            cfg.numa_node or "unset",
            cfg.populate,
        )
        if pool_bytes != cfg.cpu_bytes:
            log.info(
                "RAM tier rounded down from %s to %s: a hugetlb pool is whole 2 MiB pages",
                format_size(cfg.cpu_bytes),
                format_size(pool_bytes),
            )
        if not copy_guarded:
            log.warning(
                "built without kvstored.shm._safecopy: a client truncating its region mid-copy "
                "can crash the daemon (install a C compiler and reinstall)"
            )
        self.namespaces = NamespaceRegistry(pool_bytes, cfg.max_namespaces)
        if self._state is not None:
            for ns, tiers in self._state.namespaces:
                self.namespaces.adopt(ns, tiers)
        lower = build_lower_tiers(cfg.tiers, TierContext(self.namespaces, cfg, self.incarnation))
        try:
            # Everything that can fail without the pool fails before the (long) populate.
            await self._unless_stopped(preflight(cfg, lower), "stop requested while checking the tiers")
            self.pool = self._adopt_pool(pool_bytes)
            # An adopted pool's pages exist: mapping them all first cost 2.1 s of an 8 GiB hand-over
            # here; they fault in as they are used (the verify sweep touches the chunks' pages).
            if cfg.populate and self._state is None:
                await self._populate_pool()
        except BaseException:
            for t in lower:
                await t.tier.close()
            self._drop_handover()
            raise
        self.arenas = ArenaSet(self.pool)
        writable = any(t.capabilities.accepts_writedowns for t in lower)  # RAM's chunks can go down
        ram = RamTier(pool_bytes, cfg.page_bytes, has_lower_tiers=writable, populated=cfg.populate)
        self.ram = ram  # (what a hand-over snapshots, after the chain has closed)
        self.releaser = PageReleaser(self.arenas, cfg.page_bytes, ram.released)
        ram.set_releaser(self.releaser.release)
        self.key_indexes = KeyIndexes() if keyindex.available() else None  # (None: built without the C helper)
        ram.set_listener(self.key_indexes)
        self.tenancy = Tenancy(ram, self.arenas, self.namespaces, TenantPolicy(cfg.tenant_quota_bytes, cfg.max_tenants))
        self.held_writes = HeldWrites(ram)
        if self._state is not None:
            await self._adopt_ram(ram, self._state)
        self.chain = TierChain(
            ram,
            self.arenas,
            lower,
            ChainPolicy(
                cfg.write_policy,
                cfg.headroom_bytes if writable else 0,
                cfg.writeback_wait_seconds,
                cfg.copy_threads,
                cfg.staging_bytes,
                cfg.recompute_gate,
                cfg.rate_probe_seconds,
            ),
            EventBus(cfg.events_buffer),
            self.namespaces.find,
        )
        self.records = NamespaceRecords([t.tier for t in lower], self.namespaces)
        try:
            await self._start_peer_serving()
            await self._start_tiers()
        except BaseException:
            await self._close_peers()  # (UCX's threads would keep the process from exiting)
            raise
        try:
            await self._start_serving(cfg, lower)
        except BaseException:
            await self._close_peers()
            raise

    async def _start_serving(self, cfg: Config, lower: list) -> None:
        self.chain.events.add_listener(self.records.on_event)
        self.records.start()
        self.broker = SessionBroker(self.chain, tenancy=self.tenancy, held=self.held_writes)
        self.zmq_events: ZmqEventPublisher | None = None
        self.identities: IdentityBook | None = None  # only kept for a ZMQ publisher
        if cfg.events_zmq_endpoint:
            from kvstored.events import zmq_publisher

            self.identities = IdentityBook()
            self.zmq_events = zmq_publisher.ZmqEventPublisher(
                zmq_publisher.ZmqSettings(
                    endpoint=cfg.events_zmq_endpoint,
                    replay_endpoint=cfg.events_zmq_replay_endpoint or None,
                    topic=cfg.events_zmq_topic,
                    node=cfg.events_node or socket.gethostname(),
                    data_parallel_rank=cfg.events_zmq_dp_rank,
                    encoding=cfg.events_encoding,
                    buffer_batches=cfg.events_buffer,
                    queue_batches=cfg.events_zmq_queue,
                    interval_s=cfg.events_interval,
                ),
                self.identities,
                self.namespaces.model_of,
                self._zmq_namespaces(cfg.events_zmq_tenants),
            )
            # (the namespaces the tiers' records brought back: their models' topics are cleared too)
            self.zmq_events.start((ns.namespace_id for ns in self.namespaces.all()), ram_empty=not self.ram.chunk_count)
            self.chain.events.add_listener(self.zmq_events)
            self._carry_identities(self.zmq_events, self.identities, lower)
        for t in lower:
            usage = t.tier.usage()
            log.info(
                "tier %s (%s): %s used of %s, %d chunks",
                t.tier.name,
                t.tier.kind.name.lower(),
                format_size(usage.used_bytes),
                format_size(usage.capacity_bytes) if usage.capacity_bytes else "unbounded",
                usage.chunks,
            )

        # Coalesced watch streams' intervals: one feed per audience, its timer started with the server.
        self.feeds = IntervalFeeds(self.chain.events, cfg.events_interval, encode_interval)
        self._feeds_timer: asyncio.Task | None = None
        self.metrics = DaemonMetrics(
            functools.partial(chain_snapshot, self.chain),
            self.broker.counts,
            self.namespaces,
            self.tenancy.snapshot,
            self._peers_snapshot,
        )
        for lower_tier in self.chain.lower:
            lower_tier.observe = self.metrics.observe_tier_op
        self.metrics.preinit_grpc(pb.DESCRIPTOR.services_by_name["KVStore"])
        self.metrics.preinit_grpc(pb.DESCRIPTOR.services_by_name["Peer"])
        self.server = grpc.aio.server(
            interceptors=[self.metrics.interceptor, ErrorMappingInterceptor()], options=PEER_KEEPALIVE_OPTIONS
        )
        service = KVStoreService(
            self.chain,
            self.broker,
            self.namespaces,
            cfg.max_batch_keys,
            cfg.region_dirs,
            self.tenancy,
            self._peer_counts,
            self.identities,
            self.feeds,
            self.key_indexes,
            self.incarnation,
        )
        add_to_server(service, self.server)
        pb_grpc.add_PeerServicer_to_server(
            PeerService(self.peer_serving, self.peer_tier, self.chain.events), self.server
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                PEER_SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        if cfg.tcp_listen:  # first: a port that cannot be bound leaves no socket file behind
            self.tcp_port = add_tcp_port(self.server, cfg)
        if cfg.metrics_addr:  # (also before the socket file: see above)
            await self._start_metrics(cfg.metrics_addr)
        self.server.add_insecure_port(f"unix:{cfg.socket}")
        await self.server.start()
        self._feeds_timer = asyncio.create_task(self.feeds.run(), name="event-feeds")
        os.chmod(cfg.socket, cfg.socket_mode)

        self.session_server = SessionSocketServer(
            cfg.session_socket,
            cfg.socket_mode,
            self.broker,
            self.pool,
            self.chain.page_bytes,
            self.tenancy,
            FastPath(service, self.broker, self.metrics.observe_session_call),
            service.open_index if self.key_indexes is not None else None,
        )
        await self.session_server.start()
        if cfg.handover:
            self.handover_listener = handover.HandoverListener(
                handover.handover_path(cfg.socket), self._handover_requested
            )
            await self.handover_listener.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving on %s (sessions on %s)", cfg.socket, cfg.session_socket)
        notify("READY=1\nSTATUS=serving")
        self.chain.verifier.start_sweep()  # adopted chunks' bytes (a read checks its own first meanwhile)

    def _carry_identities(self, publisher: ZmqEventPublisher, book: IdentityBook, lower: list) -> None:
        """Identities beyond the client's store: kept in fs chunk files and published again after
        a restart (what the disk holds, read back in the background), carried by peer fetches."""
        from kvstored.tiers.fs.tier import FsTier  # (an fs tier's module, only where identities are kept)

        for t in lower:
            if isinstance(t.tier, FsTier):
                t.tier.identity_of = book.record_of
                publisher.restore_from(t.tier.name, t.tier.kind, t.tier.identity_records())
        if self.peer_serving is not None:
            self.peer_serving.identities = book
        if self.peer_tier is not None:
            self.peer_tier.on_identity = book.offer

    async def _start_peer_serving(self) -> None:
        """With a peer tier: listen on the data ports and tell the tier how to introduce this
        daemon, before the tier starts reaching its peers."""
        found = next((t.tier for t in self.chain.lower if t.tier.kind is TierKind.PEER), None)
        if found is None:
            return
        from kvstored.server.peer_serving import PeerServing
        from kvstored.tiers.peer import PeerTier  # (imported only with a peer tier: see above)

        tier = cast(PeerTier, found)
        self.peer_tier = tier
        self.peer_serving = PeerServing(
            self.chain, self.namespaces, tier.config, self.config.tcp_listen, self.incarnation
        )
        tier.serve_as(await self.peer_serving.start())
        if tier.directory is not None:  # this daemon's holdings, told to the fleet directory
            tier.directory.holdings = self.peer_serving.holdings
            self.chain.events.add_listener(tier.directory.on_event)

    async def _close_peers(self) -> None:
        """Stop following the peers and close the data links, then stop serving them."""
        if self.peer_tier is not None:
            await self.peer_tier.close()
        if self.peer_serving is not None:
            await self.peer_serving.close()

    def _peer_counts(self) -> tuple[int, int]:
        """(chunks leased to peers, RAM slots peer fetches hold) for Stats."""
        if self.peer_serving is None or self.peer_tier is None:
            return 0, 0
        return self.peer_serving.leases, self.peer_tier.reservations

    def _peers_snapshot(self):
        if self.peer_serving is None or self.peer_tier is None:
            return None
        from kvstored.server.peer_status import peers_snapshot

        return peers_snapshot(self.peer_serving, self.peer_tier)

    async def _unless_stopped(self, work: Awaitable[T], why: str) -> T:
        """`work`, or StoppedDuringStart (`work` cancelled) if a stop is requested first."""
        job = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((job, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if not job.done():
                job.cancel()
                await asyncio.wait((job,))
        if job.cancelled():
            raise StoppedDuringStart(why)
        return job.result()

    async def _populate_pool(self) -> None:
        """Fill the pool's pages in a thread (10 GiB took 13 s here), saying how far it is (log and
        systemd status, extending the start timeout) and giving up at once on SIGTERM."""
        stop = threading.Event()
        threads = memory.populate_threads(self.config.numa_node)
        report = functools.partial(_report_populate, threads)
        job = asyncio.ensure_future(asyncio.to_thread(self.pool.populate, report, stop, threads))
        waiter = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((job, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if not job.done():  # stopping (or cancelled): the thread ends within one step
                stop.set()
                await asyncio.wait((job,))
        try:
            finished = job.result()
        except BaseException:
            self.pool.close()
            raise
        if not finished:
            self.pool.close()
            raise StoppedDuringStart("stop requested while populating the RAM tier")
        if self.pool.memory.pages is not PoolPages.SMALL:
            log.info(
                "RAM tier: %s of %s in 2 MiB pages",
                format_size(self.pool.huge_page_bytes()),
                format_size(self.pool.size),
            )

    def _zmq_namespaces(self, tenants: bool) -> Callable[[str], bool] | None:
        """The namespaces routers learn of: public ones; tenant ones too only if configured. One
        not known since the start may be a tenant's (as for events_for): not published, neither
        its events nor what a tier held of it before the start."""
        if tenants:
            return None

        def public(namespace_id: str) -> bool:
            ns = self.namespaces.find(namespace_id)
            return ns is not None and visible(ns, None)

        return public

    async def _start_tiers(self) -> None:
        """Start the tiers (an S3 listing or a large fs index can take a while), giving up at
        once if a stop is requested meanwhile: nothing serves yet, so nothing is lost."""
        starting = asyncio.ensure_future(self._start_chain())
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((starting, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not starting.done():
            starting.cancel()
            await self.chain.close()  # closing tiers also stops an index scan in progress
            await asyncio.wait((starting,))
            await self._close_peers()
            await self.releaser.close()
            self.arenas.close()
            self.pool.close()
            raise StoppedDuringStart("stop requested while the tiers were starting")
        starting.result()  # a TierStartError ends the start here

    async def _start_chain(self) -> None:
        await self.chain.start()
        await self.records.recover()  # the namespaces the tiers hold, known before any client returns

    async def _start_metrics(self, addr: str) -> None:
        """A taken metrics port ends the start, as a taken tcp_listen does (exit 1: systemd tries
        again, the port may be free then): a daemon nobody can see is worse than one that is
        not running. The preflight found it free; this is a port taken since."""
        from kvstored.observability import http

        server = http.MetricsServer(self.metrics.registry, addr)
        try:
            await server.start()
        except OSError as exc:
            raise ListenError(f"cannot listen on {addr} (metrics_addr): {exc.strerror or exc}") from None
        self.metrics_server = server

    def request_stop(self) -> None:
        self._stopping.set()

    def _handover_requested(self) -> None:
        """Checksum what RAM holds while still serving, then stop to hand it over."""
        if self.config.handover_checksums and self._prehash is None:
            self._prehash = asyncio.create_task(self._hash_then_stop(), name="kvstored-handover-checksums")
        else:
            self._stop_for_handover(0, 0.0)

    async def _hash_then_stop(self) -> None:
        t = time.perf_counter()
        try:
            taken = await self.chain.verifier.hash_unknown()
        except Exception:  # (the stop takes them then)
            log.exception("hand-over: chunk checksums not taken while serving")
            taken = 0
        self._stop_for_handover(taken, time.perf_counter() - t)

    def _stop_for_handover(self, taken: int, seconds: float) -> None:
        log.info(
            "hand-over: stopping to hand the RAM tier over (%d chunk checksums taken while serving, in %.2f s)",
            taken,
            seconds,
        )
        self.request_stop()

    def reload(self) -> None:
        """SIGHUP: read the configuration again; apply the log settings and the tiers' admission
        policies, and name every other change, which needs a restart."""
        try:
            new = self._reload_config()
        except (ConfigError, SystemExit) as exc:  # argparse exits on bad flags
            log.error("SIGHUP: configuration not reloaded: %s", exc)
            return
        old, applied = self.config, []
        if (new.log_level, new.log_format) != (old.log_level, old.log_format):
            setup_logging(new.log_level, new.log_format)
            applied.append(f"log_level={new.log_level} log_format={new.log_format}")
        tiers = self._reload_tiers(old.tiers, new.tiers, applied)
        live = ("log_level", "log_format", "tiers")  # applied above, or tier by tier
        restart = [
            f.name
            for f in dataclasses.fields(Config)
            if f.name not in live and getattr(old, f.name) != getattr(new, f.name)
        ]
        if tiers is None:
            restart.append("tiers")
        self.config = dataclasses.replace(
            old, log_level=new.log_level, log_format=new.log_format, tiers=tiers if tiers is not None else old.tiers
        )
        log.info("SIGHUP: configuration reloaded; applied: %s", "; ".join(applied) or "nothing changed")
        if restart:
            log.warning("SIGHUP: %s changed but can only take effect after a restart of kvstored", ", ".join(restart))

    def _reload_tiers(
        self, old: tuple[TierConfig, ...], new: tuple[TierConfig, ...], applied: list[str]
    ) -> tuple[TierConfig, ...] | None:
        """Apply admission changes to every tier that has a policy; None if anything else about
        the tiers changed."""
        changes = admission_changes(old, new)
        if changes is None:
            return None
        for index, policy in changes.items():
            self.chain.lower[index].tier.set_admission(policy)
            applied.append(f"tier {new[index].name} admission={policy.value}")
        return new

    async def _close_feeds(self) -> None:
        timer, self._feeds_timer = self._feeds_timer, None
        if timer is not None:
            timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timer
        self.feeds.close()

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    async def stop(self) -> None:
        cfg = self.config
        log.info("shutting down (grace %.1fs)", cfg.grace_seconds)
        notify("STOPPING=1")
        listener = self.handover_listener
        if listener is not None:
            await listener.stop_listening()
        if self._prehash is not None:  # (a SIGTERM during it: the stop hashes what it did not)
            self._prehash.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prehash
        await self.health.enter_graceful_shutdown()
        await self._close_feeds()  # (their last interval sent first)
        self.chain.events.close()  # event streams end now instead of holding the grace period
        if self.peer_tier is not None:
            await self.peer_tier.close()  # stop following the peers; their reads end as misses
        await self.session_server.stop_accepting()
        handing_over = (listener is not None and listener.requested) or (cfg.handover and fd_store_enabled())
        if handing_over:  # (else the pool goes with this daemon: nothing a client writes can land in a chunk)
            self.broker.hold_writes()
        await self.server.stop(cfg.grace_seconds)
        if self.peer_serving is not None:
            await self.peer_serving.close()  # after the grace period: peers' fetches in flight finish
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        await self.session_server.close()
        await self.broker.close()
        if self.key_indexes is not None:  # (clients keep their mappings: the memory goes with the last)
            self.ram.set_listener(None)
            self.key_indexes.close()
        if cfg.flush_on_stop_seconds > 0 and self.chain.lower:
            flushed = await self.chain.writeback.flush(cfg.flush_on_stop_seconds)
            log.info("wrote %d chunk(s) down before stopping", flushed)
        await self.records.close()  # after the flush: its chunks' namespaces get their records
        if self.zmq_events is not None:
            await self.zmq_events.close()
        await self.chain.close()
        await self.releaser.close()
        self.held_writes.close()
        if listener is not None and listener.requested:
            await self._hand_over(listener.send)
        elif cfg.handover and fd_store_enabled():
            await self._hand_over(store_fds)
        self.arenas.close()
        self.pool.close()
        with contextlib.suppress(FileNotFoundError):
            cfg.socket.unlink()
        if listener is not None:
            listener.finish()  # (after the socket files are gone: the next daemon claims them)
        log.info("stopped")

    # -- hand-over (kvstored/server/handover.py) ------------------------------------------------

    def _layout(self, pool_bytes: int) -> handover.Layout:
        cfg = self.config
        arena_pages = max(1, min(cfg.tenant_quota_bytes, pool_bytes) // cfg.page_bytes)
        return handover.Layout(pool_bytes, cfg.page_bytes, cfg.pool_pages.value, 2 * arena_pages * cfg.page_bytes)

    async def _receive_handover(self, pool_bytes: int) -> None:
        """Get the previous daemon's RAM tier (from systemd's fd store, or by asking a daemon
        serving on our socket) and check its state; on any doubt, log why and start cold."""
        cfg = self.config
        try:
            handed = listened_fds()
            if handed is None:
                timeout = cfg.grace_seconds + cfg.flush_on_stop_seconds + 60  # its whole stop
                handed = await self._unless_stopped(
                    handover.request_handover(handover.handover_path(cfg.socket), timeout),
                    "stop requested while waiting for the hand-over",
                )
        except handover.HandoverRefused as exc:
            log.warning("RAM tier not handed over (%s): starting cold", exc)
            return
        if handed is None:
            return
        self._handed, self._handed_names = handed, list(handed.fds)
        handover.pause_at(handover.HandoverStep.RECEIVED)
        try:
            state = handover.read_state_memfd(handed.take(handover.STATE_FD))
            handover.check_layout(state, self._layout(pool_bytes))
            missing = [a for a in state.tenants if f"{handover.ARENA_FD}{a}" not in handed.fds]
            if missing or handover.POOL_FD not in handed.fds:
                raise handover.HandoverRefused(f"fds missing: pool and arenas {missing}")
        except (handover.HandoverRefused, OSError) as exc:
            log.warning("RAM tier from %s refused (%s): starting cold", handed.source, exc)
            self._drop_handover()
            return
        log.info(
            "RAM tier handed over by %s (kvstored %s): %d chunks, %d namespaces, %d tenant arenas",
            handed.source,
            state.version,
            len(state.ram.chunks),
            len(state.namespaces),
            len(state.tenants),
        )
        self._state = state
        handover.pause_at(handover.HandoverStep.VERIFIED)

    def _release_stored_fds(self) -> None:
        """handover = false: a RAM tier systemd kept for us is closed and taken out of its store,
        or it would hold a second pool's memory for as long as the service lives."""
        handed = listened_fds()
        if handed is not None:
            names = list(handed.fds)
            handed.close()
            forget_fds(names)
            log.info("handover = false: the RAM tier kept in %s is released", handed.source)

    def _drop_handover(self) -> None:
        if self._handed is not None:
            self._handed.close()
        self._handed, self._state = None, None

    def _check_memory(self, pool_bytes: int) -> None:
        cfg = self.config
        for warning in memory.check_request(pool_bytes, cfg.pool_pages, cfg.numa_node, cfg.populate):
            log.warning("%s", warning)  # (what the machine cannot give at all raised PoolMemoryError)

    def _adopt_pool(self, pool_bytes: int) -> SharedPool:
        """The handed-over pool if there is one that maps as it should, else a new one."""
        cfg = self.config
        if self._handed is not None and self._state is not None:
            fd = self._handed.take(handover.POOL_FD)
            try:
                return SharedPool(pool_bytes, populate=False, pages=cfg.pool_pages, numa=cfg.numa_node, adopt_fd=fd)
            except PoolMemoryError as exc:
                os.close(fd)
                log.warning("RAM tier refused (%s): starting cold", exc)
                self._drop_handover()
                self._check_memory(pool_bytes)
        return SharedPool(pool_bytes, populate=False, pages=cfg.pool_pages, numa=cfg.numa_node)

    async def _adopt_ram(self, ram: RamTier, state: handover.PoolState) -> None:
        """Adopt the tenant arenas and the RAM index; chunks whose bytes changed are dropped. On
        an index that does not add up, RAM starts empty (its pages are all free then)."""
        handed = self._handed
        assert handed is not None
        # (the same pool, whatever is adopted of it: its clients may map any id given out on it)
        self.arenas.resume_ids(state.next_arena or max(state.tenants, default=0) + 1)
        try:
            for arena_id, tenant in sorted(state.tenants.items()):
                fd = handed.take(f"{handover.ARENA_FD}{arena_id}")
                size = state.ram.arenas[arena_id].total_pages * ram.page_bytes if arena_id in state.ram.arenas else 0
                try:
                    arena = self.arenas.adopt(arena_id, tenant, fd, size)
                except (ValueError, OSError):
                    os.close(fd)
                    raise
                self.tenancy.adopt_tenant(tenant, arena)
            verify = self.config.handover_checksums
            if verify and any(r.checksum is None for r in state.ram.chunks):
                log.info("RAM tier handed over without chunk checksums: chunks without one adopted as is")
            # Serving starts now: each chunk's bytes are checked before its first read and by the
            # sweep (chain/verify.py); hashing them all first took 0.81 s of an 8 GiB hand-over.
            adopted = ram.adopt(state.ram, verify=verify, held=unique_pages(state.held))
        except (AdoptionError, ValueError, OSError, handover.HandoverRefused) as exc:
            log.warning("RAM index refused (%s): RAM starts empty", exc)
            self._hold_without_index(ram, state)
            self.tenancy.sweep()
        else:
            log.info(
                "RAM tier adopted: %d chunks, %d to verify before their first read",
                adopted.chunks,
                ram.unverified_count,
            )
            self._hold(adopted.held, state)
        finally:
            self._drop_handover()
        forget_fds(self._handed_names)  # (systemd's copies: the state describes this RAM no more)
        handover.pause_at(handover.HandoverStep.ADOPTED)

    def _hold_without_index(self, ram: RamTier, state: handover.PoolState) -> None:
        """The pool is still the one clients of the old daemon map: the pages they may still be
        writing, and those of the chunks they may still be reading, stay held even when the
        chunks' index was refused (every held page, or none)."""
        if not state.held or ram.used_bytes:
            return
        held = leases_as_pages(state.held, state.ram.chunks)
        try:
            adopted = ram.adopt(dataclasses.replace(state.ram, chunks=[]), held=unique_pages(held))
        except (AdoptionError, ValueError) as exc:
            log.warning("held pages refused too (%s): a client's late copy may land in a new chunk", exc)
            return
        self._hold(adopted.held, dataclasses.replace(state, held=held))

    def _hold(self, entries: list[RamEntry], state: handover.PoolState) -> None:
        """Each handed-over session's held entries (adopted once each, in unique_pages' order)
        held again here, and its leased chunks leased again; their clients' pids are watched only
        if they mean the same processes here."""
        same_pids = state.pid_ns != 0 and state.pid_ns == pid_namespace()
        by_pages = dict(zip(unique_pages(state.held), entries, strict=True))
        for h in state.held:
            pid = h.pid if same_pids else 0
            leased = [e for e in map(self.ram.keep, h.leased) if e is not None]
            mine = [by_pages[p] for p in dict.fromkeys(h.pages)]
            self.held_writes.hold(h.session_id, pid, mine, h.seconds_left, leased=leased)

    async def _hand_over(self, send: Callable[[dict[str, int]], None]) -> None:
        """Snapshot the quiesced RAM tier into a state memfd and send it with the pool's and the
        arenas' fds (`send`: to the next daemon, or to systemd's fd store)."""
        handover.pause_at(handover.HandoverStep.QUIESCED)
        cfg = self.config
        ram = self.ram
        snapshot = ram.snapshot()
        if cfg.handover_checksums:
            known = sum(r.checksum is not None for r in snapshot.chunks)
            chunks = await asyncio.to_thread(
                handover.with_checksums, snapshot.chunks, self.arenas.view, ram.page_bytes, cfg.copy_threads
            )
            snapshot = dataclasses.replace(snapshot, chunks=chunks)
            log.info("chunk checksums: %d computed, %d known", len(chunks) - known, known)
        else:  # (none at all: the next daemon adopts them as they are)
            chunks = [dataclasses.replace(r, checksum=None) for r in snapshot.chunks]
            snapshot = dataclasses.replace(snapshot, chunks=chunks)
        recovered = self.namespaces.recovered()
        state = handover.PoolState(
            __version__,
            self._layout(self.pool.size),
            [(ns, recovered.get(ns.namespace_id, ())) for ns in self.namespaces.all()],
            {arena: key for key, arena in self.tenancy.arenas_by_tenant().items()},
            snapshot,
            self.held_writes.records(),
            pid_namespace(),
            self.arenas.next_id,
        )
        fd = handover.write_state_memfd(handover.encode_state(state))
        try:
            fds = {handover.POOL_FD: self.pool.fd}
            fds |= {f"{handover.ARENA_FD}{a.arena_id}": a.fd for a in self.arenas.tenant_arenas()}
            fds[handover.STATE_FD] = fd
            handover.pause_at(handover.HandoverStep.SNAPSHOT)
            send(fds)
            log.info("RAM tier handed over: %d chunks, %s", len(snapshot.chunks), format_size(ram.used_bytes))
        except OSError as exc:
            log.warning("RAM tier not handed over (%s): it is lost with this daemon", exc)
        finally:
            os.close(fd)
        handover.pause_at(handover.HandoverStep.SENT)


EXTEND_START_S = 30  # each progress report gives systemd's start timeout this much more


def _report_populate(threads: int, progress: PopulateProgress) -> None:
    """Populate progress, from its thread: a log line and systemd's status."""
    if progress.done_bytes == 0:
        log.info(
            "populating the RAM tier (%s, %d thread%s)", format_size(progress.total_bytes), threads, "s"[: threads > 1]
        )
    elif progress.finished:
        log.info(
            "RAM tier populated: %s in %.1f s (%s/s)",
            format_size(progress.total_bytes),
            progress.elapsed_s,
            format_size(int(progress.rate)),
        )
    else:
        log.info("populating the RAM tier: %s", progress.describe())
    notify(f"STATUS=populating the RAM tier: {progress.describe()}\nEXTEND_TIMEOUT_USEC={EXTEND_START_S * 1_000_000}")


async def run(config: Config, reload_config: Callable[[], Config]) -> None:
    daemon = Daemon(config, reload_config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    loop.add_signal_handler(signal.SIGHUP, daemon.reload)
    try:
        await daemon.start()
    except StoppedDuringStart as exc:
        log.info("%s; stopped", exc)
        return
    try:
        await daemon.wait_stopped()
    finally:
        await daemon.stop()
