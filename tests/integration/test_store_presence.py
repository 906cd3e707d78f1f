# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A store knows what the tiers below hold, and says why it drops what it drops, through a real
daemon over its socket with a real fs tier: after a restart, chunks on disk are already present
(not copied into RAM, no RAM event, the reply naming the fs tier) on both store paths, tenants
exactly apart; a store that drops chunks carries each one's reason and the daemon logs it."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from kvstored_client import DropReason, StoreOutcome, StoreResult, TierKind
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from tests.integration.test_ctl import ok
from tests.integration.test_metrics import METRICS_PORT_0, Scrape, scrape
from tests.support.daemon import short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.wait import wait_for

CHUNK = 64 << 10
RAM = "1MiB"  # 16 chunks


@pytest.fixture
def fs_root():
    root = short_tmpdir("kvfs")
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.fixture
def region_file():
    d = short_tmpdir("kvreg")
    path = d / "region"
    path.write_bytes(bytes(16 * CHUNK))
    yield path
    subprocess.run(["rm", "-rf", str(d)], check=False)


def fs_args(root) -> list[str]:
    return ["--tiers", f"kind=fs,root={root},bytes=64MiB"]


def ram(daemon) -> pb.TierStats:
    return next(t for t in daemon.stats().tiers if t.name == "ram")


def ram_stored_keys(daemon, marker: bytes) -> set[bytes]:
    """Keys of every RAM STORED event from the first one up to the one naming `marker`."""
    with daemon.channel() as channel:
        call = pb_grpc.KVStoreStub(channel).WatchEvents(pb.WatchEventsRequest(from_seq=1), timeout=20)
        keys: set[bytes] = set()
        for event in call:
            if event.type == pb.EVENT_TYPE_STORED and event.tier == "ram":
                keys.update(event.keys)
                if marker in event.keys:
                    call.cancel()
                    return keys
    raise AssertionError("the marker's event never came")


def store_on_disk_and_restart(daemon_factory, fs_root, model: str, keys, **ns_fields):
    """Store `keys` (they fit in RAM), stop (SIGTERM writes them down), start again: the chunks
    are on the fs tier only."""
    d = daemon_factory(fs_args(fs_root), cpu_bytes=RAM)
    with d.client() as kv:
        ns = kv.register_namespace(model=model, dtype="u8", chunk_bytes=CHUNK, **ns_fields)
        assert kv.store(ns, keys, payloads(keys, CHUNK)).stored == len(keys)
    d.stop()
    d.start(fs_args(fs_root))
    assert next(t for t in d.stats().tiers if t.name == "fs").chunks == len(keys)
    return d


@pytest.mark.parametrize("path", ["pool", "region"])
def test_after_a_restart_a_store_of_chunks_on_the_fs_tier_copies_none_into_ram(
    daemon_factory, fs_root, region_file, ns_name, path
):
    keys = make_keys("on-disk", 8)
    new = make_keys("new", 2)
    d = store_on_disk_and_restart(daemon_factory, fs_root, ns_name, keys)
    batch = keys + new
    data = payloads(batch, CHUNK)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        if path == "pool":
            result = kv.store(ns, batch, data)
        else:
            region_file.write_bytes(data.tobytes())
            region = kv.register_region(str(region_file))
            result = kv.store_from_region(ns, region, batch, [i * CHUNK for i in range(len(batch))])
        assert result == StoreResult(stored=2, already_present=8, dropped=0)
        assert result.present_in == (TierKind.FS,) * 8 + (TierKind.NONE,) * 2
        assert result.outcomes == (StoreOutcome.ALREADY_PRESENT,) * 8 + (StoreOutcome.STORED,) * 2
        assert result.present_by_tier == {TierKind.FS: 8} and result.dropped_by_reason == {}
        assert str(result) == "StoreResult(stored=2, already_present=8 (fs=8), dropped=0)"
        stats = ram(d)
        assert stats.chunks == 2 and stats.stored_chunks == 2  # only the new ones entered RAM
        marker = make_keys("marker", 1)
        kv.store(ns, marker, payloads(marker, CHUNK))
        assert ram_stored_keys(d, marker[0]) == set(new) | set(marker)  # no RAM event for the 8

        # Only a load brings them up, byte-exact; then RAM is where they are.
        assert kv.lookup(ns, keys).tiers == [TierKind.FS] * 8
        out = np.zeros((8, CHUNK), dtype=np.uint8)
        assert kv.load(ns, keys, out) == 8 and np.array_equal(out, data[:8])
        again = kv.store(ns, keys, data[:8])
        assert again.already_present == 8 and again.present_by_tier == {TierKind.RAM: 8}


