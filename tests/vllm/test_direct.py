# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The direct spec: scheduler-side manager + workers copying CPU "GPU" tensors into the daemon's pool."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvstored_client import Tier
from kvstored_client.vllm.direct import KvstoredOffloadingSpec
from kvstored_client.vllm.plugin import register
from tests.support.daemon import short_tmpdir
from tests.support.data import make_keys, payloads
from tests.vllm.harness import END_OF_STEP, SETTLE_LIMIT_S, offload_keys, offloading_config

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
PAGE, LAYERS, BPC, NUM_BLOCKS = 4096, 3, 4, 64

register()


class DirectEngine:
    """One vLLM engine in direct mode: the scheduler's manager and one worker per rank, each
    with its own KV cache (CPU tensors standing in for the GPU)."""

    def __init__(self, daemon, world_size: int = 1, seed: int = 0, **config) -> None:
        engine_id = f"direct-{uuid.uuid4().hex[:8]}"
        extra = {"spec_name": "KvstoredOffloadingSpec", "kvstored_socket": str(daemon.socket)}

        def make_spec(rank):
            return OffloadingSpecFactory.create_spec(
                offloading_config(
                    extra,
                    engine_id=engine_id,
                    bytes_per_block=PAGE * LAYERS,
                    blocks_per_chunk=BPC,
                    rank=rank,
                    world_size=world_size,
                    **config,
                )
            )

        self.spec = make_spec(0)
        self.manager = self.spec.get_manager()
        gen = torch.Generator().manual_seed(seed)
        self.caches, self.workers = [], []
        for rank in range(world_size):
            tensors = [
                torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen) for _ in range(LAYERS)
            ]
            self.caches.append(tensors)
            kv = CanonicalKVCaches(
                tensors=[CanonicalKVCacheTensor(t, PAGE) for t in tensors],
                group_data_refs=[[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]],
            )
            self.workers.append(make_spec(rank).get_worker(kv))
        self._job = 0

    def request(self, params=None) -> ReqContext:
        ctx = ReqContext(req_id=uuid.uuid4().hex, kv_transfer_params=params)
        self.manager.on_new_request(ctx)
        return ctx

    def _run(self, submit, workers=None) -> list:
        self._job += 1
        job = self._job
        workers = self.workers if workers is None else workers
        for w in workers:
            assert submit(w, job)
        results = []
        deadline = time.monotonic() + SETTLE_LIMIT_S
        for w in workers:
            while True:
                done = [r for r in w.get_finished() if r.job_id == job]
                if done:
                    results.extend(done)
                    break
                assert time.monotonic() < deadline, "worker job never finished"
                time.sleep(0.001)
        return results

    def store(self, ctx, keys, blocks, workers=None) -> list:
        out = self.manager.prepare_store(keys, ctx)
        stored = set(out.keys_to_store)
        src = [b for i, k in enumerate(keys) if k in stored for b in blocks[i * BPC : (i + 1) * BPC]]
        first = next((i for i, k in enumerate(keys) if k in stored), 0) * BPC
        spec = GPULoadStoreSpec(src, group_sizes=[len(src)], block_indices=[first])
        results = self._run(lambda w, job: w.submit_store(job, spec, out.store_spec), workers)
        assert all(r.success for r in results)
        self.manager.complete_store(out.keys_to_store, ctx)
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while any(w.has_pending_work() for w in workers or self.workers):  # commits still in flight
            for w in workers or self.workers:
                w.get_finished()
            assert time.monotonic() < deadline
            time.sleep(0.001)
        return out.keys_to_store

    def lookup(self, ctx, keys) -> list:
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while True:
            results = [self.manager.lookup(k, ctx) for k in keys]
            self.manager.on_schedule_end(END_OF_STEP)
            if RETRY not in results:
                return results
            assert time.monotonic() < deadline
            time.sleep(0.002)

    def load(self, ctx, keys, blocks, first_block: int = 0) -> None:
        src = self.manager.prepare_load(keys, ctx)
        spec = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[first_block])
        results = self._run(lambda w, job: w.submit_load(job, src, spec))
        assert all(r.success for r in results)
        self.manager.complete_load(keys, ctx)

    def settle(self) -> None:
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while self.manager.has_pending_work():
            self.manager.on_schedule_end(END_OF_STEP)
            assert time.monotonic() < deadline
            time.sleep(0.002)

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.manager.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def same_blocks(a: DirectEngine, a_blocks, b: DirectEngine, b_blocks) -> bool:
    return all(
        torch.equal(ta[x], tb[y])
        for ca, cb in zip(a.caches, b.caches)
        for ta, tb in zip(ca, cb)
        for x, y in zip(a_blocks, b_blocks)
    )


