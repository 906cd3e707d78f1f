# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""`kvstored [serve] [--config FILE] [--OPTION VALUE ...]`: the only place that exits the process."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import os
import platform
import sys
import textwrap
from pathlib import Path

from kvstored import __version__
from kvstored.config import ConfigError, env_name, flag_name, load_config, options
from kvstored.logs import setup_logging

log = logging.getLogger("kvstored")

EXIT_CONFIG = 2  # the configuration cannot work: restarting will not help (RestartPreventExitStatus=2)


def _shown_default(f: dataclasses.Field) -> str:
    value = f.default
    if value is dataclasses.MISSING or value in (None, (), ""):
        return ""
    if isinstance(value, enum.Enum):
        value = value.value
    elif isinstance(value, bool):
        value = str(value).lower()
    elif f.name == "socket_mode":
        value = f"0{value:o}"
    elif isinstance(value, tuple):
        value = ":".join(map(str, value))
    return "; default " + str(value).replace("%", "%%")  # argparse formats help with %


def _tier_key(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING:
        return f"{f.name} (required)"
    value = f.default
    if isinstance(value, enum.Enum):
        value = value.value
    elif isinstance(value, bool):
        value = str(value).lower()
    elif value in (None, "", ()):
        return f.name
    return f"{f.name}={value}"


def tier_keys_help(width: int = 78) -> str:
    """The keys of each tier kind with their defaults, for --help (from the kinds' config
    dataclasses, so it cannot fall behind them)."""
    from kvstored.tiers.registry import KINDS

    lines = ["--tiers keys per kind (name defaults to the kind: fs, then fs-2, ... for a second one):"]
    for label, spec in KINDS.items():
        keys = ", ".join(_tier_key(f) for f in dataclasses.fields(spec.config))
        lines += textwrap.wrap(keys, width, initial_indent=f"  kind={label}: ", subsequent_indent="    ")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    precedence = (
        "Precedence: flags > KVSTORED_* environment > --config TOML file > defaults. "
        'TOML keys are the option names with underscores (cpu_bytes = "8GiB").'
    )
    parser = argparse.ArgumentParser(
        prog="kvstored",
        description="kvstored: a per-node KV-cache store for LLM inference (host RAM -> secondary tiers).",
        epilog="\n".join(textwrap.wrap(precedence, 78)) + "\n\n" + tier_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", nargs="?", choices=["serve"], default="serve", help="what to run (default: serve)")
    parser.add_argument("--version", action="version", version=f"kvstored {__version__}")
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML config file (env KVSTORED_CONFIG)")
    for f in options():
        parser.add_argument(
            flag_name(f.name),
            dest=f.name,
            metavar=f.metadata["metavar"] or None,
            default=None,
            action="append" if f.metadata["repeat"] else "store",
            help=f"{f.metadata['help']}{_shown_default(f)} (env {env_name(f.name)})",
        )
    return parser


NT_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"


def tune_memcpy_and_reexec(argv: list[str]) -> None:
    """glibc switches memcpy to non-temporal (cache-bypassing) stores only above a threshold it
    derives from the L3 size, hundreds of MiB on some VMs; chunk copies of a few MiB then run
    ~0.6x as fast. glibc reads tunables only at process start, so set it and exec ourselves once
    (same pid, so systemd's notify socket still matches)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if NT_TUNABLE in tunables or platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc":
        return
    env = dict(os.environ, GLIBC_TUNABLES=":".join(filter(None, [tunables, f"{NT_TUNABLE}=0x100000"])))
    os.execve(sys.executable, [sys.executable, "-m", "kvstored", *argv], env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    flags = {f.name: getattr(args, f.name) for f in options()}
    try:
        config = load_config(flags, config_file=args.config)
    except ConfigError as exc:
        print(f"kvstored: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if config.tune_memcpy:
        tune_memcpy_and_reexec(argv)
    setup_logging(config.log_level, config.log_format)

    from kvstored.errors import ListenError, TierStartError
    from kvstored.server.daemon import SocketInUse, run
    from kvstored.shm.memory import PoolMemoryError

    try:
        import uvloop

        # SIGHUP re-reads the same sources the daemon started from.
        uvloop.run(run(config, reload_config=lambda: load_config(flags, config_file=args.config)))
    except (TierStartError, PoolMemoryError, ConfigError) as exc:
        # Credentials, a bucket, an unusable root, a pool the machine cannot give: a restart fails
        # the same way, so this is a configuration error (exit 2, which the systemd unit does not
        # restart on). An S3 endpoint that does not answer is not one: the tier starts and retries
        # in the background.
        log.error("%s", exc)
        return EXIT_CONFIG
    except (SocketInUse, ListenError) as exc:
        log.error("%s", exc)
        return 1
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
