"""One typed config for the daemon: defaults < TOML file < KVSTORED_* env < command-line flags.

Every option is declared once, as a dataclass field with its help text; the CLI flags, the env
variable names and the TOML keys are all derived from that declaration.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, get_args

from kvstored.sizes import parse_size
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


def _parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r} (use true/false)")


def _parse_mode(value: str | int) -> int:
    return value if isinstance(value, int) else int(str(value), 8)


def _choice(literal: Any) -> Callable[[str], str]:
    allowed = get_args(literal)

    def parse(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
        return value

    return parse


def _opt(help_text: str, parse: Callable[[Any], Any], metavar: str = "") -> dict[str, Any]:
    return {"help": help_text, "parse": parse, "metavar": metavar}


@dataclass(frozen=True)
class Config:
    socket: Path = field(
        default_factory=default_socket_path,
        metadata=_opt("unix socket of the gRPC API; the session socket is <socket>.session", Path, "PATH"),
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
        metadata=_opt("touch every pool page at start so first copies run at full speed", _parse_bool, "BOOL"),
    )
    max_batch_keys: int = field(
        default=8192, metadata=_opt("most keys one request may carry", int, "N")
    )
    grace_seconds: float = field(
        default=5.0,
        metadata=_opt("on SIGTERM, how long in-flight calls may take to finish", float, "SECONDS"),
    )
    log_level: LogLevel = field(default="info", metadata=_opt("log level", _choice(LogLevel), "LEVEL"))
    log_format: LogFormat = field(
        default="text", metadata=_opt("log line format", _choice(LogFormat), "FORMAT")
    )

    def validate(self) -> "Config":
        if self.page_bytes <= 0 or self.page_bytes % 4096:
            raise ConfigError(f"page_bytes must be a positive multiple of 4096, got {self.page_bytes}")
        if self.cpu_bytes < self.page_bytes:
            raise ConfigError(
                f"cpu_bytes ({self.cpu_bytes}) must hold at least one page ({self.page_bytes} bytes)"
            )
        if self.max_batch_keys <= 0:
            raise ConfigError(f"max_batch_keys must be positive, got {self.max_batch_keys}")
        if self.grace_seconds < 0:
            raise ConfigError(f"grace_seconds must not be negative, got {self.grace_seconds}")
        return self

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
    except (TypeError, ValueError) as exc:
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
