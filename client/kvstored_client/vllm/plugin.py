"""`vllm.general_plugins` entry point: registers the kvstored tier type and offloading spec.

vLLM loads general plugins in every process (API server, EngineCore, workers), possibly more than
once per process, so registration is idempotent.
"""

from __future__ import annotations

import contextlib

TIER_TYPE = "kvstored"
SPEC_NAME = "KvstoredOffloadingSpec"


def register() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    # Both factories raise ValueError for a name registered already: a second load is a no-op.
    with contextlib.suppress(ValueError):
        SecondaryTierFactory.register_tier(TIER_TYPE, "kvstored_client.vllm.tier", "KvstoredTierManager")
    with contextlib.suppress(ValueError):
        OffloadingSpecFactory.register_spec(SPEC_NAME, "kvstored_client.vllm.direct", SPEC_NAME)
