# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A namespace-sized delete past a tier's backlog (kvstored/chain/lower.py remove_all): every
removal runs and is reported, but at most DIRECT_REMOVALS of those past the backlog at once."""

from __future__ import annotations

import asyncio

from kvstored.chain.lower import DIRECT_REMOVALS, LowerTier
from kvstored.io.scheduler import TierQueue


class _CountingTier:
    """remove() of a tier that counts the removals under way (the rest of the tier is unused)."""

    name = "counting"

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.removed: list[bytes] = []

    async def remove(self, chunk) -> bool:
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0)
        self.running -= 1
        self.removed.append(chunk[1])
        return chunk[1] != b"absent"


async def test_removals_past_the_backlog_run_a_slice_at_a_time_and_all_are_reported():
    tier = _CountingTier()
    queue = TierQueue("counting", concurrency=2, max_backlog=4)
    queue.start()
    try:
        lower = LowerTier(tier, queue)
        chunks = [("ns", b"%d" % i) for i in range(3 * DIRECT_REMOVALS)] + [("ns", b"absent")]
        removal = await lower.remove_all(chunks)
    finally:
        await queue.close()
    assert sorted(tier.removed) == sorted(key for _, key in chunks)
    assert removal.gone == [key != b"absent" for _, key in chunks] and removal.failures == []
    assert tier.most <= DIRECT_REMOVALS + 2  # (a slice past the backlog, and the queue's workers)
