"""The tier kinds below RAM, keyed by the `kind` of a [[tiers]] entry.

Each kind registers, in one TierKindSpec: its config dataclass, how to parse its options and
their least values, its factory and its capabilities (what the chain may ask of it). Adding a
kind is its module (a SecondaryTier) plus one entry here. A factory imports its module only
when a tier of that kind is built, so a kind's libraries (aiobotocore for s3, ucxx for peer)
load only when one is configured. Factories get the config and a TierContext: what the daemon
around them offers (its namespaces, its TCP listener and TLS files, its incarnation).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Generic,
    Protocol,
    TypeVar,
    runtime_checkable,
)

from kvstored.parsing import parse_bool, parse_seconds
from kvstored.peer.transport import TransportPreference
from kvstored.sizes import parse_size
from kvstored.tiers.base import AdmissionPolicy, SecondaryTier, TierCapabilities, TierKind

if TYPE_CHECKING:
    from dataclasses import Field

    from kvstored.namespaces import NamespaceRegistry

Parser = Callable[[Any], Any]


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


@runtime_checkable
class _Admitting(Protocol):
    @property
    def admission(self) -> AdmissionPolicy: ...


C = TypeVar("C", bound=TierConfig)

# Options most kinds share; a kind's own parsers are added to these.
COMMON_PARSERS: Mapping[str, Parser] = {
    "bytes": parse_size, "admission": AdmissionPolicy, "concurrency": int, "max_backlog": int,
}


def _no_check(cfg: Any) -> None:
    pass


def _no_daemon_check(cfg: Any, daemon: DaemonOptions) -> None:
    pass


@dataclass(frozen=True)
class TierKindSpec(Generic[C]):
    label: str  # the `kind` of a [[tiers]] entry, e.g. "fs"
    kind: TierKind  # as reported in stats and events
    config: type[C]
    build: Callable[[C, TierContext], SecondaryTier]  # imports the kind's module: call it only to build a tier
    parsers: Mapping[str, Parser] = field(default_factory=dict)  # option -> parser (str if absent)
    minimums: Mapping[str, float] = field(default_factory=dict)  # least value of numeric options
    capabilities: TierCapabilities = TierCapabilities()
    check: Callable[[C], None] = _no_check  # further range checks: ValueError naming the option
    # Checks against the daemon's own options (ValueError naming both), and whether a daemon may
    # have more than one tier of this kind.
    check_daemon: Callable[[C, DaemonOptions], None] = _no_daemon_check
    at_most_one: bool = False

    def __post_init__(self) -> None:
        fields = {f.name for f in dataclasses.fields(self.config)}
        named = set(self.parsers) | set(self.minimums) | ({"admission"} if self.capabilities.admission else set())
        if named - fields:
            raise TypeError(f"tier kind {self.label!r}: {', '.join(sorted(named - fields))} "
                            f"not among the fields of {self.config.__name__}")

    def parse(self, option: str, raw: Any) -> Any:
        return self.parsers.get(option, str)(raw)

    def validate(self, cfg: C) -> None:
        """Range-check a config of this kind; ValueError names the tier, the option and the value."""
        for option, least in self.minimums.items():
            value = getattr(cfg, option)
            if not value >= least:  # (also refuses nan)
                raise ValueError(f"{self.label} tier {cfg.name!r}: {option} must be >= {least}, got {value}")
        try:
            self.check(cfg)
        except ValueError as exc:
            raise ValueError(f"{self.label} tier {cfg.name!r}: {exc}") from None

    def validate_in(self, cfg: C, daemon: DaemonOptions) -> None:
        """Check a config of this kind against the daemon's options; ValueError names both."""
        try:
            self.check_daemon(cfg, daemon)
        except ValueError as exc:
            raise ValueError(f"{self.label} tier {cfg.name!r}: {exc}") from None


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


def _build_fs(cfg: FsTierConfig, ctx: TierContext) -> SecondaryTier:
    from kvstored.tiers.fs import FsTier

    return FsTier(cfg.name, cfg.root, cfg.bytes, admission=cfg.admission, io_threads=cfg.io_threads,
                  direct_io=cfg.direct_io, group_access=cfg.group_access)


