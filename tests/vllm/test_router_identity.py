# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What the daemon publishes for chunks vLLM's TieringOffloadingManager stores through the
kvstored tier equals what vLLM's own OffloadingEventsTracker publishes for the same blocks."""

from __future__ import annotations

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvstored_client.vllm.connector import attach_identities
from kvstored_client.vllm.identity import tracker_identities
from kvstored_client.vllm.plugin import register
from tests.support.ports import free_port
from tests.support.wait import wait_for
from tests.support.zmq_events import replay
from tests.vllm.harness import Engine, kvstored_tier, offload_keys
from tests.vllm.vllm_blocks import BLOCK_SIZE, VllmPrompt

register()
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def _daemon_events(replay_port: int) -> list:
    """What the daemon published after seq 0 (AllBlocksCleared, as it starts)."""
    return [e for _, _, payload in replay(replay_port, 1) for e in DECODER.decode(payload).events]


def test_the_daemon_publishes_the_blocks_vllms_tracker_publishes(own_daemon):
    replay_port = free_port()
    daemon = own_daemon().start(
        [
            "--events-zmq-endpoint",
            f"tcp://127.0.0.1:{free_port()}",
            "--events-zmq-replay-endpoint",
            f"tcp://127.0.0.1:{replay_port}",
        ]
    )
    p = VllmPrompt("same-blocks", 3)
    with Engine([kvstored_tier(daemon)]) as engine:
        assert attach_identities(engine.manager, tracker_identities(p.tracker)) == 1
        ctx = engine.request()
        assert engine.store(ctx, p.keys) == p.keys
        engine.settle()
        engine.finish(ctx)
        vllm_events = list(p.tracker.take_events(engine.tier_events()))  # vLLM's own translation
        assert wait_for(lambda: len(_daemon_events(replay_port)) == 3)
        ours = _daemon_events(replay_port)

    assert len(vllm_events) == 3 and all(isinstance(e, BlockStored) for e in vllm_events)
    fields = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "group_idx", "medium", "locality")
    assert [[getattr(e, f) for f in fields] for e in ours] == [[getattr(e, f) for f in fields] for e in vllm_events]
    # and both are the engine's: 64-bit ints per 16-token block, chained, the prompt's tokens
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for e in ours for h in e.block_hashes)
    assert [t for e in ours for t in e.token_ids] == p.tokens
    assert ours[0].parent_block_hash is None and ours[1].parent_block_hash == ours[0].block_hashes[-1]
    assert all(e.block_size == BLOCK_SIZE and e.ownership is None for e in ours + vllm_events)


def test_chunks_stored_without_the_tracker_are_not_published(own_daemon):
    replay_port = free_port()
    daemon = own_daemon().start(
        [
            "--events-zmq-endpoint",
            f"tcp://127.0.0.1:{free_port()}",
            "--events-zmq-replay-endpoint",
            f"tcp://127.0.0.1:{replay_port}",
        ]
    )
    p = VllmPrompt("known", 1)
    unknown = offload_keys("unknown", 2)
    with Engine([kvstored_tier(daemon)]) as engine:
        attach_identities(engine.manager, tracker_identities(p.tracker))
        ctx = engine.request()
        assert engine.store(ctx, [*p.keys, *unknown]) == [*p.keys, *unknown]
        engine.settle()
        engine.finish(ctx)
        assert wait_for(lambda: len(_daemon_events(replay_port)) == 1)
        assert daemon.stats().tiers[0].chunks == 3  # all stored; one of them named for routers
    (event,) = _daemon_events(replay_port)
    assert not isinstance(event, BlockRemoved) and event.token_ids == p.tokens


def test_the_daemons_evictions_reach_vllms_events_as_removals(own_daemon):
    """vLLM's own stream (through its tracker) hears that the daemon evicted a chunk, with the
    same block hashes it announced; and the tracker then forgets the chunk."""
    daemon = own_daemon(cpu_bytes="1MiB").start()  # four 256 KiB chunks
    p = VllmPrompt("evicted", 2)
    with Engine([kvstored_tier(daemon)]) as engine:
        attach_identities(engine.manager, tracker_identities(p.tracker))
        ctx = engine.request()
        assert engine.store(ctx, p.keys) == p.keys
        engine.settle()
        engine.finish(ctx)
        stored = list(p.tracker.take_events(engine.tier_events()))
        ctx = engine.request()
        fillers = offload_keys("filler", 4)  # RAM holds four: the prompt's two are evicted
        assert engine.store(ctx, fillers) == fillers
        engine.settle()
        engine.finish(ctx)
        removed: list = []

        def removals() -> int:
            engine.step()
            removed.extend(e for e in p.tracker.take_events(engine.tier_events()) if isinstance(e, BlockRemoved))
            return sum(len(e.block_hashes) for e in removed)

        assert wait_for(lambda: removals() >= 8)
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(
        h for e in stored if isinstance(e, BlockStored) for h in e.block_hashes
    )
    assert all(e.medium == "CPU" and e.ownership is None for e in removed)
