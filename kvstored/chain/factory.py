# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Build the configured lower tiers, each with its bounded I/O queue and its kind's capabilities."""

from __future__ import annotations

from collections.abc import Sequence

from kvstored.chain.lower import LowerTier
from kvstored.io.scheduler import TierQueue
from kvstored.tiers.config import TierConfig, TierContext
from kvstored.tiers.registry import spec_of


def build_lower_tiers(configs: Sequence[TierConfig], context: TierContext | None = None) -> list[LowerTier]:
    context = context if context is not None else TierContext()
    lower = []
    for cfg in configs:
        spec = spec_of(cfg)
        lower.append(
            LowerTier(
                spec.build(cfg, context),
                TierQueue(cfg.name, cfg.concurrency, cfg.max_backlog),
                capabilities=spec.capabilities,
            )
        )
    return lower
