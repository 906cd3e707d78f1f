# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Byte-exact round trips through a real daemon: pool mapping (numpy, torch, lists of buffers),
region registration (by fd over the session socket and by path over gRPC), and the async client."""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstored_client import StoreOutcome, StoreResult, Tier, chunk_keys
from kvstored_client.keys import namespace_id_for
from tests.support.data import make_keys, payload, payloads
from tests.support.rpc import pb, raw
from tests.support.wait import wait_for

CHUNK = 96 << 10  # 1.5 pages of 64 KiB: the last extent of every chunk is a partial page


@pytest.fixture
def shm_dir():
    with tempfile.TemporaryDirectory(prefix="kvtest", dir="/dev/shm") as d:
        yield Path(d)


def region_file(directory: Path, size: int) -> Path:
    path = directory / "region"
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


def write_file(path: Path, offset: int, data: np.ndarray) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data.tobytes())


def read_file(path: Path, offset: int, size: int) -> np.ndarray:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return np.frombuffer(fh.read(size), dtype=np.uint8)


# -- pool mapping --------------------------------------------------------------------------------


def test_numpy_round_trip(shared_daemon, ns_name):
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys(ns_name, 6)
        data = payloads(keys, CHUNK)
        assert c.lookup(ns, keys).prefix_hits == 0
        first = c.store(ns, keys, data)
        assert first == StoreResult(stored=6) and first.outcomes == (StoreOutcome.STORED,) * 6
        look = c.lookup(ns, keys)
        assert look.prefix_hits == 6 and look.tiers == [Tier.RAM] * 6
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == 6
        np.testing.assert_array_equal(out, data)
        again = c.store(ns, keys, data)
        assert again == StoreResult(already_present=6) and again.outcomes == (StoreOutcome.ALREADY_PRESENT,) * 6

    # A different client (another session, another mapping of the pool) reads the same bytes.
    with shared_daemon.client() as other:
        ns2 = other.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert ns2.namespace_id == ns.namespace_id
        out = np.zeros_like(data)
        assert other.load(ns2, keys, out) == 6
        np.testing.assert_array_equal(out, data)


@pytest.mark.parametrize("copy_threads", [1, 4])
def test_large_batches_split_across_copy_threads_move_exact_bytes(shared_daemon, ns_name, copy_threads):
    chunk = 4 << 20
    with shared_daemon.client(copy_threads=copy_threads) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=chunk)
        keys = make_keys(ns_name, 8)  # 32 MiB: four 8 MiB parts with 4 threads
        data = payloads(keys, chunk)
        assert c.store(ns, keys, data) == StoreResult(stored=8)
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == 8
        np.testing.assert_array_equal(out, data)
        assert c.delete(ns, keys) == 8


def test_numpy_other_dtypes_and_shapes(shared_daemon, ns_name):
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="float16", chunk_bytes=CHUNK)
        keys = make_keys(ns_name, 3)
        data = payloads(keys, CHUNK).view(np.float16).reshape(3, 2, CHUNK // 4)  # 3 chunks, any shape
        assert c.store(ns, keys, data).stored == 3
        out = np.zeros((3, CHUNK // 2), dtype=np.float16)
        assert c.load(ns, keys, out) == 3
        assert out.tobytes() == data.tobytes()


def test_load_stops_at_the_first_miss(shared_daemon, ns_name):
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys(ns_name, 4)
        data = payloads(keys, CHUNK)
        c.store(ns, [keys[0], keys[1], keys[3]], data[[0, 1, 3]])
        look = c.lookup(ns, keys)
        assert look.prefix_hits == 2
        assert look.tiers == [Tier.RAM, Tier.RAM, Tier.NONE, Tier.RAM]
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == 2
        np.testing.assert_array_equal(out[:2], data[:2])
        assert not out[2:].any()  # nothing written past the miss


def test_torch_cpu_tensors_round_trip(shared_daemon, ns_name):
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="bfloat16", chunk_bytes=CHUNK)
        keys = make_keys(ns_name, 4)
        data = torch.from_numpy(payloads(keys, CHUNK).copy()).view(torch.bfloat16)  # (4, CHUNK/2)
        assert c.store(ns, keys, data).stored == 4
        out = torch.zeros_like(data)
        assert c.load(ns, keys, out) == 4
        assert torch.equal(out.view(torch.uint8), data.view(torch.uint8))

        # A list of tensors, and a non-contiguous tensor on the store side.
        keys2 = make_keys(ns_name + "/list", 3)
        rows = [torch.from_numpy(payload(k, CHUNK).copy()) for k in keys2]
        wide = torch.zeros((CHUNK, 2), dtype=torch.uint8)
        wide[:, 0] = rows[2]
        tensors = [rows[0], rows[1], wide[:, 0]]  # the last one is a strided view
        assert not tensors[2].is_contiguous()
        assert c.store(ns, keys2, tensors).stored == 3
        outs = [torch.empty(CHUNK, dtype=torch.uint8) for _ in keys2]
        assert c.load(ns, keys2, outs) == 3
        for got, want in zip(outs, rows):
            assert torch.equal(got, want)


def test_list_of_buffers_round_trip(shared_daemon, ns_name):
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys(ns_name, 4)
        rows = [payload(k, CHUNK) for k in keys]
        buffers = [rows[0].tobytes(), bytearray(rows[1].tobytes()), memoryview(rows[2].tobytes()), rows[3]]
        assert c.store(ns, keys, buffers) == StoreResult(stored=4)
        outs = [bytearray(CHUNK), np.zeros(CHUNK, np.uint8), memoryview(bytearray(CHUNK)), bytearray(CHUNK)]
        assert c.load(ns, keys, outs) == 4
        for got, want in zip(outs, rows):
            assert bytes(got) == want.tobytes()


def test_one_flat_buffer_of_n_chunks(shared_daemon, ns_name):
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys(ns_name, 3)
        flat = payloads(keys, CHUNK).tobytes()
        assert c.store(ns, keys, flat).stored == 3
        out = bytearray(3 * CHUNK)
        assert c.load(ns, keys, out) == 3
        assert bytes(out) == flat


def test_keys_from_tokens_round_trip(shared_daemon, ns_name):
    tokens = np.random.default_rng(3).integers(0, 50_000, 4 * 256 + 10)
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert ns.namespace_id == namespace_id_for(ns_name, "uint8", CHUNK, "")
        keys = chunk_keys(tokens, 256, ns.namespace_id)
        assert len(keys) == 4
        data = payloads(keys, CHUNK)
        c.store(ns, keys, data)
        # A request sharing the first 2 chunks' tokens hits exactly those two.
        other = tokens.copy()
        other[2 * 256 + 5] += 1
        look = c.lookup(ns, chunk_keys(other, 256, ns.namespace_id))
        assert look.prefix_hits == 2


def test_delete(shared_daemon, ns_name):
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys(ns_name, 3)
        c.store(ns, keys, payloads(keys, CHUNK))
        assert c.delete(ns, keys[1:2]) == 1
        assert c.delete(ns, keys[1:2]) == 0
        assert c.lookup(ns, keys).tiers == [Tier.RAM, Tier.NONE, Tier.RAM]


def test_chunks_spread_over_several_page_runs_round_trip(daemon_factory, ns_name):
    """Two chunk sizes share a fragmented pool: a 3-page chunk gets three 1-page runs."""
    page = 64 << 10
    d = daemon_factory(cpu_bytes="1MiB")  # 16 pages
    with d.client() as c, raw(d.socket) as r:
        small = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=page)
        keys = make_keys(ns_name + "/small", 16)
        data = payloads(keys, page)
        for key, row in zip(keys, data):
            assert c.store(small, [key], row).stored == 1
        assert c.delete(small, keys[0::2]) == 8  # every other page is free now

        big = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=3 * page - 1000)
        bkey = make_keys(ns_name + "/big", 1)
        bdata = payloads(bkey, 3 * page - 1000)
        assert c.store(big, bkey, bdata).stored == 1
        assert d.stats().tiers[0].evictions == 0  # it fit in the holes

        r.register(ns_name, 3 * page - 1000)
        leases = r.acquire(big.namespace_id, bkey)
        assert len(leases) == 1
        assert len(leases[0].extents) == 3, leases[0].extents
        assert sum(e.length for e in leases[0].extents) == 3 * page - 1000
        assert r.read_extents(leases[0].extents) == bdata[0].tobytes()
        r.release([leases[0].handle])

        out = np.zeros_like(bdata)
        assert c.load(big, bkey, out) == 1
        np.testing.assert_array_equal(out, bdata)
        out = np.zeros((8, page), np.uint8)
        assert c.load(small, keys[1::2], out) == 8
        np.testing.assert_array_equal(out, data[1::2])


# -- region registration -------------------------------------------------------------------------


def test_region_by_fd_round_trip(shared_daemon, ns_name, shm_dir):
    n = 4
    size = 2 * n * CHUNK + 4096
    path = region_file(shm_dir, size)
    keys = make_keys(ns_name, n)
    data = payloads(keys, CHUNK)
    store_offsets = [7 + i * CHUNK for i in range(n)]  # unaligned offsets are fine
    load_offsets = [size - (i + 1) * CHUNK for i in range(n)]  # other places, reversed order
    for off, row in zip(store_offsets, data):
        write_file(path, off, row)

    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        region = c.register_region(path)
        assert region.size == size and region.region_id != 0
        result = c.store_from_region(ns, region, keys, store_offsets)
        assert result == StoreResult(stored=n) and result.outcomes == (StoreOutcome.STORED,) * n
        assert c.lookup(ns, keys).prefix_hits == n
        again = c.store_from_region(ns, region, keys[:1] + make_keys(ns_name + "/more", 1), store_offsets[:2])
        assert again.outcomes == (StoreOutcome.ALREADY_PRESENT, StoreOutcome.STORED)
        assert c.delete(ns, make_keys(ns_name + "/more", 1)) == 1
        assert c.load_to_region(ns, region, keys, load_offsets) == n
        for off, row in zip(load_offsets, data):
            np.testing.assert_array_equal(read_file(path, off, CHUNK), row)
        # The source bytes were not disturbed.
        for off, row in zip(store_offsets, data):
            np.testing.assert_array_equal(read_file(path, off, CHUNK), row)
        # And the pool mapping sees the same chunks.
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == n
        np.testing.assert_array_equal(out, data)


def test_region_registered_by_open_fd(shared_daemon, ns_name, shm_dir):
    path = region_file(shm_dir, 2 * CHUNK)
    keys = make_keys(ns_name, 1)
    write_file(path, 0, payloads(keys, CHUNK)[0])
    fd = os.open(path, os.O_RDWR)
    try:
        with shared_daemon.client() as c:
            ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
            region = c.register_region(fd, name="by-fd")
            assert c.store_from_region(ns, region, keys, [0]).stored == 1
            assert c.load_to_region(ns, region, keys, [CHUNK]) == 1
    finally:
        os.close(fd)  # the client dup'ed it; ours is still valid
    np.testing.assert_array_equal(read_file(path, CHUNK, CHUNK), payloads(keys, CHUNK)[0])


def test_region_writes_are_visible_through_a_live_mapping(shared_daemon, ns_name, shm_dir):
    """The daemon copies into the same shared memory the client has mapped (no stale copy)."""
    path = region_file(shm_dir, 2 * CHUNK)
    keys = make_keys(ns_name, 1)
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 2 * CHUNK) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        view[:CHUNK] = payloads(keys, CHUNK)[0]
        with shared_daemon.client() as c:
            ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
            region = c.register_region(path)
            assert c.store_from_region(ns, region, keys, [0]).stored == 1
            assert c.load_to_region(ns, region, keys, [CHUNK]) == 1
        np.testing.assert_array_equal(view[CHUNK:], view[:CHUNK])
        del view


def test_register_region_by_path_over_grpc(shared_daemon, ns_name, shm_dir):
    n = 3
    size = 2 * n * CHUNK
    path = region_file(shm_dir, size)
    keys = make_keys(ns_name, n)
    data = payloads(keys, CHUNK)
    for i, row in enumerate(data):
        write_file(path, i * CHUNK, row)
    with raw(shared_daemon.socket) as r:
        ns_id = r.register(ns_name, CHUNK)
        before = r.stats().regions
        reg = r.call("RegisterRegion", pb.RegisterRegionRequest(session_id=r.session_id, path=str(path)))
        assert reg.size == size and reg.region_id != 0
        assert r.stats().regions == before + 1
        stored = r.call(
            "StoreFromRegion",
            pb.RegionTransferRequest(
                session_id=r.session_id,
                namespace_id=ns_id,
                region_id=reg.region_id,
                keys=keys,
                offsets=[i * CHUNK for i in range(n)],
            ),
        )
        assert (stored.stored, stored.already_present, stored.dropped) == (n, 0, 0)
        loaded = r.call(
            "LoadToRegion",
            pb.RegionTransferRequest(
                session_id=r.session_id,
                namespace_id=ns_id,
                region_id=reg.region_id,
                keys=keys,
                offsets=[(n + i) * CHUNK for i in range(n)],
            ),
        )
        assert loaded.loaded == n
        for i, row in enumerate(data):
            np.testing.assert_array_equal(read_file(path, (n + i) * CHUNK, CHUNK), row)
        again = r.call(
            "StoreFromRegion",
            pb.RegionTransferRequest(
                session_id=r.session_id,
                namespace_id=ns_id,
                region_id=reg.region_id,
                keys=keys,
                offsets=[i * CHUNK for i in range(n)],
            ),
        )
        assert (again.stored, again.already_present) == (0, n)
    # The session is gone: so is its region.
    with raw(shared_daemon.socket, session=False) as r:
        assert wait_for(lambda: r.stats().regions == before)


# -- async client --------------------------------------------------------------------------------


async def test_async_client_round_trip(shared_daemon, ns_name, shm_dir):
    keys = make_keys(ns_name, 5)
    data = payloads(keys, CHUNK)
    async with shared_daemon.async_client() as c:
        ns = await c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert (await c.lookup(ns, keys)).prefix_hits == 0
        assert await c.store(ns, keys, data) == StoreResult(stored=5)
        assert (await c.lookup(ns, keys)).prefix_hits == 5
        out = np.zeros_like(data)
        assert await c.load(ns, keys, out) == 5
        np.testing.assert_array_equal(out, data)

        path = region_file(shm_dir, 5 * CHUNK)
        region = await c.register_region(path)
        assert await c.load_to_region(ns, region, keys, [i * CHUNK for i in range(5)]) == 5
        np.testing.assert_array_equal(read_file(path, 0, 5 * CHUNK).reshape(5, CHUNK), data)
        assert await c.delete(ns, keys[:1]) == 1
        assert (await c.lookup(ns, keys)).prefix_hits == 0
        stats = await c.stats()
        assert stats.tiers[0].kind == pb.TIER_KIND_RAM

    # The sync client sees what the async one stored.
    with shared_daemon.client() as sync:
        ns = sync.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        out = np.zeros_like(data[1:])
        assert sync.load(ns, keys[1:], out) == 4
        np.testing.assert_array_equal(out, data[1:])


def test_stats_count_namespaces_sessions_and_chunks(daemon, ns_name):
    with daemon.client() as c:
        assert daemon.stats().sessions == 0
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys(ns_name, 3)
        c.store(ns, keys, payloads(keys, CHUNK))
        s = daemon.stats()
        assert s.namespaces == 1
        assert s.sessions == 1
        assert s.leases == 0 and s.reservations == 0
        assert s.ahead_slots == 4  # the client's slots reserved ahead for its next stores
        ram = s.tiers[0]
        assert ram.name == "ram" and ram.kind == pb.TIER_KIND_RAM
        assert ram.capacity_bytes == 16 << 20
        assert ram.chunks == 3
        assert ram.used_bytes == (3 + 4) * 2 * (64 << 10)  # 1.5 pages -> 2 pages each; the slots ahead count
        assert ram.stored_chunks == 3
        assert s.version
    assert wait_for(lambda: daemon.stats().sessions == 0)


def test_registering_a_sparse_region_allocates_none_of_its_holes(daemon_factory):
    """The daemon fills its page tables for a region in the background, but never for a sparse
    file: that would allocate memory the client never used."""
    d = daemon_factory(["--log-level", "debug"])
    path = Path("/dev/shm") / f"kvstored-sparse-{os.getpid()}"
    with open(path, "wb") as f:
        f.truncate(64 << 20)
    try:
        with d.client() as c:
            region = c.register_region(path)

            def populated() -> bool:
                return any(
                    line.endswith("background populate done") and f"region {region.region_id} (" in line
                    for line in d.log.splitlines()
                )

            assert wait_for(populated), d.log
            assert os.stat(path).st_blocks == 0
    finally:
        path.unlink()
