# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Drive vLLM's own TieringOffloadingManager the way OffloadingConnectorScheduler does.

Per engine step the scheduler calls, under `manager.lock`: lookup() for waiting requests,
prepare_load() / prepare_store() for scheduled ones, complete_*() when workers report, and last
on_schedule_end(). Here the "worker" is the test itself writing or reading rows of the primary
region (chunk c is row c of the region's memoryview, as vLLM's CPU worker sees it).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterable
from typing import Any, cast

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from tests.support.data import payload

END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
SETTLE_LIMIT_S = 30.0  # a hang guard, not a timing assertion
UNSETTLED = (LookupResult.RETRY, LookupResult.HIT_PENDING)


def offload_keys(label: str, n: int, group: int = 0) -> list[bytes]:
    """n OffloadKeys (32-byte block hash + 4-byte group index), as vLLM makes them."""
    return [make_offload_key(hashlib.sha256(f"{label}/{i}".encode()).digest(), group) for i in range(n)]


def offloading_config(
    extra_config: dict[str, Any],
    *,
    engine_id: str | None = None,
    model: str = "org/test-model",
    dtype: str = "bfloat16",
    bytes_per_block: int = 64 << 10,
    blocks_per_chunk: int = 4,
    tokens_per_block: int = 16,
    layer_names: tuple[str, ...] = ("model.layers.0.attn", "model.layers.1.attn"),
    enable_events: bool = True,
    rank: int = 0,
    world_size: int = 1,
    kv_cache_layout: str | None = None,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=tokens_per_block, layer_names=layer_names, group_id=0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=enable_events,
        extra_config=extra_config,
        engine_id=engine_id or f"test-{uuid.uuid4().hex[:12]}",
        kv_cache_layout=kv_cache_layout,
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def kvstored_tier(daemon, **options) -> dict[str, Any]:
    return {"type": "kvstored", "kvstored_socket": str(daemon.socket), **options}


class Engine:
    """One vLLM engine's scheduler-side offloading manager (TieringOffloadingSpec.get_manager())."""

    def __init__(self, secondary_tiers: list[dict[str, Any]], *, cpu_bytes: int = 8 << 20, **config: Any) -> None:
        extra = {"cpu_bytes_to_use": cpu_bytes, "secondary_tiers": secondary_tiers}
        self.spec = TieringOffloadingSpec(offloading_config(extra, **config))
        # a TieringOffloadingManager, typed as the OffloadingManager base (no primary_tier there); keys
        # are raw bytes here, vLLM's OffloadKey is a NewType of bytes
        self.manager: Any = cast(Any, self.spec.get_manager())
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.chunk_bytes = self.rows.shape[1]
        self._closed = False

    @property
    def tier(self):
        return self.manager.secondary_tiers[0]

    def request(self, req_id: str | None = None, kv_transfer_params: dict | None = None) -> ReqContext:
        ctx = ReqContext(req_id=req_id or uuid.uuid4().hex, kv_transfer_params=kv_transfer_params)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def finish(self, ctx: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(END_OF_STEP)

    def settle(self) -> None:
        """Step until no transfer or lookup is in flight (what an idle engine does)."""
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while True:
            with self.manager.lock:
                self.manager.on_schedule_end(END_OF_STEP)
                if not self.manager.has_pending_work():
                    return
            assert time.monotonic() < deadline, "offloading manager never settled"
            time.sleep(0.002)

    def store(self, ctx: ReqContext, keys: list[bytes]) -> list[bytes]:
        """GPU -> primary for `keys` (payload derived from each key), then complete_store, which
        cascades to the secondary tiers. Returns the keys the primary tier accepted."""
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
        assert out is not None, "primary tier has no room"
        if not out.keys_to_store:  # all present already: the scheduler has nothing to transfer
            return []
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.rows[chunk] = payload(key, self.chunk_bytes)
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, ctx)
            self.manager.on_schedule_end(END_OF_STEP)
        return list(out.keys_to_store)

    def lookup(self, ctx: ReqContext, keys: Iterable[bytes]) -> list[LookupResult]:
        """Look `keys` up step after step, as the scheduler does, until no answer is RETRY or
        HIT_PENDING any more (a HIT from a secondary tier is promoted meanwhile)."""
        keys = list(keys)
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while True:
            with self.manager.lock:
                results = [self.manager.lookup(key, ctx) for key in keys]
                self.manager.on_schedule_end(END_OF_STEP)
            if not any(r in UNSETTLED for r in results):
                return results
            assert time.monotonic() < deadline, f"lookups never settled: {results}"
            time.sleep(0.002)

    def load(self, ctx: ReqContext, keys: list[bytes]) -> list[np.ndarray]:
        """primary -> "GPU": the bytes of each key's primary chunk."""
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, ctx)
        data = [self.rows[chunk].copy() for chunk in spec.chunk_ids]
        with self.manager.lock:
            self.manager.complete_load(keys, ctx)
        return data

    def evict_primary(self) -> None:
        """Empty the primary tier (vLLM's reset_cache: drains tier jobs first)."""
        with self.manager.lock:
            self.manager.reset_cache()
            self.manager.on_reset_flushed()

    def events(self) -> list:
        with self.manager.lock:
            return list(self.manager.take_events())

    def tier_events(self) -> list:
        """The events of the (first) secondary tier alone."""
        with self.manager.lock:
            return list(self.tier.take_events())

    def stats(self):
        with self.manager.lock:
            return self.manager.get_stats()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self.rows  # release the exported view so vLLM can unmap its region
        self.manager.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def exact(data: list[np.ndarray], keys: list[bytes]) -> bool:
    return all(np.array_equal(chunk, payload(key, chunk.shape[0])) for chunk, key in zip(data, keys))
