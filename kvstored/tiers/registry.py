# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The tier kinds below RAM, keyed by the `kind` of a [[tiers]] entry.

Each kind registers, in one TierKindSpec: its config dataclass, how to parse its options and
their least values, its factory and its capabilities (what the chain may ask of it). Adding a
kind is its module (a SecondaryTier) plus one entry here. A factory imports its module only
when a tier of that kind is built, so a kind's libraries (aiobotocore for s3, ucxx for peer)
load only when one is configured. Factories get the config and a TierContext: what the daemon
around them offers (its namespaces, its TCP listener and TLS files, its incarnation). The config
dataclasses themselves are in tiers/config.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from kvstored.chunks.ids import TierKind
from kvstored.parsing import parse_bool, parse_seconds
from kvstored.peer.transport import DataThreads, TransportPreference
from kvstored.sizes import parse_size
from kvstored.tiers.base import AdmissionPolicy, SecondaryTier, TierCapabilities
from kvstored.tiers.config import (
    DATA_PORT_OFFSETS,
    DaemonOptions,
    FsTierConfig,
    PeerTierConfig,
    S3TierConfig,
    TierConfig,
    TierContext,
    data_ports,
)

Parser = Callable[[Any], Any]


@runtime_checkable
class _Admitting(Protocol):
    @property
    def admission(self) -> AdmissionPolicy: ...


C = TypeVar("C", bound=TierConfig)

