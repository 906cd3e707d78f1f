# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""radosgw frozen (SIGSTOP) and stopped under a real daemon (one Ceph cluster for the module).

- A region load waiting on a frozen gateway gives up at its start deadline: DEADLINE_EXCEEDED
  (TransferNotStarted), nothing copied, and the client reports 0 (#12 defect 5).
- The circuit breaker: lookups that reach a frozen or stopped gateway cost a few failed S3
  operations in all, not one each; loads of chunks in RAM and fs go on meanwhile, byte-exact;
  the tier serves again once the gateway is back.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstored.chunks.chunkfile import chunk_relpath
from kvstored_client import Tier
from kvstored_client.errors import ERROR_KIND_KEY
from tests.support.daemon import short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.loader import VerifyingLoader
from tests.support.rpc import pb, raw
from tests.support.s3 import radosgw_or_fail
from tests.support.wait import wait_for

pytestmark = pytest.mark.radosgw

CHUNK = 64 << 10
RECOVERY_S = 120.0  # a hang guard for "the tier serves again"


@pytest.fixture(scope="module")
def rgw():
    with radosgw_or_fail() as (gateway, endpoint):
        yield gateway, endpoint


def s3_tier(endpoint, **options: str) -> str:
    spec = {
        "kind": "s3",
        "bucket": f"kv-{uuid.uuid4().hex[:8]}",
        "endpoint_url": endpoint.url,
        "access_key": endpoint.access_key,
        "secret_key": endpoint.secret_key,
        "region": "us-east-1",
        # one object per chunk: lookups HEAD what the tier does not know (a packing tier answers
        # lookups from its index; its faults are in test_s3_pack_faults.py)
        "pack_bytes": "0",
        **options,
    }
    return ",".join(f"{k}={v}" for k, v in spec.items())


def tier_stats(daemon, name: str):
    return next(t for t in daemon.stats().tiers if t.name == name)


def test_a_region_load_waiting_on_a_frozen_radosgw_gives_up_at_its_start_deadline(
    daemon_factory, rgw, ns_name, tmp_path
):
    gateway, endpoint = rgw
    # RAM of 16 chunks and an S3 timeout far past the deadline: waiting for S3 is what is tested.
    d = daemon_factory(
        ["--write-policy", "write-through", "--tiers", s3_tier(endpoint, timeout_s="30")], cpu_bytes="1MiB"
    )
    keys = make_keys(ns_name, 32)
    region_path = tmp_path / "region"
    region_path.write_bytes(b"\xa5" * CHUNK)
    with d.client(deadline_s=2.0) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        for i in range(0, 32, 8):
            assert c.store(ns, keys[i : i + 8], payloads(keys[i : i + 8], CHUNK)).stored == 8
        assert wait_for(lambda: tier_stats(d, "s3").stored_chunks == 32 and tier_stats(d, "s3").queued == 0)
        in_s3_only = keys[0]  # written down at once, evicted from RAM by the 16 after it
        never_stored = make_keys(ns_name + "/never", 1)[0]
        region = c.register_region(region_path)
        with raw(d.socket) as conn, open(region_path, "r+b") as region_file:
            conn.register(ns_name, CHUNK)
            attached, _ = conn.session.attach_region(region_file.fileno(), "fault-region")
            with gateway.gateway_frozen():
                for key in (in_s3_only, never_stored):  # a GET, then a HEAD, that get no answer
                    request = pb.RegionTransferRequest(
                        session_id=conn.session_id,
                        namespace_id=ns.namespace_id,
                        region_id=attached,
                        keys=[key],
                        offsets=[0],
                        start_within_ms=2000,
                    )
                    try:  # as the client does: the start deadline, then 10 s for a started copy to answer
                        answer = conn.stub.LoadToRegion(request, timeout=12)
                        raise AssertionError(f"loaded {answer.loaded} from a frozen radosgw")
                    except grpc.RpcError as err:
                        kind = dict(err.trailing_metadata() or ()).get(ERROR_KIND_KEY)
                        assert (err.code(), kind) == (grpc.StatusCode.DEADLINE_EXCEEDED, "TransferNotStarted"), (
                            err.code(),
                            kind,
                            err.details(),
                        )
                    # The client: nothing loaded, no exception.
                    assert c.load_to_region(ns, region, [key], [0]) == 0
                assert region_path.read_bytes() == b"\xa5" * CHUNK  # nothing copied
        # Back: the chunk comes from S3, byte-exact.
        c.deadline_s = 30.0
        assert wait_for(lambda: c.load_to_region(ns, region, [in_s3_only], [0]) == 1, RECOVERY_S)
        assert region_path.read_bytes() == payloads([in_s3_only], CHUNK).tobytes()


def only_on_s3(fs_root, namespace_id: str, keys: list[bytes], used: set[bytes]) -> bytes:
    """One of `keys` (none of them in RAM) that the fs tier does not hold either: which of the
    oldest chunks the full fs tier dropped depends on the order its concurrent writes ended."""
    for key in keys:
        if key not in used and not (Path(fs_root) / chunk_relpath((namespace_id, key))).exists():
            return key
    raise AssertionError("every early chunk is still on the fs tier: none can show an S3 read")


def lookups_reaching_s3(daemon, c, ns, label: str, count: int) -> tuple[int, float]:
    """`count` lookups of keys stored nowhere (each asks S3, past RAM and fs): the S3 operations
    that failed meanwhile, and how long it took."""
    before = tier_stats(daemon, "s3").errors
    started = time.monotonic()
    for key in make_keys(label, count):
        assert c.lookup(ns, [key]).prefix_hits == 0
    return tier_stats(daemon, "s3").errors - before, time.monotonic() - started


def test_radosgw_frozen_then_stopped_costs_a_few_timeouts_not_one_per_lookup(daemon_factory, rgw, ns_name):
    gateway, endpoint = rgw
    failures, reset_s, lookups = 3, 5.0, 30
    root = short_tmpdir("kvfs")
    d = daemon_factory(
        [
            "--write-policy",
            "write-through",
            "--tiers",
            f"kind=fs,root={root},bytes=4MiB",
            "--tiers",
            s3_tier(endpoint, timeout_s="1", breaker_failures=str(failures), breaker_reset_s=str(reset_s)),
        ],
        cpu_bytes="1MiB",
    )
    # RAM holds the last 16, fs ~60 (4 KiB headers; which of the first it drops varies), S3 all.
    keys = make_keys(ns_name, 64)
    with d.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        for i in range(0, 64, 8):
            assert c.store(ns, keys[i : i + 8], payloads(keys[i : i + 8], CHUNK)).stored == 8
        assert wait_for(lambda: tier_stats(d, "s3").stored_chunks == 64 and tier_stats(d, "s3").queued == 0)
        used: set[bytes] = set()
        first = only_on_s3(root, ns.namespace_id, keys[:16], used)
        used.add(first)
        assert c.lookup(ns, [first]).tiers == [Tier.S3]
        loader = VerifyingLoader(d, ns_name, CHUNK, keys[32:])
        phases: list[tuple] = []
        for phase in ("frozen", "stopped"):
            loads_before = loader.counts.loads
            if phase == "frozen":
                with gateway.gateway_frozen():
                    failed, elapsed = lookups_reaching_s3(d, c, ns, f"{ns_name}/{phase}", lookups)
            else:
                gateway.stop_gateway()
                try:
                    failed, elapsed = lookups_reaching_s3(d, c, ns, f"{ns_name}/{phase}", lookups)
                finally:
                    gateway.start_gateway()
            # The breaker opens after `failures` failed operations; each probe after reset_s costs one more.
            allowed = failures + 1 + int(elapsed / reset_s)
            phases.append((phase, lookups, failed, round(elapsed, 1), loader.counts.loads - loads_before))
            assert 1 <= failed <= allowed < lookups, phases
            assert loader.counts.loads > loads_before, f"no load of RAM/fs chunks completed while radosgw was {phase}"
            # Back: the tier recovers (a probe after reset_s finds the gateway) and serves a chunk only it holds.
            only_in_s3 = [only_on_s3(root, ns.namespace_id, keys[:16], used)]  # never promoted so far
            used.add(only_in_s3[0])
            s3_reads = tier_stats(d, "s3").loaded_chunks
            out = np.zeros((1, CHUNK), np.uint8)
            assert wait_for(lambda key=only_in_s3, into=out: c.load(ns, key, into) == 1, RECOVERY_S), phases
            np.testing.assert_array_equal(out, payloads(only_in_s3, CHUNK))
            assert tier_stats(d, "s3").loaded_chunks > s3_reads
        counts = loader.stop()
    print(f"phases (phase, lookups, failed S3 operations, seconds, loads meanwhile): {phases}; loader: {counts}")
    assert counts.wrong_bytes == 0 and counts.short == 0, counts
