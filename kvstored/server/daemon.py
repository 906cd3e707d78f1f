"""Daemon lifecycle: build the parts, serve, and shut down in a fixed order.

Shutdown order: health NOT_SERVING -> stop accepting sessions -> gRPC stop with a grace period
(in-flight calls finish) -> end sessions (leases, regions) -> copy threads -> pool -> socket files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstored import __version__
from kvstored.config import Config
from kvstored.namespaces import NamespaceRegistry
from kvstored.server.errors import ErrorMappingInterceptor
from kvstored.server.service import KVStoreService
from kvstored.server.session_socket import SessionSocketServer
from kvstored.server.sessions import SessionRegistry
from kvstored.server.systemd import notify
from kvstored.shm.mapping import SharedPool
from kvstored.sizes import format_size
from kvstored.tiers.chain import ChainPolicy, TierChain
from kvstored.tiers.factory import build_lower_tiers
from kvstored.tiers.ram import RamTier
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name


class SocketInUse(RuntimeError):
    pass


def claim_socket_path(path: Path) -> None:
    """Make room for our socket: remove a stale file from a killed daemon, refuse a live one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        return
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


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        cfg = self.config
        claim_socket_path(cfg.socket)
        claim_socket_path(cfg.session_socket)
        log.info("kvstored %s: RAM tier %s (populate=%s)", __version__, format_size(cfg.cpu_bytes), cfg.populate)
        self.pool = SharedPool(cfg.cpu_bytes, populate=cfg.populate)
        self.sessions = SessionRegistry()
        self.namespaces = NamespaceRegistry(cfg.cpu_bytes)
        lower = build_lower_tiers(cfg.tiers)
        self.chain = TierChain(
            RamTier(cfg.cpu_bytes, cfg.page_bytes, has_lower_tiers=bool(lower)),
            self.pool,
            self.sessions,
            lower,
            ChainPolicy(cfg.write_policy, cfg.headroom_bytes if lower else 0, cfg.writeback_wait_seconds),
        )
        await self.chain.start()
        for t in lower:
            usage = t.tier.usage()
            log.info("tier %s (%s): %s used of %s, %d chunks", t.tier.name, t.tier.kind.name.lower(),
                     format_size(usage.used_bytes), format_size(usage.capacity_bytes) if usage.capacity_bytes
                     else "unbounded", usage.chunks)

        self.server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
        pb_grpc.add_KVStoreServicer_to_server(
            KVStoreService(self.chain, self.namespaces, self.sessions, cfg.max_batch_keys), self.server
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        self.server.add_insecure_port(f"unix:{cfg.socket}")
        await self.server.start()
        os.chmod(cfg.socket, cfg.socket_mode)

        self.session_server = SessionSocketServer(
            cfg.session_socket, cfg.socket_mode, self.sessions, self.chain, self.pool
        )
        await self.session_server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving on %s (sessions on %s)", cfg.socket, cfg.session_socket)
        notify("READY=1\nSTATUS=serving")

    def request_stop(self) -> None:
        self._stopping.set()

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    async def stop(self) -> None:
        cfg = self.config
        log.info("shutting down (grace %.1fs)", cfg.grace_seconds)
        notify("STOPPING=1")
        await self.health.enter_graceful_shutdown()
        self.chain.events.close()  # event streams end now instead of holding the grace period
        await self.session_server.stop_accepting()
        await self.server.stop(cfg.grace_seconds)
        await self.session_server.close()
        await self.chain.close()
        self.pool.close()
        with contextlib.suppress(FileNotFoundError):
            cfg.socket.unlink()
        log.info("stopped")


async def run(config: Config) -> None:
    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    await daemon.start()
    try:
        await daemon.wait_stopped()
    finally:
        await daemon.stop()
