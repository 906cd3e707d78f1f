# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Domain errors. Each says what was wrong in words a caller can act on; server/errors.py alone
maps them to gRPC status codes."""

from __future__ import annotations

SHOWN_CHARS = 64


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """A value a caller sent, for an error message: its repr, cut to `limit` characters plus
    "..." (an id or path of 16 KiB echoed whole would not fit in a gRPC status)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class KvstoredError(Exception):
    """Base of every error the daemon reports to a caller."""


class InvalidRequest(KvstoredError):
    """Malformed input: wrong key length, offsets outside a region, mismatched list lengths..."""


class UnknownNamespace(KvstoredError):
    pass


class UnknownSession(KvstoredError):
    pass


class UnknownRegion(KvstoredError):
    pass


class RegionFileMissing(KvstoredError):
    pass


class RegionNotAllowed(KvstoredError):
    """A region named by path lies outside the directories the daemon accepts region files from."""


class RegionShrunk(KvstoredError):
    """A registered region file is now smaller than when it was registered."""


class HandleNotHeld(KvstoredError):
    """A lease or reservation released twice, committed twice, or never granted to this session."""


class SessionRequired(KvstoredError):
    """The call needs a session (e.g. registering a tenant namespace)."""


class BatchTooLarge(KvstoredError):
    pass


class PoolExhausted(KvstoredError):
    """Every page of the pool is leased or reserved, so nothing can be evicted to make room."""


class ListenError(Exception):
    """An address the daemon was told to listen on cannot be bound (in use, not local...)."""


class TierStartError(Exception):
    """A configured tier could not start (bad credentials, unusable root...): the daemon exits."""


class ShuttingDown(KvstoredError):
    pass


class TransferNotStarted(KvstoredError):
    """A region transfer could not start within the caller's start_within_ms: nothing was copied."""


class PeerIncompatible(KvstoredError):
    """A peer whose chunk format, namespace-id derivation or namespace sizes differ from this
    daemon's: the two cannot share chunks."""


class PeerTierDisabled(KvstoredError):
    """A peer RPC reached a daemon that has no peer tier."""


class TierUnavailable(KvstoredError):
    """A tier below RAM could not carry out a request (e.g. an S3 DELETE failed): retry later."""


class WatcherLagged(KvstoredError):
    """An event watcher fell further behind than its queue holds."""
