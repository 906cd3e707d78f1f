# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""One typed config for the daemon: defaults < TOML file < KVSTORED_* env < command-line flags.

Every option is declared once, as a dataclass field with its help text; the CLI flags, the env
variable names and the TOML keys are all derived from that declaration.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from kvstored.chain.writeback import WritePolicy
from kvstored.events.bus import EventEncoding
from kvstored.parsing import parse_bool, parse_seconds
from kvstored.shm.copier import default_copy_threads
from kvstored.shm.memory import NumaPlacement, PoolPages
from kvstored.sizes import parse_size
from kvstored.tiers.config import TierConfig
from kvstored.tiers.registry import KINDS as TIER_KINDS
from kvstored.tiers.registry import spec_of
from kvstored_client.paths import default_socket_path, session_socket_path

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]

ENV_PREFIX = "KVSTORED_"


class ConfigError(ValueError):
    """A config value is missing, malformed or out of range; the message names it."""


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _default_cpu_bytes() -> int:
    return physical_memory_bytes() // 4


def _parse_mode(value: str | int) -> int:
    mode = value if isinstance(value, int) else int(str(value), 8)
    if not 0 <= mode <= 0o777:
        raise ValueError(f"{value!r} is not permission bits (0000-0777, octal)")
    return mode


def _parse_dirs(value: str | list) -> tuple[Path, ...]:
    parts = value.split(":") if isinstance(value, str) else value
    return tuple(Path(os.path.realpath(p)) for p in parts if str(p).strip())


# sun_path holds 108 bytes with the terminating NUL; the session socket adds ".session".
MAX_SOCKET_PATH = 107 - len(".session")


def _parse_socket(value: str | Path) -> Path:
    path = Path(value)
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
        raise ValueError(f"socket path is {len(str(path))} bytes; unix sockets allow {MAX_SOCKET_PATH} here")
    return path


def _choice(literal: Any) -> Callable[[str], str]:
    allowed = get_args(literal)

    def parse(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
        return value

    return parse


def _choice_of(kind: type[enum.Enum]) -> Callable[[str], enum.Enum]:
    """Parse an enum's value, naming the valid ones when it is not one."""

    def parse(value: str) -> enum.Enum:
        try:
            return kind(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"{value!r} is not one of {', '.join(str(m.value) for m in kind)}") from None

    return parse


def _opt(help_text: str, parse: Callable[[Any], Any], metavar: str = "", repeat: bool = False) -> dict[str, Any]:
    return {"help": help_text, "parse": parse, "metavar": metavar, "repeat": repeat}


def _parse_optional_size(value: str | int | None) -> int | None:
    return None if value in (None, "", "auto") else parse_size(value)


@dataclass(frozen=True)
class Share:
    """A size given as bytes, or as a fraction of something sized later (e.g. of cpu_bytes)."""

    bytes: int = 0
    fraction: float = 0.0  # used when bytes is 0

    def of(self, whole: int) -> int:
        return self.bytes if self.bytes else int(whole * self.fraction)

    def __str__(self) -> str:
        return str(self.bytes) if self.bytes else f"{self.fraction:.0%}"


def _parse_share(value: str | float) -> Share:
    """ "50%", 0.5 (a fraction, up to 1) or a size ("8GiB", 8589934592)."""
    text = str(value).strip()
    if text.endswith("%"):
        fraction = float(text[:-1]) / 100
    elif isinstance(value, float) or (text.replace(".", "", 1).isdigit() and "." in text):
        fraction = float(text)
    else:
        return Share(bytes=parse_size(value))
    if not 0 < fraction <= 1:
        raise ValueError(f"{value!r}: a fraction must be above 0 and at most 1 (100%)")
    return Share(fraction=fraction)


def is_loopback(addr: str) -> bool:
    host = addr.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ZMQ transports a PUB or ROUTER socket can bind; anything else fails only at bind, after the tiers started.
ZMQ_TRANSPORTS = ("tcp", "ipc", "inproc", "pgm", "epgm", "tipc", "vmci", "ws", "wss")


def _check_zmq_endpoint(option: str, endpoint: str) -> None:
    transport, sep, address = endpoint.partition("://")
    if not sep or transport not in ZMQ_TRANSPORTS or not address:
        raise ConfigError(
            f"{option} must be TRANSPORT://ADDRESS with a ZMQ transport ({', '.join(ZMQ_TRANSPORTS)}), "
            f"e.g. tcp://127.0.0.1:5557; got {endpoint!r}"
        )


def _check_topic(template: str) -> None:
    try:
        template.format(node="n", model="m", namespace="ns")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"events_zmq_topic {template!r} is not a valid template ({exc!r}): use {{node}}, {{model}}, {{namespace}}"
        ) from None


