# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What names a chunk and where it is: shared by the chain, the tiers, events and the peer code."""

from __future__ import annotations

import enum

from kvstored_client.kinds import TierKind  # one enum for daemon, client and proto; NONE (0) is a miss

__all__ = ["ChunkId", "RemovalCause", "TierKind"]

ChunkId = tuple[str, bytes]  # (namespace id, key): keys are opaque bytes scoped by namespace


class RemovalCause(enum.Enum):
    """Why a tier dropped a chunk on its own."""

    EVICTED = enum.auto()  # the tier's own capacity bound
    CORRUPT = enum.auto()  # failed verification
    DELETED = enum.auto()  # deleted through another daemon sharing the store
