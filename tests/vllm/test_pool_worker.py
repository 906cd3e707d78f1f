# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The direct spec's worker engine (pool_worker.PoolTransferEngine) under slow copies and a
stopped daemon. CPU tensors stand in for the GPU; a gate stands in for a CUDA copy's end event."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from typing import Any

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


class _GatedFuture:
    """A Reserve future the engine sees as pending until the test opens the gate."""

    def __init__(self, future, gate: threading.Event) -> None:
        self.future, self.gate = future, gate

    def done(self) -> bool:
        return self.gate.is_set() and self.future.done()

    def __getattr__(self, name):
        return getattr(self.future, name)


def gate_reserves(engine: PoolTransferEngine) -> threading.Event:
    """Hold every store after its Reserve until the returned event is set (so a test can act
    between the daemon's answer and the copy, whatever the machine's load)."""
    gate = threading.Event()
    call = engine.link.call

    def gated(method: str, request: Any, timeout: float | None = None) -> Any:  # a gate in front
        future = call(method, request, timeout)
        return _GatedFuture(future, gate) if method == "Reserve" else future

    engine.link.call = gated  # type: ignore[method-assign]
    return gate


def wait_answered(job) -> None:
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while not job.reserve.future.done():
        assert time.monotonic() < deadline
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
    engine, ns = make_engine(daemon, store_timeout_s=SETTLE_LIMIT_S)
    gate = GatedEvent()
    real_run = engine._run
    engine._run = lambda copies, stream, after: (real_run(copies, stream, after), gate)[1]
    try:
        stored = keys("slow-copy", 2)
        engine.submit_store(7, np.arange(2 * BPC), [2 * BPC], [0], ns, stored)
        until(lambda: engine._stores[7].copied, engine)
        engine._stores[7].deadline = time.monotonic() - 1  # past the store deadline, the copy still running
        engine.poll()
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
    gate = gate_reserves(engine)
    engine.submit_store(1, np.arange(BPC), [BPC], [0], ns, keys("stopped", 1))
    wait_answered(engine._stores[1])  # reserved; the copy and the Commit come with the next poll
    os.kill(daemon.pid, signal.SIGSTOP)  # the Commit goes out to a frozen daemon
    gate.set()
    try:
        engine.get_finished()
        engine.close()  # vLLM's shutdown must not raise
        assert not engine.pools
    finally:
        os.kill(daemon.pid, signal.SIGCONT)


def test_no_copy_into_slots_granted_to_a_session_that_ended(own_daemon):
    """Reserve answered, then the worker's session resets (same daemon, same pool): the daemon
    freed those slots and may have given them to another writer, so nothing is copied there."""
    from kvstored_client import Client
    from kvstored_client.errors import Unavailable
    from tests.support.wait import wait_for

    daemon = own_daemon(cpu_bytes="16MiB").start()
    engine, ns = make_engine(daemon)
    try:
        for t in engine.layout.tensors:
            t.fill_(7)
        gate = gate_reserves(engine)
        engine.submit_store(1, np.arange(BPC), [BPC], [0], ns, keys("dead", 1))
        wait_answered(engine._stores[1])
        engine.link.fail(Unavailable("reset for the test"), backoff=False)  # the daemon aborts the reservation
        assert wait_for(lambda: daemon.stats().reservations == 0)
        spec = namespace_spec(LayoutInfo("m", "bf16", "{}", 64), engine.layout.part_bytes, 36)
        with Client(daemon.socket, deadline_s=10.0) as other:
            other_ns = other.register_namespace(spec)
            victim = keys("victim", 1)
            data = np.full((1, engine.layout.part_bytes), 1, np.uint8)
            assert other.store(other_ns, victim, data).stored == 1  # likely in the freed slot
            assert engine.link.settle(SETTLE_LIMIT_S)
            gate.set()
            until(lambda: not engine._stores, engine)
            out = np.zeros_like(data)
            assert other.load(other_ns, victim, out) == 1
            assert (out == 1).all(), "the ended session's copy overwrote another writer's chunk"
    finally:
        engine.close()


