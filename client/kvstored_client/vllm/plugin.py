# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""`vllm.general_plugins` entry point: registers the kvstored tier type and offloading spec.

vLLM loads general plugins in every process (API server, EngineCore, workers), possibly more than
once per process, so registration is idempotent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

TIER_TYPE = "kvstored"
SPEC_NAME = "KvstoredOffloadingSpec"
# The daemon's socket has one name in both modes (a tier's config dict, the spec's
# kv_connector_extra_config); mode 1 also takes its first name, `socket`.
SOCKET_OPTION = "kvstored_socket"
SOCKET_ALIASES = ("socket",)


def socket_option(options: Mapping[str, Any]) -> str | None:
    """The socket named in `options` under `kvstored_socket` or an alias (None: not given).
    Two names for different sockets are refused: which one was meant cannot be known."""
    given = {name: str(options[name]) for name in (SOCKET_OPTION, *SOCKET_ALIASES) if options.get(name)}
    if len(set(given.values())) > 1:
        raise ValueError(
            f"kvstored: {' and '.join(f'{k}={v!r}' for k, v in given.items())} name different "
            f"sockets; give {SOCKET_OPTION} alone"
        )
    return next(iter(given.values()), None)


def register() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    # Both factories raise ValueError for a name registered already: a second load is a no-op.
    with contextlib.suppress(ValueError):
        SecondaryTierFactory.register_tier(TIER_TYPE, "kvstored_client.vllm.tier", "KvstoredTierManager")
    with contextlib.suppress(ValueError):
        OffloadingSpecFactory.register_spec(SPEC_NAME, "kvstored_client.vllm.direct", SPEC_NAME)