def parse_listen_addr(value: str) -> str:
    """HOST:PORT (IPv6 as [::1]:9464), or "" / "off" to disable; returns "" or the address."""
    value = str(value).strip()
    if value.lower() in ("", "off"):
        return ""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:9464) or off, got {value!r}")
    return value


def _check_tier(tier: TierConfig) -> None:
    """Range-check a tier's options; ConfigError names the tier, the option and the value."""
    try:
        spec_of(tier).validate(tier)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _tier_table(spec: Mapping[str, Any] | str) -> dict[str, Any]:
    """A TOML table, or a "kind=fs,root=/mnt/kv,bytes=100GiB" string, as a dict."""
    if not isinstance(spec, str):
        return dict(spec)
    pairs: list[list[str]] = []
    for part in (p for p in spec.split(",") if p.strip()):
        if "=" not in part and pairs and "://" in pairs[-1][1]:
            pairs[-1][1] += "," + part  # a URL's list of hosts (directory=redis://a:1,b:2)
            continue
        pairs.append(part.split("=", 1))
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"tier {spec!r}: expected comma-separated key=value pairs")
    return {k.strip(): v.strip() for k, v in pairs}


def _parse_tier(spec: Mapping[str, Any] | str) -> TierConfig:
    """One tier from a TOML table or a "kind=fs,root=/mnt/kv,bytes=100GiB" string."""
    spec = _tier_table(spec)
    label = spec.pop("kind", None)
    kind = TIER_KINDS.get(label) if isinstance(label, str) else None
    if kind is None:
        raise ValueError(f"tier kind must be one of {', '.join(TIER_KINDS)}, got {label!r}")
    fields = dataclasses.fields(kind.config)
    known = {f.name for f in fields}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"{label} tier: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    missing = sorted(f.name for f in fields if f.default is dataclasses.MISSING and f.name not in spec)
    if missing:
        raise ValueError(f"{label} tier: missing {', '.join(missing)}")
    values: dict[str, Any] = {}
    for option, raw in spec.items():
        try:
            values[option] = kind.parse(option, raw)
        except (TypeError, ValueError) as exc:  # the parsers' own messages don't say which key
            raise ConfigError(f"{label} tier: bad value for {option}: {exc}") from None
    values.setdefault("name", label)
    tier = kind.config(**values)
    _check_tier(tier)
    return tier


def _parse_tiers(value: Any) -> tuple[TierConfig, ...]:
    """TOML: a list of tables; flags: a list of strings; env: strings separated by ';'."""
    if isinstance(value, str):
        value = [part for part in value.split(";") if part.strip()]
    tables = [_tier_table(item) for item in value]
    given = [str(t["name"]) for t in tables if "name" in t]
    if len(set(given)) != len(given):
        raise ValueError(f"tier names must be unique, got {given}")
    _name_unnamed(tables, set(given))
    return tuple(_parse_tier(table) for table in tables)


def _name_unnamed(tables: list[dict[str, Any]], taken: set[str]) -> None:
    """A tier without `name` is named after its kind ("fs"); the second of a kind "fs-2", and so
    on, skipping names given to other tiers."""
    for table in tables:
        kind = table.get("kind")
        if "name" in table or not isinstance(kind, str):
            continue  # (a missing or unknown kind is refused by _parse_tier)
        name, n = kind, 1
        while name in taken:
            n += 1
            name = f"{kind}-{n}"
        table["name"] = name
        taken.add(name)