def test_store_then_another_engine_loads_exact_blocks(vllm_daemon):
    keys = offload_keys("direct", 3)
    src_blocks = [9, 3, 4, 5, 40, 41, 42, 43, 17, 16, 15, 14]
    with DirectEngine(vllm_daemon, seed=1) as writer:
        ctx = writer.request()
        assert writer.store(ctx, keys, src_blocks) == keys
        writer.manager.on_request_finished(ctx)

        with DirectEngine(vllm_daemon, seed=2) as reader:  # a vLLM restart: nothing in its GPU cache
            ctx = reader.request()
            assert [reader.manager.lookup(k, ctx) for k in keys] == [RETRY] * 3
            assert reader.lookup(ctx, keys) == [HIT] * 3
            dst_blocks = list(range(50, 62))
            assert not same_blocks(writer, src_blocks, reader, dst_blocks)
            reader.load(ctx, keys, dst_blocks)
            assert same_blocks(writer, src_blocks, reader, dst_blocks)
            reader.manager.on_request_finished(ctx)
            reader.settle()
            assert not reader.manager._leases  # every lease went back


def test_partial_first_chunk_and_prefix_semantics(vllm_daemon):
    keys = offload_keys("direct-partial", 3)
    src_blocks = list(range(12))
    with DirectEngine(vllm_daemon, seed=3) as writer:
        ctx = writer.request()
        writer.store(ctx, keys[:2], src_blocks[:8])
        with DirectEngine(vllm_daemon, seed=4) as reader:
            ctx = reader.request()
            assert reader.lookup(ctx, keys) == [HIT, HIT, MISS]
            # The GPU already holds the first 2 blocks: load blocks 2..7 (skip 2 into chunk 0).
            reader.load(ctx, keys[:2], [30, 31, 32, 33, 34, 35], first_block=2)
            assert same_blocks(writer, src_blocks[2:8], reader, [30, 31, 32, 33, 34, 35])
            reader.manager.on_request_finished(ctx)


def test_tensor_parallel_chunk_hits_only_when_every_rank_stored(vllm_daemon):
    keys = offload_keys("direct-tp", 2)
    blocks = list(range(8))
    with DirectEngine(vllm_daemon, world_size=2, seed=5) as writer:
        ctx = writer.request()
        writer.store(ctx, keys, blocks, workers=writer.workers[:1])  # rank 1's part missing
        with DirectEngine(vllm_daemon, world_size=2, seed=6) as reader:
            probe = reader.request()
            assert reader.lookup(probe, keys) == [MISS, MISS]
            reader.manager.on_request_finished(probe)
            writer.store(ctx, keys, blocks, workers=writer.workers[1:])
            ctx2 = reader.request()
            assert reader.lookup(ctx2, keys) == [HIT, HIT]
            reader.load(ctx2, keys, list(range(20, 28)))
            assert same_blocks(writer, blocks, reader, list(range(20, 28)))  # both ranks' caches
            reader.manager.on_request_finished(ctx2)


def test_other_layout_and_cache_salt_never_collide(vllm_daemon):
    keys = offload_keys("direct-scope", 2)
    with DirectEngine(vllm_daemon, seed=7) as writer:
        ctx = writer.request({"cache_salt": "a"})
        writer.store(ctx, keys, list(range(8)))
        with DirectEngine(vllm_daemon, seed=8, model="org/other") as other:
            assert other.lookup(other.request({"cache_salt": "a"}), keys) == [MISS, MISS]
        with DirectEngine(vllm_daemon, seed=9) as reader:
            assert reader.lookup(reader.request(), keys) == [MISS, MISS]
            assert reader.lookup(reader.request({"cache_salt": "a"}), keys) == [HIT, HIT]


