# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""vLLM's own block identity for a prompt: a real Request hashed by vLLM's block hasher, and
vLLM's OffloadingEventsTracker holding the snapshot its scheduler records for each stored chunk."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_offload.base import OffloadingKVEventsConfig, make_offload_key
from vllm.v1.request import Request

BLOCK_SIZE = 16  # the engine's tokens per block
BLOCKS_PER_CHUNK = 4  # the harness's offloaded chunk: 64 tokens

init_none_hash(sha256_cbor)


def prompt(label: str, chunks: int) -> list[int]:
    seed = sum(label.encode()) * 131
    return [(seed + 7 * i) % 32_000 for i in range(chunks * BLOCKS_PER_CHUNK * BLOCK_SIZE)]


class VllmPrompt:
    """One request's chunks as vLLM's scheduler sees them when it stores them."""

    def __init__(self, label: str, chunks: int, tracker: OffloadingEventsTracker | None = None) -> None:
        self.tokens = prompt(label, chunks)
        self.request = Request(
            f"req-{label}",
            self.tokens,
            SamplingParams(max_tokens=1),
            None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256_cbor),
        )
        self.tracker = tracker or new_tracker()
        # (Any: only full attention is asked of it, so kv_cache_spec and manager_cls stay None)
        make_group: Any = GroupOffloadConfig
        group = make_group(
            group_idx=0,
            tokens_per_block=BLOCK_SIZE,
            tokens_per_chunk=BLOCK_SIZE * BLOCKS_PER_CHUNK,
            hashes_per_chunk=BLOCKS_PER_CHUNK,
            kv_event_group_spec=OffloadingEventGroupSpec(None, None),
            sliding_window_size_in_chunks=None,
            kv_cache_spec=None,
            manager_cls=None,
        )
        hashes = self.request.block_hashes
        self.keys = [make_offload_key(hashes[(c + 1) * BLOCKS_PER_CHUNK - 1], 0) for c in range(chunks)]
        for c, key in enumerate(self.keys):  # what _build_store_jobs records
            self.tracker.record_store(self.request, group, c, key)


def new_tracker() -> OffloadingEventsTracker:
    return OffloadingEventsTracker(
        OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=True)
    )
