# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Dynamo 1.6.1's own router (its standalone indexer, and KvRouter on the deployment path) fed by a
real daemon's ZMQ stream, while vLLM's TieringOffloadingManager stores a real request's chunks
through the kvstored tier."""

from __future__ import annotations

import shutil

import grpc

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.vllm.connector import attach_identities
from kvstored_client.vllm.identity import tracker_identities
from kvstored_client.vllm.plugin import register
from tests.support.daemon import short_tmpdir
from tests.support.ports import free_port
from tests.support.wait import wait_for
from tests.vllm.dynamo import DynamoIndexer, DynamoKvRouter
from tests.vllm.harness import Engine, kvstored_tier, offload_keys
from tests.vllm.vllm_blocks import BLOCK_SIZE, VllmPrompt

register()
MODEL = "org/test-model"  # the harness's


def _store(engine: Engine, keys: list[bytes]) -> None:
    ctx = engine.request()
    assert engine.store(ctx, keys) == keys
    engine.settle()
    engine.finish(ctx)


def _start(own_daemon, root: str):
    endpoint = f"ipc://{root}/events.sock"  # binds (vLLM's rule), on no network interface
    daemon = own_daemon(cpu_bytes="1MiB").start(  # four 256 KiB chunks
        [
            "--events-zmq-endpoint",
            endpoint,
            "--events-zmq-replay-endpoint",
            f"tcp://127.0.0.1:{free_port()}",
            "--tiers",
            f"kind=fs,root={root}/fs,bytes=64MiB",
            "--write-policy",
            "write-through",
        ]
    )
    return daemon, endpoint


def _delete(daemon, namespace_id: int, keys: list[bytes]) -> None:
    with grpc.insecure_channel(f"unix://{daemon.socket}") as channel:
        stub = pb_grpc.KVStoreStub(channel)
        assert stub.Delete(pb.DeleteRequest(namespace_id=namespace_id, keys=keys), timeout=10).deleted == len(keys)


def test_dynamos_router_finds_the_prompt_at_each_tier_and_loses_it_on_delete(own_daemon, tmp_path):
    root = short_tmpdir("kvfs")
    daemon, endpoint = _start(own_daemon, root)
    indexer = DynamoIndexer(endpoint, MODEL, BLOCK_SIZE, tmp_path / "dynamo.log")
    p = VllmPrompt("dynamo", 2)  # 128 tokens: 8 engine blocks, 2 chunks
    depth = len(p.tokens)
    try:
        with Engine([kvstored_tier(daemon)]) as engine:
            assert attach_identities(engine.manager, tracker_identities(p.tracker)) == 1
            _store(engine, p.keys)
            # the whole prompt, on the node's CPU tier (and on disk: write-through)
            assert wait_for(lambda: indexer.overlap(p.tokens).get("longest_matched") == depth)
            first = indexer.overlap(p.tokens)
            assert (first["cpu"], first["disk"]) == (depth, depth), first

            _store(engine, offload_keys("filler", 4))  # RAM holds four: the prompt is evicted
            assert wait_for(lambda: indexer.overlap(p.tokens).get("cpu") == 0)
            after = indexer.overlap(p.tokens)
            assert (after["longest_matched"], after["disk"]) == (depth, depth), after  # found on disk

            namespace_id = engine.tier._namespaces.id_for(len(p.keys[0]))
        _delete(daemon, namespace_id, p.keys)
        assert wait_for(lambda: indexer.overlap(p.tokens).get("longest_matched", 0) == 0)
        log = (tmp_path / "dynamo.log").read_text()
        assert "ownership" not in log and "too short" not in log and "Block size" not in log
    finally:
        indexer.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_dynamos_kvrouter_scores_the_prompt_at_each_tier_and_drops_it_on_delete(own_daemon, tmp_path):
    """The deployment path: DistributedRuntime(mem, tcp, event_plane=zmq), register_model,
    KvEventPublisher(zmq_endpoint=the daemon's) and KvRouter.get_overlap_scores."""
    root = short_tmpdir("kvfs")
    daemon, endpoint = _start(own_daemon, root)
    router = DynamoKvRouter(endpoint, MODEL, BLOCK_SIZE, tmp_path / "kvrouter.log")
    p = VllmPrompt("kvrouter", 2)  # 128 tokens: 8 engine blocks, 2 chunks
    blocks = len(p.tokens) // BLOCK_SIZE
    try:
        assert router.overlap(p.tokens)["host_pinned_blocks"] == 0  # registered, knows nothing yet
        with Engine([kvstored_tier(daemon)]) as engine:
            assert attach_identities(engine.manager, tracker_identities(p.tracker)) == 1
            _store(engine, p.keys)
            # full depth on the host tier (CPU) and on disk (write-through), none on the device
            assert wait_for(lambda: router.overlap(p.tokens)["host_pinned_blocks"] == blocks)
            first = router.overlap(p.tokens)
            assert (first["device_blocks"], first["disk_blocks"]) == (0, blocks), first

            _store(engine, offload_keys("filler", 4))  # RAM holds four: the prompt is evicted
            assert wait_for(lambda: router.overlap(p.tokens)["host_pinned_blocks"] == 0)
            assert router.overlap(p.tokens)["disk_blocks"] == blocks  # still found, a tier down

            namespace_id = engine.tier._namespaces.id_for(len(p.keys[0]))
        _delete(daemon, namespace_id, p.keys)
        assert wait_for(lambda: router.overlap(p.tokens)["disk_blocks"] == 0)
        assert router.overlap(p.tokens)["host_pinned_blocks"] == 0
        log = (tmp_path / "kvrouter.log").read_text()
        assert "ownership" not in log and "too short" not in log and "Block size" not in log
    finally:
        router.stop()
        shutil.rmtree(root, ignore_errors=True)