def test_a_store_with_block_identities_reaches_routers(own_daemon):
    """The direct spec's path (Reserve, copy, Commit) hands the daemon the identities the
    scheduler put in the store spec; the daemon publishes them as BlockStored."""
    from kvstored_client import chunk_identities
    from tests.support.ports import free_port
    from tests.support.wait import wait_for
    from tests.support.zmq_events import events_of, replay

    replay_port = free_port()
    daemon = own_daemon(cpu_bytes="16MiB").start(
        [
            "--events-zmq-endpoint",
            f"tcp://127.0.0.1:{free_port()}",
            "--events-zmq-replay-endpoint",
            f"tcp://127.0.0.1:{replay_port}",
        ]
    )
    engine, ns = make_engine(daemon)
    tokens = list(range(2 * BPC * 16))
    identities = chunk_identities([1000 + b for b in range(2 * BPC)], tokens, 16, BPC)
    try:
        engine.submit_store(3, np.arange(2 * BPC), [2 * BPC], [0], ns, keys("routed", 2), identities)
        until(lambda: not engine.has_pending_work(), engine)
        assert wait_for(lambda: len(events_of(replay(replay_port, 1))) == 2)  # (seq 0: AllBlocksCleared)
    finally:
        engine.close()
    events = events_of(replay(replay_port, 1))
    assert [e["block_hashes"] for e in events] == [[1000, 1001, 1002, 1003], [1004, 1005, 1006, 1007]]
    assert [e["parent_block_hash"] for e in events] == [None, 1003]
    assert [t for e in events for t in e["token_ids"]] == tokens


def test_stores_after_the_first_copy_into_slots_reserved_ahead_with_no_reserve(own_daemon):
    """The first store reserves (and asks for slots ahead); the next ones copy at once into
    those slots and name their keys in the Commit, which reserves their slots ahead again. A
    chunk the daemon's RAM holds (its key index says so) is neither copied nor committed."""
    from kvstored_client import Client

    daemon = own_daemon(cpu_bytes="16MiB").start()
    engine, ns = make_engine(daemon)
    sent: list[str] = []
    call = engine.link.call
    engine.link.call = lambda method, request, timeout=None: (  # (counts the calls)
        sent.append(method),
        call(method, request, timeout),
    )[1]
    stored = keys("ahead", 6)
    try:
        for i, t in enumerate(engine.layout.tensors):
            t.copy_(torch.randint(-128, 127, t.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(i)))
        engine.submit_store(1, np.arange(BPC), [BPC], [0], ns, stored[:1])
        until(lambda: not engine.has_pending_work(), engine)
        assert sent.count("Reserve") == 1
        sent.clear()
        for job_id, key in enumerate(stored[1:], start=2):
            engine.submit_store(job_id, np.arange(BPC), [BPC], [0], ns, [key])
            until(lambda: not engine.has_pending_work(), engine)
        assert "Reserve" not in sent and sent.count("Commit") == 5, sent  # no fallback to Reserve
        assert engine.stores_ahead == 5
        finished = engine.get_finished()
        assert sorted(f.job_id for f in finished) == list(range(1, 7)) and all(f.num_bytes > 0 for f in finished)
        sent.clear()
        engine.submit_store(9, np.arange(BPC), [BPC], [0], ns, stored[:1])  # in RAM already
        until(lambda: not engine.has_pending_work(), engine)
        assert sent == [] and [f.num_bytes for f in engine.get_finished()] == [0]
        spec = namespace_spec(LayoutInfo("m", "bf16", "{}", 64), engine.layout.part_bytes, 36)
        with Client(daemon.socket, deadline_s=10.0) as reader:
            out = np.zeros((6, engine.layout.part_bytes), np.uint8)
            assert reader.load(reader.register_namespace(spec), stored, out) == 6
        assert out[0].any() and all((row == out[0]).all() for row in out)  # the same blocks, the same bytes
        assert daemon.stats().reservations == 0
    finally:
        engine.close()
    assert daemon.stats().ahead_slots == 0  # the worker's session ended: its slots are free
