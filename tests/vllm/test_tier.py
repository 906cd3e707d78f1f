# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""kvstored as a secondary tier of vLLM's TieringOffloadingManager, driven as the scheduler does."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

import grpc
import numpy as np
import pytest
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadingKVEventsConfig, get_offload_block_hash
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvstored_client.errors import Unavailable
from kvstored_client.vllm.driver import Outcome
from kvstored_client.vllm.plugin import register
from kvstored_client.vllm.tier import KvstoredMetrics, KvstoredTierManager
from tests.support.daemon import short_tmpdir
from tests.vllm.harness import END_OF_STEP, SETTLE_LIMIT_S, Engine, exact, kvstored_tier, offload_keys

HIT, MISS = LookupResult.HIT, LookupResult.MISS

register()  # what vLLM's load_general_plugins() does through the entry point


def daemon_chunks(daemon) -> int:
    return next(t.chunks for t in daemon.stats().tiers if t.name == "ram")


def wait_connected(engine: Engine) -> None:
    """Step the idle engine until the tier has reconnected (after its backoff)."""
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while not engine.tier.connected:
        engine.step()
        assert time.monotonic() < deadline, "the tier never reconnected"
        time.sleep(0.01)


def store_and_cascade(engine: Engine, keys: list[bytes], **request) -> None:
    ctx = engine.request(**request)
    assert engine.store(ctx, keys) == keys
    engine.settle()
    engine.finish(ctx)


def test_store_cascades_and_a_restarted_engine_loads_exact_bytes(vllm_daemon):
    keys = offload_keys("restart", 6)
    with Engine([kvstored_tier(vllm_daemon)]) as first:
        store_and_cascade(first, keys)
    assert daemon_chunks(vllm_daemon) >= len(keys)

    # A vLLM restart: new engine id, new (empty) primary region, same daemon.
    with Engine([kvstored_tier(vllm_daemon)]) as second:
        ctx = second.request()
        with second.manager.lock:
            first_answers = [second.manager.lookup(k, ctx) for k in keys]
        assert first_answers == [LookupResult.RETRY] * len(keys)  # batched: asked at the end of the step
        assert second.lookup(ctx, keys) == [HIT] * len(keys)  # promoted into the primary region
        assert exact(second.load(ctx, keys), keys)
        second.finish(ctx)


def test_one_lookup_rpc_per_step_for_all_requests(vllm_daemon):
    keys = offload_keys("batched", 8)
    with Engine([kvstored_tier(vllm_daemon)]) as engine:
        engine.stats()  # reset counters
        a, b = engine.request(), engine.request()
        with engine.manager.lock:
            for key in keys[:4]:
                assert engine.manager.lookup(key, a) is LookupResult.RETRY
            for key in keys[4:]:
                assert engine.manager.lookup(key, b) is LookupResult.RETRY
        engine.step()
        rpcs = engine.stats().data["data"][KvstoredMetrics.LOOKUP_RPCS]
        assert sum(rpcs.values()) == 1
        assert engine.lookup(a, keys[:4]) == [MISS] * 4
        engine.finish(a)
        engine.finish(b)


def test_two_engines_share_one_copy_of_each_chunk(vllm_daemon):
    keys = offload_keys("shared", 5)
    before = daemon_chunks(vllm_daemon)
    with Engine([kvstored_tier(vllm_daemon)]) as a, Engine([kvstored_tier(vllm_daemon)]) as b:
        store_and_cascade(a, keys)
        ctx = b.request()
        assert b.lookup(ctx, keys) == [HIT] * len(keys)
        assert exact(b.load(ctx, keys), keys)
        b.finish(ctx)
        b.evict_primary()
        store_and_cascade(b, keys)  # the same chunks again, now from b: the daemon has them already
    assert daemon_chunks(vllm_daemon) == before + len(keys)


def test_other_model_or_layout_never_collides(vllm_daemon):
    keys = offload_keys("collide", 3)
    with Engine([kvstored_tier(vllm_daemon)], kv_cache_layout="LBHNC") as writer:
        store_and_cascade(writer, keys)
    for config in (
        {"model": "org/other-model"},
        {"dtype": "float16"},
        {"blocks_per_chunk": 2},
        {"layer_names": ("model.layers.0.attn",)},
        {"kv_cache_layout": "LBNHC"},
    ):
        with Engine([kvstored_tier(vllm_daemon)], **config) as other:
            ctx = other.request()
            assert other.lookup(ctx, keys) == [MISS] * len(keys), config
            other.finish(ctx)
    with Engine([kvstored_tier(vllm_daemon)], kv_cache_layout="LBHNC") as same:
        ctx = same.request()
        assert same.lookup(ctx, keys) == [HIT] * len(keys)
        same.finish(ctx)