def test_cache_salted_chunks_round_trip_through_the_tenants_arena(vllm_daemon):
    """A request's cache_salt puts its chunks in the tenant's own arena: the writer's workers
    store into it, another engine's workers open it (registering the namespace) and load the
    exact blocks; the public pool holds none of them."""
    keys = offload_keys("direct-salted", 2)
    src_blocks = list(range(8))
    with DirectEngine(vllm_daemon, world_size=2, seed=11) as writer:
        ctx = writer.request({"cache_salt": "tenant-x"})
        assert writer.store(ctx, keys, src_blocks) == keys
        writer.manager.on_request_finished(ctx)
        for w in writer.workers:
            engine = w._engine
            public = engine.pools[engine.link.pool_id].array
            assert len(engine.pools) == 2  # the pool, and the tenant's arena
            for cache in writer.caches:
                for t in cache:
                    assert bytes(t[0].numpy()) not in bytes(public)
        with DirectEngine(vllm_daemon, world_size=2, seed=12) as reader:
            ctx = reader.request({"cache_salt": "tenant-x"})
            assert reader.lookup(ctx, keys) == [HIT, HIT]
            dst_blocks = list(range(30, 38))
            assert not same_blocks(writer, src_blocks, reader, dst_blocks)
            reader.load(ctx, keys, dst_blocks)
            assert same_blocks(writer, src_blocks, reader, dst_blocks)
            reader.manager.on_request_finished(ctx)
            reader.settle()


def test_daemon_down_gives_misses_and_dropped_stores(own_daemon, caplog):
    daemon = own_daemon().start()
    keys = offload_keys("direct-down", 2)
    with DirectEngine(daemon, seed=10) as engine:
        daemon.kill()
        ctx = engine.request()
        assert engine.lookup(ctx, keys) == [MISS, MISS]
        engine.store(ctx, keys, list(range(8)))  # reported done, nothing stored
        said = [r.getMessage() for r in caplog.records if "stores dropped" in r.getMessage()]
        assert said and all(r.levelno == logging.WARNING for r in caplog.records if "stores dropped" in r.getMessage())
        assert said[0].startswith(f"kvstored direct spec at {daemon.socket}: stores dropped ")
        assert "(unavailable): the daemon was unreachable" in said[0]
        daemon.start()
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while not engine.manager.connected:
            engine.manager.on_schedule_end(END_OF_STEP)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ctx = engine.request()
        assert engine.lookup(ctx, keys) == [MISS, MISS]  # the killed daemon's RAM is gone
        engine.store(ctx, keys, list(range(8)))  # the worker reconnects and maps the new pool
        ctx = engine.request()
        assert engine.lookup(ctx, keys) == [HIT, HIT]


def test_a_load_right_after_a_daemon_restart_waits_for_the_worker_to_reconnect(own_daemon):
    """The scheduler's link comes back first and leases chunks of the restarted daemon while the
    worker's link is still in its backoff: the load waits for the worker to map the new pool
    (vLLM asserts that loads succeed), then moves the exact bytes."""
    daemon = own_daemon(cpu_bytes="32MiB").start()
    keys = offload_keys("direct-restart", 2)
    with DirectEngine(daemon, seed=11) as engine:
        worker = engine.workers[0]
        daemon.kill()
        for _ in range(5):  # the worker notices, and each failed reconnect doubles its backoff
            worker.get_finished()
            time.sleep(0.2)
        daemon.start()
        with DirectEngine(daemon, seed=12) as other:  # another vLLM stores a prefix in the new run
            ctx = other.request()
            other.store(ctx, keys, list(range(8)))
            ctx = engine.request()
            assert engine.lookup(ctx, keys) == [HIT, HIT]
            engine.load(ctx, keys, list(range(8, 16)))  # asserts the job succeeded
            assert same_blocks(engine, list(range(8, 16)), other, list(range(8)))


