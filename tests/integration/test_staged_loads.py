# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Region loads past a full RAM on a real daemon with a real fs tier: chunks below RAM reach the
client's region through staging memory, verified, and nothing in RAM is evicted for them."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstored_client import LoadInto, TierKind
from tests.support.daemon import clean_env
from tests.support.data import make_keys, payloads
from tests.support.rpc import pb, raw, rpc_error
from tests.support.wait import wait_for

CHUNK = 256 << 10  # whole pages: the fs tier reads with O_DIRECT where the filesystem allows it
RAM_CHUNKS = 8
N = 24


@pytest.fixture
def shm_dir():
    with tempfile.TemporaryDirectory(prefix="kvtest", dir="/dev/shm") as d:
        yield Path(d)


def region_of(path: Path) -> np.ndarray:
    return np.memmap(path, dtype=np.uint8, mode="r+")


def daemon_with_fs(daemon_factory, tmp_path, staging_bytes: int):
    return daemon_factory(
        ["--tiers", f"kind=fs,root={tmp_path / 'fs'},bytes=64MiB", "--staging-bytes", str(staging_bytes)],
        cpu_bytes=str(RAM_CHUNKS * CHUNK),
    )


def store_past_ram(d, c, ns_name: str, path: Path):
    """N chunks (three times RAM) stored from a region at `path`, the oldest written down to the
    fs tier; the region zeroed afterwards. Returns (namespace, region, keys, payloads, offsets)."""
    keys = make_keys(ns_name, N)
    data = payloads(keys, CHUNK)
    path.write_bytes(data.tobytes())
    offsets = [i * CHUNK for i in range(N)]
    ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
    region = c.register_region(path)
    for first in range(0, N, 4):  # write-back moves the oldest to disk
        assert c.store_from_region(ns, region, keys[first : first + 4], offsets[first : first + 4]).stored == 4
    assert wait_for(lambda: fs_of(d.stats()).chunks >= N - RAM_CHUNKS)
    return ns, region, keys, data, offsets


def test_a_region_load_past_a_full_ram_comes_through_staging(daemon_factory, ns_name, shm_dir, tmp_path):
    d = daemon_with_fs(daemon_factory, tmp_path, 3 * CHUNK)
    path = shm_dir / "region"
    with d.client() as c:
        ns, region, keys, data, offsets = store_past_ram(d, c, ns_name, path)
        recent = c.lookup(ns, keys[-RAM_CHUNKS // 2 :]).tiers
        assert recent == [TierKind.RAM] * (RAM_CHUNKS // 2)
        region_of(path)[:] = 0
        before = d.stats()

        found = c.lookup(ns, keys[:12], load_into=LoadInto.REGION)
        assert found.prefix_hits == 12 and set(found.tiers) == {TierKind.FS}
        assert c.load_to_region(ns, region, keys[:12], offsets[:12]) == 12  # four times staging

        after = d.stats()
        np.testing.assert_array_equal(region_of(path)[: 12 * CHUNK].reshape(12, CHUNK), data[:12])
        assert ram_of(after).evictions == ram_of(before).evictions  # nothing pushed out for the load
        assert c.lookup(ns, keys[-RAM_CHUNKS // 2 :]).tiers == recent  # the recent chunks are still in RAM
        staged = after.staged_chunks - before.staged_chunks
        promoted = ram_of(after).promotions - ram_of(before).promotions  # (into free RAM, if there was some)
        assert staged + promoted == 12 and staged >= 12 - RAM_CHUNKS
        assert after.staging_capacity_bytes == 3 * CHUNK and after.staging_used_bytes == 0
    status = subprocess.run(
        [sys.executable, "-m", "kvstored.ctl", "--socket", str(d.socket), "--json", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["staging"] == {
        "capacity_bytes": 3 * CHUNK,
        "used_bytes": 0,
        "staged_chunks": after.staged_chunks,
    }


def test_staging_off_region_loads_promote_into_ram(daemon_factory, ns_name, shm_dir, tmp_path):
    d = daemon_with_fs(daemon_factory, tmp_path, 0)
    path = shm_dir / "region"
    with d.client() as c:
        ns, region, keys, data, offsets = store_past_ram(d, c, ns_name, path)
        region_of(path)[:] = 0
        assert c.lookup(ns, keys[:4], load_into=LoadInto.REGION).prefix_hits == 4
        assert c.load_to_region(ns, region, keys[:4], offsets[:4]) == 4
        np.testing.assert_array_equal(region_of(path)[: 4 * CHUNK].reshape(4, CHUNK), data[:4])
        stats = d.stats()
        assert stats.staging_capacity_bytes == 0 and stats.staged_chunks == 0
        assert c.lookup(ns, keys[:4]).tiers == [TierKind.RAM] * 4  # promoted, as Acquire would


def test_a_lookup_with_an_unknown_load_into_is_invalid_argument(daemon, ns_name):
    with raw(daemon.socket, session=False) as conn:
        ns_id = conn.register(ns_name, CHUNK)
        request = pb.LookupRequest(namespace_id=ns_id, keys=make_keys(ns_name, 1), load_into=7)
        err = rpc_error(conn.call, "Lookup", request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "load_into 7" in err.details() and "REGION" in err.details()
        assert conn.call("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=make_keys(ns_name, 1))).prefix_hits == 0


def fs_of(stats):
    return next(t for t in stats.tiers if t.kind == pb.TIER_KIND_FS)


def ram_of(stats):
    return next(t for t in stats.tiers if t.kind == pb.TIER_KIND_RAM)