def test_cache_salt_scopes_chunks(vllm_daemon):
    keys = offload_keys("salted", 3)
    with Engine([kvstored_tier(vllm_daemon)]) as writer:
        store_and_cascade(writer, keys, kv_transfer_params={"cache_salt": "tenant-a"})
    with Engine([kvstored_tier(vllm_daemon)]) as reader:
        for params, expected in ((None, MISS), ({"cache_salt": "tenant-b"}, MISS), ({"cache_salt": "tenant-a"}, HIT)):
            ctx = reader.request(kv_transfer_params=params)
            assert reader.lookup(ctx, keys) == [expected] * len(keys), params
            if expected is HIT:
                assert exact(reader.load(ctx, keys), keys)
            reader.finish(ctx)


def test_reset_cache_drains_jobs_and_keeps_the_daemon_copy(vllm_daemon):
    keys = offload_keys("drain", 6)
    with Engine([kvstored_tier(vllm_daemon)]) as engine:
        ctx = engine.request()
        engine.store(ctx, keys)  # cascades in flight
        engine.evict_primary()  # drain_jobs() waits for them, then the primary tier is emptied
        assert not engine.tier.has_pending_work()
        engine.finish(ctx)
        ctx = engine.request()
        assert engine.lookup(ctx, keys) == [HIT] * len(keys)
        assert exact(engine.load(ctx, keys), keys)
        engine.finish(ctx)


def test_kv_events_are_well_formed(vllm_daemon):
    keys = offload_keys("events", 4)
    with Engine([kvstored_tier(vllm_daemon)]) as engine:
        store_and_cascade(engine, keys)
        ours = engine.tier_events()
    assert len(ours) == 1 and not ours[0].removed
    assert ours[0].medium is Medium.CPU and ours[0].locality.value == "LOCAL"
    assert ours[0].ownership is None  # routers (Dynamo 1.6.1) drop events with any ownership

    # Through vLLM's own translation and wire encoding.
    tracker = OffloadingEventsTracker(
        OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=False)
    )
    translated = list(tracker.take_events(ours))
    assert all(isinstance(e, BlockStored) for e in translated)
    expected_hashes = [[maybe_convert_block_hash(BlockHash(get_offload_block_hash(k)))] for k in keys]
    assert [e.block_hashes for e in translated] == expected_hashes
    assert {(e.medium, e.ownership, e.locality, e.group_idx) for e in translated} == {("CPU", None, "LOCAL", 0)}
    import msgspec

    wire = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=translated))
    decoded = msgspec.msgpack.decode(wire, type=KVEventBatch)
    assert [e.block_hashes for e in decoded.events] == [e.block_hashes for e in translated]


def test_every_stat_is_declared(vllm_daemon):
    extra = {"cpu_bytes_to_use": 8 << 20, "secondary_tiers": [kvstored_tier(vllm_daemon)]}
    declared = TieringOffloadingSpec.build_metric_definitions(extra)
    with Engine([kvstored_tier(vllm_daemon)]) as engine:
        store_and_cascade(engine, offload_keys("stats", 2))
        ctx = engine.request()
        engine.lookup(ctx, offload_keys("stats-miss", 2))
        engine.finish(ctx)
        emitted = set(engine.stats().data["types"])
    ours = {name for name in emitted if "kvstored" in name}
    assert ours and ours <= set(declared)
    assert emitted <= set(declared)


def test_module_path_form_needs_no_plugin(vllm_daemon):
    config = {
        "type": "KvstoredTierManager",
        "module_path": "kvstored_client.vllm.tier",
        "socket": str(vllm_daemon.socket),
    }  # the alias of kvstored_socket
    assert SecondaryTierFactory.get_tier_class(config) is KvstoredTierManager
    keys = offload_keys("module-path", 2)
    with Engine([config]) as engine:
        store_and_cascade(engine, keys)
    with Engine([kvstored_tier(vllm_daemon)]) as engine:
        ctx = engine.request()
        assert engine.lookup(ctx, keys) == [HIT] * 2
        engine.finish(ctx)


def test_daemon_absent_then_started(own_daemon):
    daemon = own_daemon()
    keys = offload_keys("late-daemon", 3)
    with Engine([kvstored_tier(daemon)]) as engine:  # no daemon yet: nothing raises
        ctx = engine.request()
        assert engine.lookup(ctx, keys) == [MISS] * 3
        assert engine.store(ctx, keys) == keys
        engine.settle()  # the cascade is dropped (a failed cascade job), the primary copy stays
        engine.finish(ctx)

        daemon.start()
        wait_connected(engine)
        more = offload_keys("late-daemon-2", 3)
        store_and_cascade(engine, more)
    assert daemon_chunks(daemon) == 3


