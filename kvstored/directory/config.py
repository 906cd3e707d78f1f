# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The directory's settings (built by the peer tier from its `directory*` keys) and its URL:

    redis://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]      plain TCP
    rediss://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]     TLS (CA: directory_tls_ca_file, else the system's)

The hosts are the cluster's seed nodes (any few of them: the client learns the rest with
CLUSTER SLOTS). USER and PASSWORD (percent-encoded) are Redis 6+ ACL credentials; PASSWORD alone
(`redis://:secret@...`) is the `default` user's, as with `requirepass`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

SCHEMES = {"redis": False, "rediss": True}  # scheme -> TLS


@dataclass(frozen=True)
class DirectoryUrl:
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False

    def redacted(self) -> str:
        """For logs and errors: never the password."""
        scheme = "rediss" if self.tls else "redis"
        auth = f"{self.username or ''}:***@" if self.password is not None else ""
        return f"{scheme}://{auth}" + ",".join(f"{h}:{p}" for h, p in self.nodes)


def parse_url(text: str) -> DirectoryUrl:
    """ValueError (saying what is wrong, never echoing a password) for anything else."""
    scheme, sep, rest = text.strip().partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError("directory: expected redis://HOST:PORT[,HOST:PORT...] or rediss://... (TLS)")
    username = password = None
    auth, at, hosts = rest.rpartition("@")
    if at:
        user, colon, secret = auth.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
        if password is None:  # (redis-py's reading of redis://secret@host: a password alone)
            password, username = username, None
    hosts = hosts.split("/", 1)[0].split("?", 1)[0]
    nodes = []
    for item in hosts.replace("|", ",").split(","):  # ('|' as in the peers key's flag form)
        host, colon, port = item.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"directory: expected HOST:PORT among the hosts, got {item.strip()!r}")
        nodes.append((host.strip("[]"), int(port)))
    return DirectoryUrl(tuple(nodes), username, password, SCHEMES[scheme])


@dataclass(frozen=True)
class DirectorySettings:
    url: DirectoryUrl
    address: str  # this node's control address (HOST:PORT), as the others reach it
    incarnation: int
    interval_s: float = 0.5  # writes and the heartbeat, once per interval
    heartbeat_ttl_s: float = 3.0  # a node whose heartbeat is older holds nothing (its entries are ignored)
    entry_ttl_s: float = 600.0  # a chunk's key lives this long unless re-written (the refresh pass)
    timeout_s: float = 0.1  # a lookup's round trip(s) to the directory, at most
    write_timeout_s: float = 2.0  # one interval's pipelined writes, at most
    buckets: int = 16  # hash-tag buckets per namespace: a lookup touches at most this many slots
    prefix: str = "kvd"  # of every key: fleets sharing a cluster use different prefixes
    breaker_failures: int = 3
    breaker_reset_s: float = 5.0
    tls_ca_file: Path | None = None
    max_pending: int = 1_000_000  # net changes kept while the directory is unreachable
    batch_commands: int = 20_000  # commands per pipelined write batch