FS = TierKindSpec(
    label="fs", kind=TierKind.FS, config=FsTierConfig, build=_build_fs,
    parsers={**COMMON_PARSERS, "root": Path, "io_threads": int, "direct_io": parse_bool, "group_access": parse_bool},
    # (the tiers only find out when built or, worse, run: concurrency 0 starts no worker, so loads
    # wait forever; max_backlog <= 0 drops every write-down)
    minimums={"bytes": 1, "io_threads": 1, "concurrency": 1, "max_backlog": 1},
    capabilities=TierCapabilities(admission=True),
)


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


def _build_s3(cfg: S3TierConfig, ctx: TierContext) -> SecondaryTier:
    from kvstored.tiers.s3 import S3Tier  # aiobotocore is only imported when used

    return S3Tier(cfg.name, cfg.bucket, prefix=cfg.prefix, endpoint_url=cfg.endpoint_url, region=cfg.region,
                  access_key=cfg.access_key, secret_key=cfg.secret_key, capacity_bytes=cfg.bytes,
                  max_concurrency=cfg.concurrency, timeout_s=cfg.timeout_s, admission=cfg.admission,
                  negative_cache_s=cfg.negative_cache_s, breaker_failures=cfg.breaker_failures,
                  breaker_reset_s=cfg.breaker_reset_s, create_bucket=cfg.create_bucket)


def _check_s3(cfg: S3TierConfig) -> None:
    if not 0 < cfg.timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a finite number > 0, got {cfg.timeout_s}")


S3 = TierKindSpec(
    label="s3", kind=TierKind.S3, config=S3TierConfig, build=_build_s3,
    parsers={**COMMON_PARSERS, "timeout_s": parse_seconds, "negative_cache_s": parse_seconds,
             "breaker_failures": int, "breaker_reset_s": parse_seconds, "create_bucket": parse_bool},
    minimums={"bytes": 0, "concurrency": 1, "max_backlog": 1, "negative_cache_s": 0, "breaker_failures": 1,
              "breaker_reset_s": 0},
    # shared storage: peers read the bucket themselves rather than through another node
    capabilities=TierCapabilities(admission=True, local=False),
    check=_check_s3,
)


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
    index_entries: int = 1_000_000  # chunks the remote-location index holds at most (~170 B each)
    breaker_failures: int = 3  # consecutive failed fetches from a peer that open its breaker
    breaker_reset_s: float = 5.0  # how long an open breaker makes its chunks misses, then one probe
    reconnect_s: float = 5.0  # longest wait between attempts to reach a peer that is down
    tls_ca_file: Path | None = None  # CA of the peers' certificates (default: tls_client_ca_file)
    tls_server_name: str = ""  # name in the peers' certificates, when they are reached by IP address
    concurrency: int = 64  # reads in flight (they are batched per peer)
    max_backlog: int = 1  # (no write-downs or deletes reach a peer tier)


def _build_peer(cfg: PeerTierConfig, ctx: TierContext) -> SecondaryTier:
    from kvstored.tiers.peer import PeerTier  # the data plane (and ucxx, when used) load only here

    return PeerTier(cfg, ctx)


def _parse_addresses(value: Any) -> tuple[str, ...]:
    """A TOML list, or a string of HOST:PORT separated by spaces or '|' (flags, environment)."""
    items = value if isinstance(value, (list, tuple)) else str(value).replace("|", " ").split()
    out = []
    for item in items:
        host, sep, port = str(item).strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"expected HOST:PORT (e.g. 10.0.0.2:7070), got {item!r}")
        out.append(str(item).strip())
    return tuple(out)


def _parse_dns(value: Any) -> str:
    text = str(value).strip()
    if not text:
        return ""
    return _parse_addresses([text])[0]


def _parse_port(value: Any) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise ValueError(f"a port is 0 to 65535, got {value!r}")
    return port


def data_ports(cfg: PeerTierConfig, tcp_listen: str) -> tuple[int, int]:
    """The TCP data port and UCX port a peer tier serves on (0: any free port)."""
    listen_port = int(tcp_listen.rpartition(":")[2] or 0)
    derived = [listen_port + offset if listen_port else 0 for offset in DATA_PORT_OFFSETS]
    tcp = derived[0] if cfg.tcp_port is None else cfg.tcp_port
    ucx = derived[1] if cfg.ucx_port is None else cfg.ucx_port
    return tcp, ucx