def test_daemon_killed_mid_run_gives_misses_then_reconnects(own_daemon):
    daemon = own_daemon().start()
    keys = offload_keys("killed", 4)
    with Engine([kvstored_tier(daemon)]) as engine:
        store_and_cascade(engine, keys)
        engine.evict_primary()

        daemon.kill()  # SIGKILL: no goodbye
        ctx = engine.request()
        assert engine.lookup(ctx, keys) == [MISS] * 4  # the daemon's RAM died with it
        assert engine.store(ctx, offload_keys("killed-later", 2))
        engine.settle()
        engine.finish(ctx)
        assert engine.stats().data["data"][KvstoredMetrics.CONNECTED][("kvstored",)] == 0

        daemon.start()  # a new daemon on the same socket: the tier reconnects by itself
        wait_connected(engine)
        again = offload_keys("killed-again", 3)
        store_and_cascade(engine, again)
        engine.evict_primary()
        ctx = engine.request()
        assert engine.lookup(ctx, again) == [HIT] * 3
        assert exact(engine.load(ctx, again), again)
        engine.finish(ctx)
        opened = engine.stats().data["data"][KvstoredMetrics.SESSIONS_OPENED]
        assert sum(opened.values()) >= 1


def test_daemon_killed_during_a_load_fails_it_and_vllm_recomputes(own_daemon):
    daemon = own_daemon().start()
    keys = offload_keys("load-killed", 4)
    with Engine([kvstored_tier(daemon)]) as engine:
        store_and_cascade(engine, keys)
        engine.evict_primary()
        ctx = engine.request()
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while True:  # until the daemon answered HIT and vLLM queued the promotions
            with engine.manager.lock:
                answers = [engine.manager.lookup(k, ctx) for k in keys]
            if LookupResult.HIT_PENDING in answers:
                break
            engine.step()
            assert time.monotonic() < deadline
            time.sleep(0.002)
        daemon.kill()  # promotions queued (submitted at the end of this step): they fail, nothing raises
        assert engine.lookup(ctx, keys) == [MISS] * 4  # vLLM will recompute these
        engine.finish(ctx)


def drop_lines(caplog) -> list[str]:
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    return [line for line in warnings if "stores dropped" in line]


def test_stopped_daemon_answers_miss_and_drops_stores(own_daemon, caplog):
    caplog.set_level(logging.INFO, logger="kvstored_client")
    daemon = own_daemon().start()
    keys = offload_keys("stopped", 3)
    with Engine([kvstored_tier(daemon, lookup_timeout_s=0.1)]) as engine:
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            ctx = engine.request()
            assert engine.lookup(ctx, keys) == [MISS] * 3  # the lookup deadline passed
            engine.store(ctx, offload_keys("stopped-store", 2))
            engine.step()
            dropped = engine.stats().data["data"].get(KvstoredMetrics.DROPPED_CHUNKS, {})
            assert sum(dropped.values()) == 2  # dropped at once while the daemon is slow
            # ... and said once in vLLM's log, with the metric's reason
            [line] = drop_lines(caplog)
            assert line.startswith(f"kvstored tier at {daemon.socket}: stores dropped 2 chunk(s) (slow): ")
            assert "a lookup missed its deadline" in line
            engine.finish(ctx)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        engine.settle()


@pytest.mark.parametrize("salt", [None, "t"])
def test_unregistered_key_length_is_registered_on_first_use(vllm_daemon, salt):
    keys = [k[4:] for k in offload_keys(f"short-{salt}", 2)]  # 16-byte-hash style keys (32 bytes)
    params = {"cache_salt": salt} if salt else None
    with Engine([kvstored_tier(vllm_daemon)]) as engine:
        store_and_cascade(engine, keys, kv_transfer_params=params)
        ctx = engine.request(kv_transfer_params=params)
        engine.evict_primary()
        assert engine.lookup(ctx, keys) == [HIT] * 2
        engine.finish(ctx)


