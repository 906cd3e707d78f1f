# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The config of each tier kind (one frozen dataclass per kind) and what the daemon hands a
kind's factory. Apart from the registry (tiers/registry.py) so a kind's module (tiers/peer.py)
and the registry both import it, not each other."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvstored.peer.transport import DataThreads, TransportPreference
from kvstored.tiers.base import AdmissionPolicy

if TYPE_CHECKING:
    from dataclasses import Field

    from kvstored.namespaces import NamespaceRegistry


class DaemonOptions(Protocol):
    """The daemon options a tier kind may depend on (kvstored.config.Config has them)."""

    @property
    def tcp_listen(self) -> str: ...

    @property
    def tls_cert_file(self) -> Path | None: ...

    @property
    def tls_key_file(self) -> Path | None: ...

    @property
    def tls_client_ca_file(self) -> Path | None: ...


@dataclass(frozen=True)
class TierContext:
    """What the daemon hands every factory (a kind uses what it needs; tests may leave it empty)."""

    namespaces: NamespaceRegistry | None = None
    options: DaemonOptions | None = None
    incarnation: int = 0  # random per daemon start: how peers tell a restart (and this daemon itself)


class TierConfig(Protocol):
    """What the config of every kind has (each one is a frozen dataclass)."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    @property
    def name(self) -> str: ...  # unique among the tiers; labels its metrics and events

    @property
    def concurrency(self) -> int: ...  # operations in flight (the tier's I/O queue)

    @property
    def max_backlog(self) -> int: ...  # queued write-downs (and deletions) before new ones are dropped


# -- fs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FsTierConfig:
    """A local filesystem tier (NVMe). Files are content-addressed under `root`."""

    root: Path
    bytes: int
    name: str = "fs"
    admission: AdmissionPolicy = AdmissionPolicy.ALWAYS
    io_threads: int = 8  # measured: 8 keeps the disk busier than 4 (bench/tiers.py)
    direct_io: bool = True
    group_access: bool = False  # files 0640 / directories 0750 instead of 0600 / 0700
    # Operations in flight: twice io_threads, so a thread that ends one I/O starts the next queued
    # one at once (reads first) instead of waiting for the event loop to submit it.
    concurrency: int = 16
    max_backlog: int = 256  # queued write-downs (and deletions) before new ones are dropped


# -- s3 -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3TierConfig:
    """An S3-compatible object store tier. Credentials default to the AWS chain."""

    bucket: str
    name: str = "s3"
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    bytes: int = 0  # 0: unbounded
    timeout_s: float = 5.0  # per operation, retries included
    concurrency: int = 16
    max_backlog: int = 64
    admission: AdmissionPolicy = AdmissionPolicy.ALWAYS
    negative_cache_s: float = 1.0  # how long a miss is remembered
    breaker_failures: int = 3  # consecutive failures that open the circuit breaker
    breaker_reset_s: float = 5.0  # how long an open breaker waits before probing again
    create_bucket: bool = True
    # Packs (kvstored/tiers/s3pack.py): chunks fill objects of up to pack_bytes, sent when full or
    # pack_age_s old; 0 writes one object per chunk.
    pack_bytes: int = 32 << 20
    pack_age_s: float = 1.0
    pack_uploads: int = 4  # packs PUT at once (memory: (pack_uploads + 1) x pack_bytes at most)
    pack_poll_s: float = 2.0  # how often packs other daemons wrote are listed; 0: only at start


# -- peer -----------------------------------------------------------------------------------

DATA_PORT_OFFSETS = (1000, 2000)  # default TCP data port and UCX port: tcp_listen's port + these


@dataclass(frozen=True)
class PeerTierConfig:
    """Other kvstored daemons: chunks they hold in RAM or on their local tiers, fetched over UCX or
    TCP straight into this daemon's pool (kvstored/tiers/peer.py)."""

    name: str = "peer"
    peers: tuple[str, ...] = ()  # their tcp_listen addresses, HOST:PORT; this daemon's own is skipped
    peers_dns: str = ""  # NAME:PORT, every address NAME resolves to is a peer (a headless Service)
    dns_interval_s: float = 10.0  # how often peers_dns is resolved again
    transport: TransportPreference = TransportPreference.AUTO  # auto: UCX when both sides have it
    tcp_port: int | None = None  # TCP data port; default tcp_listen's port + 1000 (0: any free port)
    ucx_port: int | None = None  # UCX port; default tcp_listen's port + 2000 (0: any free port)
    ucx_net_devices: str = "all"  # UCX_NET_DEVICES, e.g. "mlx5_0:1" or "eth0"
    ucx_tls: str = "tcp"  # UCX_TLS: "tcp" on Ethernet; e.g. "rc,tcp" on InfiniBand/RoCE
    fetch_timeout_s: float = 1.0  # one batch of chunks from a peer: connect, order, bytes
    connect_timeout_s: float = 1.0  # a peer's handshake, and a data connection
    settle_timeout_s: float = 5.0  # how long a failed transfer may take to stop touching its slots
    tcp_connections: int = 8  # data connections per peer (batches in flight to it over TCP)
    max_batch: int = 16  # chunks per fetch: concurrent reads from one peer share one order
    # TCP chunk bytes move in threads (auto: on nodes with 8 CPUs or more), not on the event loop
    data_threads: DataThreads = DataThreads.AUTO
    # With data threads, a bulk fetch (at least STREAM_BYTES per stream) is split into up to this
    # many orders, each on a data connection and a thread of its own on both sides.
    streams: int = 2
    index_entries: int = 1_000_000  # chunks the remote-location index holds at most (~170 B each)
    breaker_failures: int = 3  # consecutive failed fetches from a peer that open its breaker
    breaker_reset_s: float = 5.0  # how long an open breaker makes its chunks misses, then one probe
    reconnect_s: float = 5.0  # longest wait between attempts to reach a peer that is down
    # Follow peers' net changes once per their events_interval (a message per interval, not per
    # event: ~100x less CPU per peer); false: every event as it happens (index lag ~0).
    coalesce_events: bool = True
    tls_ca_file: Path | None = None  # CA of the peers' certificates (default: tls_client_ca_file)
    tls_server_name: str = ""  # name in the peers' certificates, when they are reached by IP address
    # The fleet directory (kvstored/directory/): redis[s]://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]
    # of a Redis Cluster; "" for none. Its holders are fetched from like peers, found through it.
    directory: str = ""
    directory_address: str = ""  # this daemon's HOST:PORT as the others reach it (default: tcp_listen)
    directory_interval_s: float = 0.5  # writes and the heartbeat, once per interval
    directory_heartbeat_ttl_s: float = 3.0  # a holder silent this long holds nothing
    directory_entry_ttl_s: float = 1800.0  # a chunk's key expires unless re-written (every TTL / 2)
    directory_timeout_s: float = 0.1  # a lookup's round trips to the directory, at most
    directory_buckets: int = 16  # hash-tag buckets per namespace (slots a lookup touches, at most)
    directory_prefix: str = "kvd"  # of every key: fleets sharing a cluster use different prefixes
    directory_tls_ca_file: Path | None = None  # CA of the directory's certificates (rediss://)
    concurrency: int = 64  # reads in flight (they are batched per peer)
    max_backlog: int = 1  # (no write-downs or deletes reach a peer tier)


def data_threads(cfg: PeerTierConfig) -> bool:
    """Whether this node's TCP data plane moves bytes in threads (`data_threads`, auto resolved)."""
    return cfg.data_threads.enabled(len(os.sched_getaffinity(0)))  # (the CPUs it may run on)


def data_ports(cfg: PeerTierConfig, tcp_listen: str) -> tuple[int, int]:
    """The TCP data port and UCX port a peer tier serves on (0: any free port)."""
    listen_port = int(tcp_listen.rpartition(":")[2] or 0)
    derived = [listen_port + offset if listen_port else 0 for offset in DATA_PORT_OFFSETS]
    tcp = derived[0] if cfg.tcp_port is None else cfg.tcp_port
    ucx = derived[1] if cfg.ucx_port is None else cfg.ucx_port
    return tcp, ucx
