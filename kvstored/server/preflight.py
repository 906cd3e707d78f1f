# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What the daemon checks before it populates its RAM tier (minutes on a large node), so a typo
costs a second: every address it will listen on is free, and every tier below RAM passes its
own preflight (tiers/base.py: an fs root, an S3 bucket and its credentials, a peer tier's data
ports). The sockets and the pool's size are checked before this (daemon.py, shm/memory.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvstored.chain.lower import LowerTier
from kvstored.config import Config, ConfigError
from kvstored.errors import ListenError, TierStartError
from kvstored.events.endpoints import is_bind_endpoint
from kvstored.io.ports import bind_problem, split_host_port

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preflight:
    listeners: tuple[str, ...]  # "metrics 127.0.0.1:9464", ... : free when checked
    tiers: tuple[tuple[str, str], ...]  # (tier name, what its preflight checked)


def listen_addresses(cfg: Config) -> list[tuple[str, str]]:
    """(option, HOST:PORT) of every TCP address the daemon will listen on."""
    found = [("metrics_addr", cfg.metrics_addr), ("tcp_listen", cfg.tcp_listen)]
    for option in ("events_zmq_endpoint", "events_zmq_replay_endpoint"):
        endpoint = getattr(cfg, option)
        if option == "events_zmq_endpoint" and not is_bind_endpoint(endpoint):
            continue  # it connects to a router: nothing here listens
        transport, _, address = endpoint.partition("://")
        if transport == "tcp" and address.rpartition(":")[2].isdigit():  # (ZMQ also takes interface names)
            host, _, port = address.rpartition(":")
            found.append((option, f"{'' if host == '*' else host}:{port}"))
    return [(option, address) for option, address in found if address]


def check_listeners(cfg: Config) -> tuple[str, ...]:
    """ListenError naming the first address that cannot be listened on."""
    checked = []
    for option, address in listen_addresses(cfg):
        host, port = split_host_port(address)
        problem = bind_problem(host, port)
        if problem is not None:
            shown = getattr(cfg, option) if option.startswith("events_zmq") else address  # as configured
            raise ListenError(f"cannot listen on {shown} ({option}): {problem}")
        checked.append(f"{option} {address}")
    return tuple(checked)


def check_files(cfg: Config) -> None:
    """ConfigError naming the first TLS file that cannot be read (a missing Secret on
    Kubernetes, say): later it would end the start only after the populate."""
    files = [("tls_cert_file", cfg.tls_cert_file), ("tls_key_file", cfg.tls_key_file)]
    files.append(("tls_client_ca_file", cfg.tls_client_ca_file))
    files += [(f"tier {t.name}: tls_ca_file", getattr(t, "tls_ca_file", None)) for t in cfg.tiers]
    for option, path in files:
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"{option} {path} cannot be read: {exc.strerror}") from None


async def _tier_preflight(lower: LowerTier) -> str:
    try:
        return await lower.tier.preflight()
    except (ListenError, TierStartError):
        raise
    except Exception as exc:  # noqa: BLE001 - the tier's own words, named
        raise TierStartError(f"cannot start tier {lower.tier.name!r}: {exc}") from exc


async def preflight(cfg: Config, lower: Sequence[LowerTier]) -> Preflight:
    """Run every check (the tiers' concurrently: an unreachable S3 endpoint costs one timeout);
    raise the first failure (ConfigError, ListenError, TierStartError) after all have ended, else log what
    was checked, one line per tier and one for the listeners."""
    check_files(cfg)
    listeners = check_listeners(cfg)
    results = await asyncio.gather(*(_tier_preflight(t) for t in lower), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    report = Preflight(listeners, tuple((t.tier.name, str(r)) for t, r in zip(lower, results)))
    for name, what in report.tiers:
        log.info("checked tier %s: %s", name, what)
    log.info(
        "checked before populating: sockets %s and %s, %s",
        cfg.socket,
        cfg.session_socket,
        ", ".join(f"{listener} free" for listener in listeners) if listeners else "no TCP listeners",
    )
    return report
