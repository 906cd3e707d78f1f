# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The gRPC control channel from this daemon to one peer's TCP listener: the handshake, fetch
orders, snapshots and the peer's KV events. TLS (mutual when this daemon has a certificate)
whenever this daemon's own listener uses TLS: a cluster is one trust domain.

Channels reconnect by themselves with a short backoff (gRPC's default grows to two minutes),
and ping a quiet event stream, so a peer that vanished without a word (frozen, cut off) is
noticed within KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS; fetches never wait on a channel that is
down (no wait_for_ready: a call fails at once, a miss).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvstored.peer.transport import PeerAddress
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

KEEPALIVE_MS = 5_000
KEEPALIVE_TIMEOUT_MS = 5_000
MAX_MESSAGE_BYTES = 64 << 20  # a snapshot batch of long keys; events of large batches

# What the daemon's own server must allow for its peers' keepalive pings.
SERVER_OPTIONS = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
)


@dataclass(frozen=True)
class ClientTls:
    """How to reach peers' TLS listeners: their CA, and this daemon's certificate for mutual TLS."""

    root_certificates: bytes | None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    server_name: str = ""  # the name in the peers' certificates, when they are reached by IP

    @classmethod
    def from_files(cls, ca: Path | None, key: Path | None, cert: Path | None, server_name: str = "") -> ClientTls:
        return cls(
            ca.read_bytes() if ca else None,
            key.read_bytes() if key else None,
            cert.read_bytes() if cert else None,
            server_name,
        )


class ControlChannel:
    def __init__(self, address: PeerAddress, tls: ClientTls | None, reconnect_max_s: float) -> None:
        self.address = address
        options: list[tuple[str, Any]] = [
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", max(100, int(reconnect_max_s * 1000))),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.enable_retries", 0),
        ]
        target = str(address)
        if tls is None:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        else:
            creds = grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key, tls.certificate_chain)
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.aio.secure_channel(target, creds, options=options)
        self._peer = pb_grpc.PeerStub(self._channel)
        self._kv = pb_grpc.KVStoreStub(self._channel)

    async def hello(self, mine: pb.PeerHello, timeout_s: float) -> pb.PeerHello:
        return await self._peer.Hello(mine, timeout=timeout_s)

    async def fetch(self, request: pb.FetchRequest, timeout_s: float) -> pb.FetchResponse:
        return await self._peer.Fetch(request, timeout=timeout_s)

    def snapshot(self, incarnation: int) -> AsyncIterator[pb.SnapshotBatch]:
        return self._peer.Snapshot(pb.SnapshotRequest(incarnation=incarnation))

    def watch(self, from_seq: int, incarnation: int, coalesce: bool = True) -> AsyncIterator[pb.KvEvent]:
        """The peer's KV events of public namespaces (no session: tenants' never come) from
        `from_seq` of its run `incarnation` (another run's: OUT_OF_RANGE); coalesced: its net
        changes once per its events_interval (a peer that predates it sends each event)."""
        request = pb.WatchEventsRequest(from_seq=from_seq, coalesce=coalesce, incarnation=incarnation)
        return self._kv.WatchEvents(request)

    async def close(self) -> None:
        await self._channel.close(grace=None)