# Options most kinds share; a kind's own parsers are added to these.
COMMON_PARSERS: Mapping[str, Parser] = {
    "bytes": parse_size,
    "admission": AdmissionPolicy,
    "concurrency": int,
    "max_backlog": int,
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
            raise TypeError(
                f"tier kind {self.label!r}: {', '.join(sorted(named - fields))} "
                f"not among the fields of {self.config.__name__}"
            )

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


def _build_fs(cfg: FsTierConfig, ctx: TierContext) -> SecondaryTier:
    from kvstored.tiers.fs.tier import FsTier

    return FsTier(
        cfg.name,
        cfg.root,
        cfg.bytes,
        admission=cfg.admission,
        io_threads=cfg.io_threads,
        direct_io=cfg.direct_io,
        group_access=cfg.group_access,
    )


FS = TierKindSpec(
    label="fs",
    kind=TierKind.FS,
    config=FsTierConfig,
    build=_build_fs,
    parsers={**COMMON_PARSERS, "root": Path, "io_threads": int, "direct_io": parse_bool, "group_access": parse_bool},
    # (the tiers only find out when built or, worse, run: concurrency 0 starts no worker, so loads
    # wait forever; max_backlog <= 0 drops every write-down)
    minimums={"bytes": 1, "io_threads": 1, "concurrency": 1, "max_backlog": 1},
    capabilities=TierCapabilities(admission=True),
)


# -- s3 -------------------------------------------------------------------------------------


def _build_s3(cfg: S3TierConfig, ctx: TierContext) -> SecondaryTier:
    from kvstored.tiers.s3 import S3Tier  # aiobotocore is only imported when used
    from kvstored.tiers.s3pack import PackedS3Tier

    packing: dict[str, Any] = {}
    if cfg.pack_bytes:
        packing = {
            "pack_bytes": cfg.pack_bytes,
            "pack_age_s": cfg.pack_age_s,
            "pack_uploads": cfg.pack_uploads,
            "pack_poll_s": cfg.pack_poll_s,
        }
    return (PackedS3Tier if cfg.pack_bytes else S3Tier)(
        cfg.name,
        cfg.bucket,
        **packing,
        prefix=cfg.prefix,
        endpoint_url=cfg.endpoint_url,
        region=cfg.region,
        access_key=cfg.access_key,
        secret_key=cfg.secret_key,
        capacity_bytes=cfg.bytes,
        max_concurrency=cfg.concurrency,
        timeout_s=cfg.timeout_s,
        admission=cfg.admission,
        negative_cache_s=cfg.negative_cache_s,
        breaker_failures=cfg.breaker_failures,
        breaker_reset_s=cfg.breaker_reset_s,
        create_bucket=cfg.create_bucket,
    )


MAX_PACK_BYTES = 1 << 30  # one PUT each (S3 takes up to 5 GiB in one); memory holds pack_uploads + 1


def _check_s3(cfg: S3TierConfig) -> None:
    if not 0 < cfg.timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a finite number > 0, got {cfg.timeout_s}")
    for option in ("pack_age_s", "pack_poll_s"):
        if not math.isfinite(getattr(cfg, option)):
            raise ValueError(f"{option} must be a finite number of seconds, got {getattr(cfg, option)}")
    if cfg.pack_bytes and not 1 << 20 <= cfg.pack_bytes <= MAX_PACK_BYTES:
        raise ValueError(f"pack_bytes must be 0 (one object per chunk) or 1MiB to 1GiB, got {cfg.pack_bytes}")
    if cfg.pack_bytes and cfg.bytes and cfg.bytes < 2 * cfg.pack_bytes:
        raise ValueError(
            f"bytes ({cfg.bytes}) must be 0 or at least twice pack_bytes ({cfg.pack_bytes}): whole packs expire"
        )


S3 = TierKindSpec(
    label="s3",
    kind=TierKind.S3,
    config=S3TierConfig,
    build=_build_s3,
    parsers={
        **COMMON_PARSERS,
        "timeout_s": parse_seconds,
        "negative_cache_s": parse_seconds,
        "breaker_failures": int,
        "breaker_reset_s": parse_seconds,
        "create_bucket": parse_bool,
        "pack_bytes": parse_size,
        "pack_age_s": parse_seconds,
        "pack_uploads": int,
        "pack_poll_s": parse_seconds,
    },
    minimums={
        "bytes": 0,
        "concurrency": 1,
        "max_backlog": 1,
        "negative_cache_s": 0,
        "breaker_failures": 1,
        "breaker_reset_s": 0,
        "pack_bytes": 0,
        "pack_age_s": 0,
        "pack_uploads": 1,
        "pack_poll_s": 0,
    },
    # shared storage: peers read the bucket themselves rather than through another node
    capabilities=TierCapabilities(admission=True, local=False),
    check=_check_s3,
)


# -- peer -----------------------------------------------------------------------------------


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


def _parse_directory(value: Any) -> str:
    """A redis:// or rediss:// URL of seed nodes, checked now (the password is never echoed)."""
    text = str(value).strip()
    if text:
        from kvstored.directory.config import parse_url  # (no redis-py: the URL's syntax only)

        parse_url(text)
    return text


def _parse_port(value: Any) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise ValueError(f"a port is 0 to 65535, got {value!r}")
    return port


def _check_peer(cfg: PeerTierConfig) -> None:
    for option in ("fetch_timeout_s", "connect_timeout_s", "settle_timeout_s"):
        value = getattr(cfg, option)
        if not 0 < value < math.inf:
            raise ValueError(f"{option} must be a finite number > 0, got {value}")
    if cfg.streams > cfg.tcp_connections:
        raise ValueError(f"streams ({cfg.streams}) must be at most tcp_connections ({cfg.tcp_connections})")
    if not cfg.peers and not cfg.peers_dns and not cfg.directory:
        raise ValueError("set peers (a list of HOST:PORT), peers_dns (NAME:PORT) or directory (redis://...)")
    if not 0 < cfg.directory_heartbeat_ttl_s < math.inf or cfg.directory_heartbeat_ttl_s <= cfg.directory_interval_s:
        raise ValueError("directory_heartbeat_ttl_s must be finite and longer than directory_interval_s")
    if cfg.directory_entry_ttl_s < 2 * cfg.directory_interval_s:
        raise ValueError("directory_entry_ttl_s must be at least 2 x directory_interval_s")


def _check_peer_in(cfg: PeerTierConfig, daemon: DaemonOptions) -> None:
    if not daemon.tcp_listen:
        raise ValueError('needs tcp_listen (the address its peers connect to): set tcp_listen = "HOST:PORT"')
    tcp, ucx = data_ports(cfg, daemon.tcp_listen)
    listen_port = int(daemon.tcp_listen.rpartition(":")[2])
    for option, port in (("tcp_port", tcp), ("ucx_port", ucx)):
        if not 0 <= port <= 65535:
            raise ValueError(
                f"{option} is tcp_listen's port + {DATA_PORT_OFFSETS[option == 'ucx_port']} = {port} "
                f"by default, above 65535: set {option}"
            )
        if port and port == listen_port:
            raise ValueError(f"{option} {port} is tcp_listen's port: give the data plane a port of its own")
    if tcp and tcp == ucx and cfg.transport is not TransportPreference.TCP:
        raise ValueError(f"tcp_port and ucx_port are both {tcp}: give each a port of its own")


PEER = TierKindSpec(
    label="peer",
    kind=TierKind.PEER,
    config=PeerTierConfig,
    build=_build_peer,
    parsers={
        "peers": _parse_addresses,
        "peers_dns": _parse_dns,
        "dns_interval_s": parse_seconds,
        "transport": TransportPreference,
        "tcp_port": _parse_port,
        "ucx_port": _parse_port,
        "fetch_timeout_s": parse_seconds,
        "connect_timeout_s": parse_seconds,
        "settle_timeout_s": parse_seconds,
        "tcp_connections": int,
        "max_batch": int,
        "streams": int,
        "data_threads": DataThreads,
        "index_entries": int,
        "breaker_failures": int,
        "breaker_reset_s": parse_seconds,
        "reconnect_s": parse_seconds,
        "coalesce_events": parse_bool,
        "tls_ca_file": Path,
        "directory": _parse_directory,
        "directory_address": _parse_dns,
        "directory_interval_s": parse_seconds,
        "directory_heartbeat_ttl_s": parse_seconds,
        "directory_entry_ttl_s": parse_seconds,
        "directory_timeout_s": parse_seconds,
        "directory_buckets": int,
        "directory_tls_ca_file": Path,
        "concurrency": int,
        "max_backlog": int,
    },
    minimums={
        "directory_interval_s": 0.05,
        "directory_timeout_s": 0.001,
        "directory_buckets": 1,
        "dns_interval_s": 0.1,
        "tcp_connections": 1,
        "max_batch": 1,
        "streams": 1,
        "index_entries": 1,
        "breaker_failures": 1,
        "breaker_reset_s": 0,
        "reconnect_s": 0.05,
        "concurrency": 1,
        "max_backlog": 1,
    },
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
    old: Sequence[TierConfig],
    new: Sequence[TierConfig],
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
