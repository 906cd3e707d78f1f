"""The tier kinds below RAM, keyed by the `kind` of a [[tiers]] entry.

Each kind registers, in one TierKindSpec: its config dataclass, how to parse its options and
their least values, its factory and its capabilities (what the chain may ask of it). Adding a
kind is its module (a SecondaryTier) plus one entry here. A factory imports its module only
when a tier of that kind is built, so a kind's libraries (aiobotocore for s3) load only when
one is configured.
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
from kvstored.sizes import parse_size
from kvstored.tiers.base import AdmissionPolicy, SecondaryTier, TierCapabilities, TierKind

if TYPE_CHECKING:
    from dataclasses import Field

Parser = Callable[[Any], Any]


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


@dataclass(frozen=True)
class TierKindSpec(Generic[C]):
    label: str  # the `kind` of a [[tiers]] entry, e.g. "fs"
    kind: TierKind  # as reported in stats and events
    config: type[C]
    build: Callable[[C], SecondaryTier]  # imports the kind's module: call it only to build a tier
    parsers: Mapping[str, Parser] = field(default_factory=dict)  # option -> parser (str if absent)
    minimums: Mapping[str, float] = field(default_factory=dict)  # least value of numeric options
    capabilities: TierCapabilities = TierCapabilities()
    check: Callable[[C], None] = _no_check  # further range checks: ValueError naming the option

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


def _build_fs(cfg: FsTierConfig) -> SecondaryTier:
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


def _build_s3(cfg: S3TierConfig) -> SecondaryTier:
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
    capabilities=TierCapabilities(admission=True),
    check=_check_s3,
)


# -- the registry -----------------------------------------------------------------------------

KINDS: Mapping[str, TierKindSpec[Any]] = {spec.label: spec for spec in (FS, S3)}
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
