# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Block identities of vLLM's offloaded chunks, for the daemon's KV events.

vLLM's offloading API names a chunk by its OffloadKey alone (the hash of its last engine
block + group_idx); its tokens and the hashes of its other blocks live in the scheduler's
Request. vLLM's own `OffloadingEventsTracker` snapshots them per OffloadKey when the scheduler
builds a store job (with `self_describing_kv_events` on), which is what vLLM's engine then
publishes for offloaded chunks. The kvstored integrations read the same snapshot
(`tracker_identities`), so the daemon publishes exactly what vLLM's engine would for the same
blocks. `KvstoredOffloadingConnector` (connector.py) hands the scheduler's tracker to them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvstored_client.blocks import BlockIdentity, event_hash

log = logging.getLogger(__name__)

IdentitySource = Callable[[bytes], BlockIdentity | None]  # OffloadKey -> its chunk's identity


def tracker_identities(tracker: Any) -> IdentitySource | None:
    """An IdentitySource reading vLLM 0.33's OffloadingEventsTracker, or None when it records
    nothing (KV events or self_describing_kv_events off) or is not the shape this code knows."""
    if not getattr(tracker, "self_describing_enabled", False):
        return None
    pending = getattr(tracker, "_pending_event_metadata", None)
    if not isinstance(pending, dict):
        log.warning("kvstored: vLLM's OffloadingEventsTracker has no snapshot table; no block identities")
        return None

    def identity(key: bytes) -> BlockIdentity | None:
        meta = pending.get(key)
        if meta is None:
            return None
        return BlockIdentity(
            tuple(event_hash(h) for h in meta.block_hashes),
            event_hash(meta.parent_block_hash) if meta.parent_block_hash is not None else None,
            tuple(meta.token_ids),
            meta.block_size,
            meta.group_idx,
        )

    return identity
