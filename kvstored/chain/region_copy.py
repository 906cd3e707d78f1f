# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Byte copies between a client region and the pool or staging, in the chain's copy threads."""

from __future__ import annotations

import numpy as np

from kvstored.errors import RegionShrunk, UnknownRegion
from kvstored.shm.copier import Copier, CopyJob
from kvstored.shm.copy import MappingVanished
from kvstored.shm.mapping import Region


class RegionCopies:
    def __init__(self, threads: int) -> None:
        self._copier = Copier(threads)

    async def copy(self, region: Region, pool: np.ndarray, jobs: list[CopyJob], to_pool: bool) -> None:
        """Copy `jobs` between `region` and `pool` (an arena's array, or staging's)."""
        if not jobs:
            return
        if region.closed:  # (a long region load goes on between copies: its session may end meanwhile)
            raise UnknownRegion(
                f"region {region.region_id} ({region.name}) was closed during the transfer (its session ended)"
            )
        try:
            await self._copier.run(region.array, pool, jobs, to_pool)
        except MappingVanished:
            raise RegionShrunk(
                f"region {region.region_id} ({region.name}) shrank during the copy: register it again"
            ) from None

    def close(self) -> None:
        self._copier.close()
