"""The direct spec's worker engine (pool_worker.PoolTransferEngine) under slow copies and a
stopped daemon. CPU tensors stand in for the GPU; a gate stands in for a CUDA copy's end event."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import numpy as np
import torch

from kvstored_client.vllm.blockcopy import KVLayout, LayerRef
from kvstored_client.vllm.namespace import LayoutInfo, namespace_spec
from kvstored_client.vllm.pool_worker import PoolTransferEngine
from tests.vllm.harness import SETTLE_LIMIT_S

PAGE, LAYERS, BPC, BLOCKS = 4096, 2, 4, 32


class GatedEvent:
    """A copy's end event that completes only when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while not self.done:
            assert time.monotonic() < deadline, "the gated copy was never released"
            time.sleep(0.001)


def make_engine(daemon, **kwargs) -> tuple[PoolTransferEngine, str]:
    tensors = [torch.zeros((BLOCKS, PAGE), dtype=torch.int8) for _ in range(LAYERS)]
    layout = KVLayout(tensors, [[LayerRef(i, PAGE) for i in range(LAYERS)]], BPC)
    engine = PoolTransferEngine(layout, str(daemon.socket), "pool-worker-test", **kwargs)
    ns = engine.link.namespace(namespace_spec(LayoutInfo("m", "bf16", "{}", 64), layout.part_bytes, 36))
    assert engine.link.settle(SETTLE_LIMIT_S, (ns,))
    return engine, ns


def keys(label: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{label}/{i}".encode()).digest() + bytes(4) for i in range(n)]


def until(cond, engine: PoolTransferEngine) -> None:
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while not cond():
        engine.poll()
        assert time.monotonic() < deadline
        time.sleep(0.002)


def test_a_copy_outlasting_the_store_deadline_ends_the_job_only_when_it_does(own_daemon):
    """vLLM may reuse the GPU blocks once a store is reported: a copy still running past
    store_timeout_s keeps the job open, and is committed when it ends (no reservation leaks)."""
    daemon = own_daemon(cpu_bytes="16MiB").start()
    engine, ns = make_engine(daemon, store_timeout_s=0.05)
    gate = GatedEvent()
    real_run = engine._run
    engine._run = lambda copies, stream, after: (real_run(copies, stream, after), gate)[1]
    try:
        stored = keys("slow-copy", 2)
        engine.submit_store(7, np.arange(2 * BPC), [2 * BPC], [0], ns, stored)
        until(lambda: engine._stores[7].copied, engine)
        time.sleep(0.1)  # past the store deadline, the copy still running
        assert all(f.job_id != 7 for f in engine.get_finished())
        gate.done = True
        finished = []
        until(lambda: finished.extend(engine.get_finished()) or finished, engine)
        assert finished[0].job_id == 7 and finished[0].num_bytes > 0
        until(lambda: not engine.has_pending_work(), engine)
        stats = daemon.stats()
        assert stats.reservations == 0
        assert next(t.chunks for t in stats.tiers if t.name == "ram") == 2  # committed
    finally:
        engine.close()


def test_close_with_the_daemon_stopped_does_not_raise(own_daemon):
    daemon = own_daemon(cpu_bytes="16MiB").start()
    engine, ns = make_engine(daemon, connect_timeout_s=0.5)
    engine.submit_store(1, np.arange(BPC), [BPC], [0], ns, keys("stopped", 1))
    job = engine._stores[1]
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while not job.reserve.done():  # reserved; the copy and the Commit come with the next poll
        assert time.monotonic() < deadline
        time.sleep(0.001)
    os.kill(daemon.pid, signal.SIGSTOP)  # the Commit goes out to a frozen daemon
    try:
        engine.get_finished()
        engine.close()  # vLLM's shutdown must not raise
        assert not engine.pools
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
