# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A region load of a peer's chunks on a node whose RAM is full: the chunks are fetched over each
transport into the node's staging memory (daemon-private, not the pool), verified, and copied into
the client's region; nothing in the node's RAM is evicted for them."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

from kvstored_client import LoadInto, Tier
from tests.peer.conftest import TRANSPORTS
from tests.support.cluster import Cluster
from tests.support.data import make_keys, payloads

pytestmark = pytest.mark.slow

CHUNK = 1 << 20
RAM_CHUNKS = 8


@pytest.fixture(scope="module", params=TRANSPORTS)
def pair(request):
    with Cluster(2, request.param, cpu_bytes=str(RAM_CHUNKS * CHUNK)) as cluster:
        cluster.start()
        for i in range(2):
            cluster.wait_up(i)
        yield cluster


def test_a_peers_chunks_reach_a_region_through_staging_when_ram_is_full(pair, request):
    a, b = pair
    model = "peer/" + re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    fields = {"model": model, "dtype": "u8", "chunk_bytes": CHUNK}
    keys = make_keys(model, 4)
    with a.client() as kv:
        ns = kv.register_namespace(**fields)
        assert kv.store(ns, keys, payloads(keys, CHUNK)).stored == len(keys)
    pair.wait_indexed(1, 0, len(keys))
    own = make_keys(model + "/b", RAM_CHUNKS)
    with tempfile.TemporaryDirectory(prefix="kvtest", dir="/dev/shm") as shm, b.client() as kv:
        ns = kv.register_namespace(**fields)
        assert kv.store(ns, own, payloads(own, CHUNK)).stored == RAM_CHUNKS  # B's RAM is full
        path = Path(shm) / "region"
        path.write_bytes(bytes(len(keys) * CHUNK))
        region = kv.register_region(path)
        before = b.stats()
        assert kv.lookup(ns, keys, load_into=LoadInto.REGION).tiers == [Tier.PEER] * len(keys)
        assert kv.load_to_region(ns, region, keys, [i * CHUNK for i in range(len(keys))]) == len(keys)
        got = np.fromfile(path, dtype=np.uint8).reshape(len(keys), CHUNK)
        assert np.array_equal(got, payloads(keys, CHUNK))
        after = b.stats()
        assert after.staged_chunks - before.staged_chunks == len(keys)
        assert kv.lookup(ns, own).tiers == [Tier.RAM] * RAM_CHUNKS  # nothing evicted for the load
        assert after.staging_used_bytes == 0
    assert b.peer(a).transport == pair.transport
