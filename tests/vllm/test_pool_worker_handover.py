# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The direct spec's worker maps each tenant arena once, by pool and arena id. A hand-over keeps
the pool (same memfd, same pool id); the old daemon removed an idle tenant's arena at its stop,
and the new daemon gave that arena's id to another tenant's new arena: the worker then copied
that tenant's chunks into its mapping of the dead arena, and every other process loaded other
bytes. Arena ids now go on from where the old daemon left them."""

from __future__ import annotations

import subprocess

import numpy as np
import torch

from kvstored_client.vllm.blockcopy import KVLayout, LayerRef
from kvstored_client.vllm.namespace import LayoutInfo, namespace_spec
from kvstored_client.vllm.pool_worker import PoolTransferEngine
from tests.support.daemon import Daemon, short_tmpdir
from tests.vllm.test_pool_worker import BLOCKS, BPC, LAYERS, PAGE, keys, until


def spec(part_bytes: int, salt: bytes):
    return namespace_spec(LayoutInfo("m", "bf16", "{}", 64), part_bytes, 36, salt)


def test_a_tenant_arena_made_after_a_hand_over_is_a_new_one_for_the_worker():
    wd = short_tmpdir("kvar")
    (wd / "a").mkdir()
    (wd / "b").mkdir()
    old = Daemon(wd / "kv.sock", workdir=wd / "a", cpu_bytes="16MiB").start()
    new = Daemon(wd / "kv.sock", workdir=wd / "b", cpu_bytes="16MiB")
    engine = None
    try:
        tensors = [torch.zeros((BLOCKS, PAGE), dtype=torch.int8) for _ in range(LAYERS)]
        layout = KVLayout(tensors, [[LayerRef(i, PAGE) for i in range(LAYERS)]], BPC)
        part = layout.part_bytes
        with old.client() as kv:  # tenant X keeps a chunk (and its arena) across the hand-over
            nsx = kv.register_namespace(spec(part, b"tenant-x"))
            assert kv.store(nsx, keys("x", 1), np.ones((1, part), np.uint8)).stored == 1
        engine = PoolTransferEngine(layout, str(old.socket), "w")
        ns_y = engine.link.namespace(spec(part, b"tenant-y"))  # the worker maps tenant Y's arena
        until(lambda: engine.link.namespace_ready(ns_y), engine)
        y_arena, pool = engine.link.arena_of(ns_y), engine.link.pool_id
        new.spawn()  # the hand-over (Y has no chunk: its arena goes with the old daemon's stop)
        assert old.wait() == 0, old.log
        new.wait_ready()
        engine.link.reconnect_soon()
        until(lambda: engine.link.ready, engine)
        assert engine.link.pool_id == pool  # (the same pool: the mappings by id stay)
        sz = spec(part, b"tenant-z")
        ns_z = engine.link.namespace(sz)
        until(lambda: engine.link.namespace_ready(ns_z), engine)
        assert engine.link.arena_of(ns_z) > y_arena  # (not Y's id again)
        rng = np.random.default_rng(1)
        for t in tensors:
            t.copy_(torch.from_numpy(rng.integers(-128, 127, (BLOCKS, PAGE), dtype=np.int8)))
        kz = keys("z", 2)
        engine.submit_store(7, np.arange(2 * BPC), [2 * BPC], [0], ns_z, kz)
        finished: list = []
        until(lambda: finished.extend(engine.get_finished()) or finished, engine)
        until(lambda: not engine.has_pending_work(), engine)
        assert engine.dropped_stores == 0
        expected = np.stack(
            [
                np.concatenate([t[c * BPC : (c + 1) * BPC].numpy().view(np.uint8).ravel() for t in tensors])
                for c in range(2)
            ]
        )
        with new.client() as kv:  # another process loads what the worker stored
            got = np.zeros((2, part), np.uint8)
            assert kv.load(kv.register_namespace(sz), kz, got) == 2
        assert np.array_equal(got, expected), "another process reads tenant Z's chunks as other bytes"
    finally:
        if engine is not None:
            engine.close()
        for d in (old, new):
            d.cleanup()
        subprocess.run(["rm", "-rf", str(wd)], check=False)
