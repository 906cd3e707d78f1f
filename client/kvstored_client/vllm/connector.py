# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""vLLM's OffloadingConnector, with kvstored's tiers given each chunk's block identity.

    "kv_transfer_config": {
        "kv_connector": "KvstoredOffloadingConnector",
        "kv_connector_module_path": "kvstored_client.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"self_describing_kv_events": true, ...as for OffloadingConnector}
    }

Everything is vLLM's connector; only, once it is built, the scheduler's events tracker (see
identity.py) is handed to the kvstored secondary tier and the direct spec's manager, so the
daemon's KV events carry vLLM's per-block hashes and tokens. With vLLM's plain
OffloadingConnector the daemon gets no identities and publishes nothing on ZMQ for these chunks
(vLLM's engine still does, on its own stream).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from kvstored_client.vllm.identity import IdentitySource, tracker_identities

log = logging.getLogger(__name__)


class KvstoredOffloadingConnector(OffloadingConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        scheduler = self.connector_scheduler
        if scheduler is not None:
            attach_identities(scheduler.manager, tracker_identities(getattr(scheduler, "_events_tracker", None)))


def attach_identities(manager: Any, source: IdentitySource | None) -> int:
    """Give `source` to every kvstored tier or manager under `manager`; returns how many."""
    if source is None:
        log.warning(
            "kvstored: no block identities for the daemon's KV events: enable vLLM's KV cache events "
            "and set self_describing_kv_events in kv_connector_extra_config"
        )
        return 0
    found = 0
    for candidate in [manager, *getattr(manager, "secondary_tiers", [])]:
        use = getattr(candidate, "use_identities", None)
        if use is not None:
            use(source)
            found += 1
    return found