def test_a_partly_dropped_store_reports_exactly_the_chunks_the_daemon_holds(own_daemon, caplog):
    """RAM with room for one more chunk, the rest leased by another client: of a 4-chunk cascade,
    one is present already, one is stored, two are dropped. The job fails (vLLM keeps its own
    copy); the KV event names exactly the two chunks the daemon holds."""
    from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
    from kvstored_client.vllm.driver import DaemonLink, outcome

    daemon = own_daemon(cpu_bytes="1MiB").start()  # four 256 KiB chunks
    held = offload_keys("held", 3)
    with Engine([kvstored_tier(daemon)]) as first:
        store_and_cascade(first, held)
        namespace_id = first.tier._namespaces.id_for(len(held[0]))
    link = DaemonLink(daemon.socket, "lease-holder")
    try:
        assert link.settle(SETTLE_LIMIT_S)
        leases = outcome(
            link.call("Acquire", pb.AcquireRequest(session_id=link.session_id, namespace_id=namespace_id, keys=held))
        )
        assert leases.ok and len(leases.response.leases) == 3

        new = offload_keys("new", 3)
        with Engine([kvstored_tier(daemon)]) as second:
            ctx = second.request()
            assert second.store(ctx, [held[0], *new]) == [held[0], *new]
            second.settle()
            second.finish(ctx)
            events = second.tier_events()
            dropped = second.stats().data["data"].get(KvstoredMetrics.DROPPED_CHUNKS, {})
        assert [e.keys for e in events] == [[held[0], new[0]]]
        assert daemon_chunks(daemon) == 4
        assert dropped == {("kvstored", "ram_full"): 2}
        assert any(": stores dropped 2 chunk(s) (ram_full): the daemon's reason" in line for line in drop_lines(caplog))
    finally:
        link.close()


def test_chunks_on_the_daemons_fs_tier_count_as_stored_and_stay_out_of_its_ram(own_daemon):
    """After a daemon restart its fs tier holds the chunks: a cascade of them is a stored job for
    vLLM (routers hear of every chunk, nothing is counted dropped), copies nothing into the
    daemon's RAM, and a lookup then a load brings them back byte-exact."""
    root = short_tmpdir("kvfs")
    fs = ["--tiers", f"kind=fs,root={root},bytes=64MiB"]
    try:
        daemon = own_daemon().start(fs)
        keys = offload_keys("on-disk", 4)
        with Engine([kvstored_tier(daemon)]) as first:
            store_and_cascade(first, keys)
        daemon.stop()  # (SIGTERM writes RAM's chunks down)
        daemon.start(fs)
        with Engine([kvstored_tier(daemon)]) as second:
            store_and_cascade(second, keys)
            events = [e for e in second.tier_events() if not e.removed]
            assert [e.keys for e in events] == [keys]
            assert KvstoredMetrics.DROPPED_CHUNKS not in second.stats().data["data"]
            assert daemon_chunks(daemon) == 0
            second.evict_primary()
            ctx = second.request()
            assert second.lookup(ctx, keys) == [HIT] * len(keys)
            assert exact(second.load(ctx, keys), keys)
            second.finish(ctx)
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.mark.parametrize("daemon_up", [True, False], ids=["daemon_up", "daemon_down"])
def test_empty_store_and_load_jobs_succeed(own_daemon, daemon_up):
    """vLLM's secondary-tier contract: store and load batches of any size, the empty one included,
    succeed (a failed empty job counts as a failed cascade or promotion)."""
    daemon = own_daemon().start()
    with Engine([kvstored_tier(daemon)]) as engine:
        wait_connected(engine)
        if not daemon_up:
            daemon.stop()
        ctx = engine.request()
        empty = np.zeros(0, dtype=np.int64)
        engine.tier.submit_store(TransferJob(job_id=101, keys=[], chunk_ids=empty, is_promotion=False, req_context=ctx))
        engine.tier.submit_load(TransferJob(job_id=102, keys=[], chunk_ids=empty, is_promotion=True, req_context=ctx))
        results = {r.job_id: r for r in engine.tier.get_finished_jobs()}
        assert sorted(results) == [101, 102]
        assert all(r.success and r.transfer_bytes == 0 for r in results.values())
        dropped = engine.stats().data["data"].get(KvstoredMetrics.DROPPED_CHUNKS, {})
        assert sum(dropped.values()) == 0
        engine.finish(ctx)