def test_a_load_leased_before_a_hand_over_copies_the_leased_bytes(own_daemon):
    """The scheduler leased the chunks (lookup: HIT), then the daemon handed its RAM over to a
    new one, which another client fills: vLLM still loads (it takes every load as done), and the
    worker copies from the same pool pages. The new daemon keeps those leased chunks where they
    are (held leases), so the worker gets their exact bytes, not another chunk's."""
    wd = short_tmpdir("kvdl")
    (wd / "a").mkdir()
    (wd / "b").mkdir()
    old = own_daemon(socket=wd / "kv.sock", workdir=wd / "a", cpu_bytes="16MiB").start()
    new = own_daemon(socket=wd / "kv.sock", workdir=wd / "b", cpu_bytes="16MiB")
    keys = offload_keys("direct-handover", 2)
    with DirectEngine(old, seed=31) as engine:
        engine.store(engine.request(), keys, list(range(8)))
        ctx = engine.request()
        assert engine.lookup(ctx, keys) == [HIT, HIT]  # the scheduler holds their leases
        new.spawn()  # the hand-over: the old daemon stops, and the new one adopts its RAM
        assert old.wait() == 0, old.log
        new.wait_ready()
        assert "RAM tier adopted: 2 chunks" in new.log
        filler = make_keys("filler", 320)  # 20 MiB of other chunks in a 16 MiB pool
        with new.client() as other:
            ns = other.register_namespace(model="filler", dtype="u8", chunk_bytes=64 << 10)
            for i in range(0, len(filler), 32):
                other.store(ns, filler[i : i + 32], payloads(filler[i : i + 32], 64 << 10))
            assert other.lookup(ns, filler).tiers.count(Tier.RAM) > 200
        engine.load(ctx, keys, list(range(8, 16)))
        assert same_blocks(engine, list(range(8, 16)), engine, list(range(8))), "the worker copied another chunk"
        assert "and 2 leased chunk(s) of ended session" in new.log


def test_leases_answered_in_a_session_that_ended_are_not_hits(own_daemon):
    """An Acquire answered in one session and collected after the link reset: the daemon freed
    those leases with the session, so they must not become HITs pointing at reused pages."""
    from kvstored_client.errors import Unavailable
    from tests.support.wait import wait_for

    daemon = own_daemon(cpu_bytes="32MiB").start()
    keys = offload_keys("stale-lease", 2)
    with DirectEngine(daemon, seed=21) as writer, DirectEngine(daemon, seed=22) as reader:
        writer.store(writer.request(), keys, list(range(8)))
        manager = reader.manager
        ctx = reader.request()
        assert [manager.lookup(k, ctx) for k in keys] == [RETRY, RETRY]
        manager.on_schedule_end(END_OF_STEP)  # the Acquire goes out
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while not all(call.future.done() for call in manager._acquires):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        manager._link.fail(Unavailable("reset for the test"), backoff=False)
        assert manager._link.settle(SETTLE_LIMIT_S)
        assert wait_for(lambda: daemon.stats().leases == 0)
        assert [manager.lookup(k, ctx) for k in keys] == [MISS, MISS]  # answered in the old session
        assert not manager._leases
        assert reader.lookup(reader.request(), keys) == [HIT, HIT]  # asked again: fresh leases
        assert daemon.stats().leases == 2


def test_a_worker_whose_kv_cache_does_not_match_the_config_fails_at_start(vllm_daemon):
    """vLLM's config says how many bytes a block takes; a worker whose KV cache tensors add up to
    another size would fail every store and load: it is refused when vLLM makes it, naming both."""
    extra = {"spec_name": "KvstoredOffloadingSpec", "kvstored_socket": str(vllm_daemon.socket)}
    config = offloading_config(extra, engine_id="direct-mismatch", bytes_per_block=PAGE * LAYERS, blocks_per_chunk=BPC)
    spec = OffloadingSpecFactory.create_spec(config)
    tensors = [torch.zeros((NUM_BLOCKS, PAGE), dtype=torch.int8) for _ in range(LAYERS - 1)]  # a layer short
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS - 1)]],
    )
    with pytest.raises(ValueError) as raised:
        spec.get_worker(kv)
    said = str(raised.value)
    assert f"chunk parts of {PAGE * (LAYERS - 1) * BPC} bytes" in said, said
    assert f"vLLM's config gives {PAGE * LAYERS * BPC}" in said, said


def test_spec_is_registered_by_the_plugin():
    assert OffloadingSpecFactory.get_spec_cls({"spec_name": "KvstoredOffloadingSpec"}) is KvstoredOffloadingSpec
    assert (
        OffloadingSpecFactory.get_spec_cls(
            {"spec_name": "KvstoredOffloadingSpec", "spec_module_path": "kvstored_client.vllm.direct"}
        )
        is KvstoredOffloadingSpec
    )