def _check_peer(cfg: PeerTierConfig) -> None:
    for option in ("fetch_timeout_s", "connect_timeout_s", "settle_timeout_s"):
        value = getattr(cfg, option)
        if not 0 < value < math.inf:
            raise ValueError(f"{option} must be a finite number > 0, got {value}")
    if not cfg.peers and not cfg.peers_dns:
        raise ValueError("set peers (a list of HOST:PORT) or peers_dns (NAME:PORT), or both")


def _check_peer_in(cfg: PeerTierConfig, daemon: DaemonOptions) -> None:
    if not daemon.tcp_listen:
        raise ValueError("needs tcp_listen (the address its peers connect to): set tcp_listen = \"HOST:PORT\"")
    tcp, ucx = data_ports(cfg, daemon.tcp_listen)
    listen_port = int(daemon.tcp_listen.rpartition(":")[2])
    for option, port in (("tcp_port", tcp), ("ucx_port", ucx)):
        if not 0 <= port <= 65535:
            raise ValueError(f"{option} is tcp_listen's port + {DATA_PORT_OFFSETS[option == 'ucx_port']} = {port} "
                             f"by default, above 65535: set {option}")
        if port and port == listen_port:
            raise ValueError(f"{option} {port} is tcp_listen's port: give the data plane a port of its own")
    if tcp and tcp == ucx and cfg.transport is not TransportPreference.TCP:
        raise ValueError(f"tcp_port and ucx_port are both {tcp}: give each a port of its own")


PEER = TierKindSpec(
    label="peer", kind=TierKind.PEER, config=PeerTierConfig, build=_build_peer,
    parsers={"peers": _parse_addresses, "peers_dns": _parse_dns, "dns_interval_s": parse_seconds,
             "transport": TransportPreference, "tcp_port": _parse_port, "ucx_port": _parse_port,
             "fetch_timeout_s": parse_seconds, "connect_timeout_s": parse_seconds,
             "settle_timeout_s": parse_seconds, "tcp_connections": int, "max_batch": int, "index_entries": int,
             "breaker_failures": int, "breaker_reset_s": parse_seconds, "reconnect_s": parse_seconds,
             "tls_ca_file": Path, "concurrency": int, "max_backlog": int},
    minimums={"dns_interval_s": 0.1, "tcp_connections": 1, "max_batch": 1, "index_entries": 1,
              "breaker_failures": 1, "breaker_reset_s": 0, "reconnect_s": 0.05, "concurrency": 1, "max_backlog": 1},
    # A peer's chunks are its own: nothing is written down to it, deleted from it, or served from it.
    capabilities=TierCapabilities(accepts_writedowns=False, accepts_deletes=False, local=False),
    check=_check_peer,
    check_daemon=_check_peer_in,
    at_most_one=True,
)


# -- the registry -----------------------------------------------------------------------------

KINDS: Mapping[str, TierKindSpec[Any]] = {spec.label: spec for spec in (FS, S3, PEER)}
_BY_CONFIG: Mapping[type, TierKindSpec[Any]] = {spec.config: spec for spec in KINDS.values()}


def spec_of(cfg: TierConfig) -> TierKindSpec[Any]:
    """The kind a tier config belongs to."""
    try:
        return _BY_CONFIG[type(cfg)]
    except KeyError:
        raise TypeError(f"no tier kind has configs of type {type(cfg).__name__}") from None


def admission_of(cfg: TierConfig) -> AdmissionPolicy | None:
    """The admission policy a tier's config sets; None for kinds without one."""
    if spec_of(cfg).capabilities.admission and isinstance(cfg, _Admitting):
        return cfg.admission
    return None


def admission_changes(
    old: Sequence[TierConfig], new: Sequence[TierConfig],
) -> dict[int, AdmissionPolicy] | None:
    """The admission policies that changed between two tier lists, by tier position (what a
    reload can apply while running); None if anything else about the tiers changed."""
    def rest(cfg: TierConfig) -> TierConfig:
        return dataclasses.replace(cfg, admission=AdmissionPolicy.ALWAYS) if admission_of(cfg) is not None else cfg

    if len(old) != len(new) or any(rest(a) != rest(b) for a, b in zip(old, new)):
        return None
    changes: dict[int, AdmissionPolicy] = {}
    for i, (was, now) in enumerate(zip(old, new)):
        policy = admission_of(now)
        if policy is not None and policy != admission_of(was):
            changes[i] = policy
    return changes