def test_chunks_in_the_daemons_ram_are_found_in_its_key_index_without_a_lookup_rpc(vllm_daemon):
    """A key the daemon's RAM holds is a HIT on the first ask, from the namespace's key index
    (mapped in the tier's process once the namespace is registered): no Lookup RPC, no RETRY
    step; its hits are posted to the daemon as one Touch per step."""
    keys = offload_keys("key-index", 6)
    with Engine([kvstored_tier(vllm_daemon)]) as writer:
        store_and_cascade(writer, keys)
    with Engine([kvstored_tier(vllm_daemon)]) as reader:
        tier = reader.tier
        probe = reader.request()
        assert reader.lookup(probe, offload_keys("key-index-absent", 1)) == [MISS]  # maps the index meanwhile
        reader.finish(probe)
        assert any(index is not None for index in tier.link.indexes.values()), tier.link.indexes
        ram = next(t for t in vllm_daemon.stats().tiers if t.name == "ram")
        reader.stats()  # reset counters
        ctx = reader.request()
        with reader.manager.lock:
            first = [reader.manager.lookup(key, ctx) for key in keys]
        assert LookupResult.RETRY not in first, first
        assert reader.lookup(ctx, keys) == [HIT] * len(keys)
        assert exact(reader.load(ctx, keys), keys)
        reader.finish(ctx)
        data = reader.stats().data["data"]
        assert sum(data.get(KvstoredMetrics.LOOKUP_RPCS, {}).values()) == 0  # nothing fell back to the daemon
        local_hits = sum(data[KvstoredMetrics.LOCAL_HITS].values())
        assert local_hits == len(keys)
        reader.settle()
        after = next(t for t in vllm_daemon.stats().tiers if t.name == "ram")
        # The Touches (each key named once, with the lookups it answered) count every one of them.
        assert (after.lookups - ram.lookups, after.hits - ram.hits) == (local_hits, local_hits)


MARK = 0xEE
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def _unavailable_answer(engine: Engine) -> None:
    """What namespace_ready() does with a RegisterNamespace answered UNAVAILABLE (gRPC stops
    before the session socket in a graceful stop): the session socket itself is fine."""
    engine.tier.link.on_rpc_error(Outcome(error=Unavailable("RegisterNamespace: UNAVAILABLE"), code=UNAVAILABLE))


def _no_open_index_answer(engine: Engine) -> None:
    """What the link does with an OpenIndex (OpenArena) unanswered within the connect timeout:
    it ends the session, while the daemon lives."""
    engine.tier.link.fail(Unavailable("kvstored did not answer OpenIndex within 1.0s"))


@pytest.mark.parametrize("trigger", [_unavailable_answer, _no_open_index_answer], ids=["unavailable", "open_index"])
def test_a_load_ends_only_once_the_daemon_stopped_writing_its_slots(own_daemon, trigger):
    """The session ends (or is thought to) for a client-side reason while a load is copying into
    the primary region: the load is reported (and its slots given back to vLLM) only once the
    daemon no longer writes them, never while its copy still runs."""
    daemon = own_daemon(cpu_bytes="512MiB", populate=False).start()
    keys = offload_keys("early-fail", 16)
    with Engine([kvstored_tier(daemon)], cpu_bytes=300 << 20, bytes_per_block=4 << 20, blocks_per_chunk=4) as engine:
        store_and_cascade(engine, keys)
        engine.evict_primary()
        tier = engine.tier
        running = 0  # times the copies were under way when the session ended
        for delay in (0.0, 0.001, 0.003, 0.006, 0.01, 0.015, 0.02, 0.03, 0.0, 0.002, 0.004, 0.008):
            ctx = engine.request()
            deadline = time.monotonic() + SETTLE_LIMIT_S
            while True:  # until the daemon answered HIT and vLLM queued the promotions
                with engine.manager.lock:
                    answers = [engine.manager.lookup(k, ctx) for k in keys]
                if all(a is LookupResult.HIT_PENDING for a in answers):
                    break
                engine.step()
                assert time.monotonic() < deadline
                time.sleep(0.002)
            with engine.manager.lock:
                engine.manager.on_schedule_end(END_OF_STEP)  # the loads are sent
                [transfer] = [t for t in tier._running.values() if t.is_load]
                rows = [(o - tier._region_base) // tier.block_size_bytes for o in transfer.offsets]
            time.sleep(delay)
            with engine.manager.lock:
                running += any(getattr(f, "answer", None) is None for f, _ in transfer.futures)
                trigger(engine)
            while True:  # vLLM's own poll, until the job is reported
                with engine.manager.lock:
                    engine.manager._process_finished_jobs()
                    if transfer.job_id not in engine.manager._jobs:
                        break
                assert time.monotonic() < deadline, "the load was never reported"
                time.sleep(0.001)
            # vLLM freed those primary slots: its next GPU->CPU store writes there
            for r in rows:
                engine.rows[r] = MARK
            time.sleep(0.3)
            overwritten = [r for r in rows if not (engine.rows[r] == MARK).all()]
            assert not overwritten, f"delay {delay}: the daemon wrote slots after the tier reported the load"
            engine.finish(ctx)
            wait_connected(engine)
            engine.evict_primary()  # (a load that succeeded put them in the primary tier)
        assert running, "every load had ended before the session did: nothing was tested"