async def test_the_async_client_sees_chunks_on_the_fs_tier_as_present(daemon_factory, fs_root, region_file, ns_name):
    """AsyncClient runs the same store plans: both store paths report the fs tier as where the
    chunks already are, per key, and copy none of them into RAM."""
    keys = make_keys("async-on-disk", 4)
    d = store_on_disk_and_restart(daemon_factory, fs_root, ns_name, keys)
    data = payloads(keys, CHUNK)
    region_file.write_bytes(data.tobytes() + bytes((16 - len(keys)) * CHUNK))
    async with d.async_client() as kv:
        ns = await kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        pool = await kv.store(ns, keys, data)
        region = await kv.register_region(str(region_file))
        from_region = await kv.store_from_region(ns, region, keys, [i * CHUNK for i in range(len(keys))])
    for result in (pool, from_region):
        assert result == StoreResult(already_present=4) and result.present_in == (TierKind.FS,) * 4
        assert str(result) == "StoreResult(stored=0, already_present=4 (fs=4), dropped=0)"
    assert ram(d).chunks == 0 and ram(d).stored_chunks == 0


def test_a_tenants_chunks_on_disk_are_present_for_that_tenant_only(daemon_factory, fs_root, ns_name):
    """The tenant salt is part of the namespace id: the same model and keys of another tenant, or
    of the public namespace, are not present; the tenant itself, registered again, finds its own."""
    keys = make_keys("tenant-on-disk", 4)
    data = payloads(keys, CHUNK)
    d = store_on_disk_and_restart(daemon_factory, fs_root, ns_name, keys, tenant_salt=b"tenant-a")
    with d.client() as b:
        other = b.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"tenant-b")
        assert b.store(other, keys, data) == StoreResult(stored=4)
        public = b.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert b.store(public, keys, data) == StoreResult(stored=4)
    with d.client() as a:
        own = a.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"tenant-a")
        result = a.store(own, keys, data)
        assert result == StoreResult(already_present=4) and result.present_by_tier == {TierKind.FS: 4}
        out = np.zeros_like(data)
        assert a.load(own, keys, out) == 4 and np.array_equal(out, data)


def test_a_store_that_drops_chunks_says_why_and_the_daemon_logs_it(daemon_factory, region_file, ns_name):
    """RAM full of leased chunks: the new chunks are dropped, each with its reason, on both store
        paths; the daemon logs one WARNING line naming the reason and the count, and counts them for
    kvstoredctl status and /metrics."""
    d = daemon_factory(METRICS_PORT_0, cpu_bytes=RAM)
    held = make_keys("held", 16)
    new = make_keys("dropped", 4)
    with d.client() as kv, d.channel() as channel:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert kv.store(ns, held, payloads(held, CHUNK)).stored == 16
        stub = pb_grpc.KVStoreStub(channel)
        sid = kv._session.session_id
        leases = stub.Acquire(pb.AcquireRequest(session_id=sid, namespace_id=ns.namespace_id, keys=held), timeout=10)
        assert len(leases.leases) == 16

        result = kv.store(ns, new, payloads(new, CHUNK))
        assert result == StoreResult(dropped=4)
        assert result.drop_reasons == (DropReason.RAM_FULL,) * 4
        assert str(result) == "StoreResult(stored=0, already_present=0, dropped=4 (ram_full=4))"
        reserve = stub.Reserve(pb.ReserveRequest(session_id=sid, namespace_id=ns.namespace_id, keys=new), timeout=10)
        assert [(s.state, s.drop_reason) for s in reserve.slots] == [
            (pb.SLOT_STATE_NO_SPACE, pb.DROP_REASON_RAM_FULL)
        ] * 4
        region = kv.register_region(str(region_file))
        from_region = kv.store_from_region(ns, region, new, [i * CHUNK for i in range(4)])
        assert from_region == StoreResult(dropped=4) and from_region.dropped_by_reason == {DropReason.RAM_FULL: 4}

        assert wait_for(lambda: "stores dropped 4 chunk(s) (ram_full)" in d.log), d.log
        line = next(line for line in d.log.splitlines() if "stores dropped" in line)
        assert "WARNING" in line and "leased and reserved" in line
        # Counted since start, by reason: kvstoredctl status and /metrics.
        status = json.loads(ok("status", "--json", socket_path=d.socket))
        assert status["store_drops"] == {"ram_full": 12, "quota_full": 0, "in_progress": 0, "not_visible": 0}
        assert "chunks dropped by stores: ram_full 12" in ok("status", socket_path=d.socket)
        assert Scrape(scrape(d)).value("kvstored_store_drops_total", reason="ram_full") == 12
        stub.Release(pb.ReleaseRequest(session_id=sid, handles=[lease.handle for lease in leases.leases]), timeout=10)
        assert kv.store(ns, new, payloads(new, CHUNK)).stored == 4