@dataclass(frozen=True)
class Config:
    socket: Path = field(
        default_factory=lambda: default_socket_path(for_daemon=True),
        metadata=_opt(
            "unix socket of the gRPC API; the session socket is <socket>.session (default: "
            "/run/kvstored/kvstored.sock as root, else $XDG_RUNTIME_DIR/kvstored/kvstored.sock, "
            "/tmp/kvstored-UID/kvstored/kvstored.sock without XDG_RUNTIME_DIR)",
            _parse_socket,
            "PATH",
        ),
    )
    socket_mode: int = field(
        default=0o660, metadata=_opt("permission bits of both sockets (octal)", _parse_mode, "MODE")
    )
    cpu_bytes: int = field(
        default_factory=_default_cpu_bytes,
        metadata=_opt("host-RAM tier size (default: 25%% of physical RAM), e.g. 8GiB", parse_size, "BYTES"),
    )
    page_bytes: int = field(
        default=64 << 10,
        metadata=_opt("pool allocation unit; a multiple of 4096", parse_size, "BYTES"),
    )
    populate: bool = field(
        default=True,
        metadata=_opt("touch every pool page at start so first copies run at full speed", parse_bool, "BOOL"),
    )
    pool_pages: PoolPages = field(
        default=PoolPages.SMALL,
        metadata=_opt(
            "the pool's pages: 4k; thp (transparent huge pages: needs "
            "/sys/kernel/mm/transparent_hugepage/shmem_enabled = advise); hugetlb (2 MiB pages reserved "
            "with vm.nr_hugepages; cpu_bytes is rounded down to 2 MiB)",
            _choice_of(PoolPages),
            "PAGES",
        ),
    )
    numa_node: NumaPlacement | None = field(
        default=None,
        metadata=_opt(
            "place the pool on this NUMA node (e.g. the GPU's), or interleave across all nodes "
            "(default: unset, the kernel's first-touch policy)",
            NumaPlacement.parse,
            "NODE",
        ),
    )
    region_dirs: tuple[Path, ...] = field(
        default=(Path("/dev/shm"),),
        metadata=_opt(
            "directories RegisterRegion may name files in, ':'-separated (regions passed as an "
            "fd over the session socket need no entry)",
            _parse_dirs,
            "DIRS",
        ),
    )
    tune_memcpy: bool = field(
        default=True,
        metadata=_opt(
            "on x86-64 glibc, restart once with GLIBC_TUNABLES making copies above 1 MiB use "
            "cache-bypassing stores (glibc's own threshold can be hundreds of MiB)",
            parse_bool,
            "BOOL",
        ),
    )
    copy_threads: int = field(
        default_factory=default_copy_threads,
        metadata=_opt(
            "threads copying between client regions and the pool; a large batch is split across "
            "them (default: one per 8 cores, 2 to 8)",
            int,
            "N",
        ),
    )
    max_batch_keys: int = field(default=8192, metadata=_opt("most keys one request may carry", int, "N"))
    grace_seconds: float = field(
        default=5.0,
        metadata=_opt("on SIGTERM, how long in-flight calls may take to finish", parse_seconds, "SECONDS"),
    )
    tiers: tuple[TierConfig, ...] = field(
        default=(),
        metadata=_opt(
            "a tier below RAM, in order; repeat for more, e.g. kind=fs,root=/mnt/kv,bytes=100GiB or "
            "kind=s3,bucket=kv,endpoint_url=http://127.0.0.1:7480 (TOML: [[tiers]] tables; env: ';' between tiers)",
            _parse_tiers,
            "SPEC",
            repeat=True,
        ),
    )
    write_policy: WritePolicy = field(
        default=WritePolicy.WRITE_BACK,
        metadata=_opt("write-back: chunks go down when RAM evicts them; write-through: at once", WritePolicy, "POLICY"),
    )
    writeback_headroom: int | None = field(
        default=None,
        metadata=_opt(
            "RAM kept free by writing old chunks down ahead of need (default: 5%% of RAM, at most 1GiB)",
            _parse_optional_size,
            "BYTES",
        ),
    )
    flush_on_stop_seconds: float = field(
        default=10.0,
        metadata=_opt(
            "on SIGTERM, how long to spend writing chunks that have no copy below RAM down to "
            "the tiers (most recently used first), so a restart keeps them",
            parse_seconds,
            "SECONDS",
        ),
    )
    handover: bool = field(
        default=True,
        metadata=_opt(
            "keep RAM across a restart: on start, take the RAM tier over from a daemon serving on the "
            "same socket (asked on <socket>.handover) or from systemd's fd store; on such a request, "
            "or at a stop under systemd with FileDescriptorStoreMax=, hand it over (false: every start "
            "is cold)",
            parse_bool,
            "BOOL",
        ),
    )
    handover_checksums: bool = field(
        default=True,
        metadata=_opt(
            "checksum every RAM chunk's bytes (xxh3-64) when handing over (those known are reused) and "
            "check each after adoption, before its first read and in a background sweep (a chunk that "
            "differs is dropped, never served)",
            parse_bool,
            "BOOL",
        ),
    )
    writeback_wait_seconds: float = field(
        default=1.0,
        metadata=_opt(
            "how long a store may wait for write-downs to free RAM before evicting chunks that have no copy below",
            parse_seconds,
            "SECONDS",
        ),
    )
    staging_bytes: int = field(
        default=64 << 20,
        metadata=_opt(
            "memory, beside cpu_bytes, for region loads (vLLM's secondary-tier mode) while RAM is full: "
            "chunks below RAM are read into it, verified and copied into the engine's region, evicting "
            "nothing (0: such loads promote into RAM, evicting its oldest chunks)",
            parse_size,
            "BYTES",
        ),
    )
    recompute_gate: bool = field(
        default=True,
        metadata=_opt(
            "for namespaces that registered their recompute rates (prefill_tokens_per_s, "
            "kv_bytes_per_token): report hits below RAM only where loading them is expected to beat "
            "recomputing, and skip write-downs to tiers that cannot (false: every hit counts)",
            parse_bool,
            "BOOL",
        ),
    )
    rate_probe_seconds: float = field(
        default=5.0,
        metadata=_opt(
            "a tier skipped as slower than recomputing is measured again (one promotion or "
            "write-down let through) once its last measurement is this old",
            parse_seconds,
            "SECONDS",
        ),
    )
    metrics_addr: str = field(
        default="127.0.0.1:9464",
        metadata=_opt(
            "where /metrics (Prometheus) listens, HOST:PORT (port 0: any free port; the log "
            'names it); "" or off disables it',
            parse_listen_addr,
            "HOST:PORT",
        ),
    )
    tcp_listen: str = field(
        default="",
        metadata=_opt(
            "also serve gRPC on TCP HOST:PORT for peers and remote tools (control only: the "
            "data path is local shared memory); beyond loopback it requires TLS",
            parse_listen_addr,
            "HOST:PORT",
        ),
    )
    tls_cert_file: Path | None = field(
        default=None, metadata=_opt("PEM certificate chain for the TCP listener", Path, "FILE")
    )
    tls_key_file: Path | None = field(default=None, metadata=_opt("PEM private key for the TCP listener", Path, "FILE"))
    tls_client_ca_file: Path | None = field(
        default=None,
        metadata=_opt(
            "PEM CA bundle: when set, TCP clients must present a certificate it signed (mutual TLS)", Path, "FILE"
        ),
    )
    events_buffer: int = field(
        default=10_000, metadata=_opt("KV events kept for replay (WatchEvents from_seq, ZMQ replay)", int, "N")
    )
    events_zmq_endpoint: str = field(
        default="",
        metadata=_opt(
            "publish KV events on this ZMQ PUB endpoint in vLLM's wire format: tcp://*:5557 or "
            "ipc:// binds, tcp://router:5557 connects to a router that binds (default: off)",
            str,
            "ENDPOINT",
        ),
    )
    events_zmq_replay_endpoint: str = field(
        default="", metadata=_opt("ZMQ ROUTER endpoint answering vLLM-style replay requests", str, "ENDPOINT")
    )
    events_zmq_topic: str = field(
        default="kv@{node}@{model}",
        metadata=_opt(
            "topic of ZMQ event messages, per namespace: {node} (events_node), {model}, {namespace} "
            "(the namespace id); the default is llm-d's kv@<pod>@<model>",
            str,
            "TEMPLATE",
        ),
    )
    events_node: str = field(
        default="",
        metadata=_opt("the node's name in event topics ({node}; default: the host name)", str, "NAME"),
    )
    events_zmq_dp_rank: int = field(
        default=0, metadata=_opt("data-parallel rank sent in every ZMQ event batch (vLLM's third field)", int, "N")
    )
    events_zmq_queue: int = field(
        default=10_000,
        metadata=_opt("ZMQ event batches held while no router is subscribed (the oldest dropped past it)", int, "N"),
    )
    events_interval: float = field(
        default=0.1,
        metadata=_opt(
            "ZMQ events and coalesced WatchEvents streams (peer followers): net changes once per interval",
            parse_seconds,
            "SECONDS",
        ),
    )
    events_zmq_tenants: bool = field(
        default=False,
        metadata=_opt(
            "also publish tenant namespaces' events (ids and keys) on ZMQ: routers are trusted "
            "infrastructure; off, only public namespaces' events are published",
            parse_bool,
            "BOOL",
        ),
    )
    events_encoding: EventEncoding = field(
        default=EventEncoding.MAP,
        metadata=_opt(
            "map: vLLM 0.33 tagged maps; array: positional arrays for older llm-d/Dynamo decoders",
            EventEncoding,
            "ENCODING",
        ),
    )
    tenant_quota: Share = field(
        default=Share(fraction=0.5),
        metadata=_opt(
            "RAM each tenant (tenant_salt) may hold, as a fraction (50%%, 0.5) or bytes (8GiB); over it, "
            "a tenant's new chunks evict its own oldest ones. Its arena is twice that in address "
            "space (not memory)",
            _parse_share,
            "SHARE",
        ),
    )
    max_tenants: int = field(
        default=1024,
        metadata=_opt(
            "tenants that may hold an arena at once (one memfd each; an arena goes once no session "
            "holds it and it has no chunk in RAM)",
            int,
            "N",
        ),
    )
    max_namespaces: int = field(
        default=16384,
        metadata=_opt(
            "namespaces that may be registered (each is kept, and listed, for good): a new one past "
            "this is refused with RESOURCE_EXHAUSTED",
            int,
            "N",
        ),
    )
    log_level: LogLevel = field(default="info", metadata=_opt("log level", _choice(LogLevel), "LEVEL"))
    log_format: LogFormat = field(default="text", metadata=_opt("log line format", _choice(LogFormat), "FORMAT"))

    def validate(self) -> Config:
        if self.page_bytes <= 0 or self.page_bytes % 4096:
            raise ConfigError(f"page_bytes must be a positive multiple of 4096, got {self.page_bytes}")
        if self.cpu_bytes < self.page_bytes:
            raise ConfigError(f"cpu_bytes ({self.cpu_bytes}) must hold at least one page ({self.page_bytes} bytes)")
        if not 1 <= self.copy_threads <= 64:
            raise ConfigError(f"copy_threads must be 1 to 64, got {self.copy_threads}")
        if self.staging_bytes and self.staging_bytes < 4096:
            raise ConfigError(f"staging_bytes must be 0 (off) or at least one page (4096), got {self.staging_bytes}")
        if self.rate_probe_seconds <= 0:
            raise ConfigError(f"rate_probe_seconds must be positive, got {self.rate_probe_seconds}")
        if self.max_batch_keys <= 0:
            raise ConfigError(f"max_batch_keys must be positive, got {self.max_batch_keys}")
        if self.tenant_quota_bytes < self.page_bytes:
            raise ConfigError(
                f"tenant_quota ({self.tenant_quota}) must hold at least one page ({self.page_bytes} bytes)"
            )
        if self.max_tenants < 0:
            raise ConfigError(f"max_tenants must not be negative, got {self.max_tenants}")
        if self.max_namespaces < 1:
            raise ConfigError(f"max_namespaces must be at least 1, got {self.max_namespaces}")
        if self.grace_seconds < 0:
            raise ConfigError(f"grace_seconds must not be negative, got {self.grace_seconds}")
        for tier in self.tiers:
            _check_tier(tier)
            try:
                spec_of(tier).validate_in(tier, self)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        for label, spec in TIER_KINDS.items():
            named = [t.name for t in self.tiers if spec_of(t) is spec]
            if spec.at_most_one and len(named) > 1:
                raise ConfigError(f"at most one {label} tier, got {len(named)}: {', '.join(named)}")
        self._validate_events()
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        if self.tcp_listen and not self.tls_cert_file and not is_loopback(self.tcp_listen):
            raise ConfigError(
                f"tcp_listen {self.tcp_listen} is beyond loopback: set tls_cert_file and tls_key_file "
                f"(and tls_client_ca_file for mutual TLS)"
            )
        return self

    def _validate_events(self) -> None:
        if self.events_buffer < 0:
            raise ConfigError(f"events_buffer must not be negative, got {self.events_buffer}")
        if self.events_zmq_endpoint:
            _check_zmq_endpoint("events_zmq_endpoint", self.events_zmq_endpoint)
        _check_topic(self.events_zmq_topic)
        if "@" in self.events_node:  # llm-d splits kv@<pod>@<model> on "@"
            raise ConfigError(f"events_node must not contain '@', got {self.events_node!r}")
        if self.events_zmq_dp_rank < 0:
            raise ConfigError(f"events_zmq_dp_rank must not be negative, got {self.events_zmq_dp_rank}")
        if self.events_zmq_queue < 0:
            raise ConfigError(f"events_zmq_queue must not be negative, got {self.events_zmq_queue}")
        if not 0.001 <= self.events_interval <= 10:
            raise ConfigError(f"events_interval must be within 1ms..10s, got {self.events_interval}s")
        if self.events_zmq_replay_endpoint:
            _check_zmq_endpoint("events_zmq_replay_endpoint", self.events_zmq_replay_endpoint)
            if not self.events_zmq_endpoint:  # the publisher serves replay: alone it would be ignored
                raise ConfigError("events_zmq_replay_endpoint needs events_zmq_endpoint")
            if self.events_zmq_replay_endpoint == self.events_zmq_endpoint:
                raise ConfigError(
                    f"events_zmq_replay_endpoint must differ from events_zmq_endpoint, "
                    f"both are {self.events_zmq_endpoint!r}"
                )

    @property
    def headroom_bytes(self) -> int:
        if self.writeback_headroom is not None:
            return self.writeback_headroom
        return min(self.cpu_bytes // 20, 1 << 30)

    @property
    def tenant_quota_bytes(self) -> int:
        return min(self.tenant_quota.of(self.cpu_bytes), self.cpu_bytes)

    @property
    def session_socket(self) -> Path:
        return session_socket_path(self.socket)


def options() -> list[dataclasses.Field]:
    return list(dataclasses.fields(Config))


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_field(f: dataclasses.Field, raw: Any, source: str) -> Any:
    try:
        return f.metadata["parse"](raw)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"{source}: bad value for {f.name}: {exc}") from None


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> Config:
    """Merge the sources; `flags` holds only the options given on the command line."""
    env = os.environ if env is None else env
    flags = flags or {}
    if config_file is None and env.get(ENV_PREFIX + "CONFIG"):
        config_file = Path(env[ENV_PREFIX + "CONFIG"])
    file_values = read_toml(config_file) if config_file else {}

    known = {f.name for f in options()}
    unknown = sorted(set(file_values) - known)
    if unknown:
        raise ConfigError(f"{config_file}: unknown option(s): {', '.join(unknown)}")

    values: dict[str, Any] = {}
    for f in options():
        if f.name in flags and flags[f.name] is not None:
            values[f.name] = _parse_field(f, flags[f.name], f"flag {flag_name(f.name)}")
        elif env_name(f.name) in env:
            values[f.name] = _parse_field(f, env[env_name(f.name)], f"env {env_name(f.name)}")
        elif f.name in file_values:
            values[f.name] = _parse_field(f, file_values[f.name], f"{config_file}")
    return Config(**values).validate()
