# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""RAM -> fs -> S3 through a real daemon, with a real radosgw on loopback (one per module)."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from kvstored_client import Tier
from tests.integration.test_tier_chain_fs import CHUNK, fill, fs_files, load_all, tier_stats
from tests.support.daemon import short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.s3 import radosgw_or_fail
from tests.support.wait import wait_for

pytestmark = pytest.mark.radosgw


@pytest.fixture(scope="module")
def rgw():
    with radosgw_or_fail() as (gateway, endpoint):
        yield gateway, endpoint


def ladder_args(root, endpoint, bucket: str, fs_bytes: str = "512KiB", **s3: str) -> list[str]:
    s3_spec = ",".join(
        [
            f"kind=s3,bucket={bucket},endpoint_url={endpoint.url},access_key={endpoint.access_key}",
            f"secret_key={endpoint.secret_key},timeout_s=5,region=us-east-1",
        ]
        + [f"{k}={v}" for k, v in s3.items()]
    )
    return ["--tiers", f"kind=fs,root={root},bytes={fs_bytes}", "--tiers", s3_spec]


def test_evictions_land_in_fs_and_s3_and_come_back_exact(daemon_factory, rgw, ns_name):
    _, endpoint = rgw
    root = short_tmpdir("kvfs")
    d = daemon_factory(ladder_args(root, endpoint, f"kv-{uuid.uuid4().hex[:8]}"), cpu_bytes="1MiB")
    keys = make_keys("s3-ladder", 40)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        fill(kv, ns, keys)
        stats = tier_stats(d)
        assert stats["ram"].dropped_dirty == 0
        assert stats["s3"].stored_chunks >= 24  # every RAM eviction also went to S3
        assert stats["fs"].evictions > 0  # the small fs tier let older chunks go...
        on_fs = fs_files(root)
        only_s3 = [k for k in keys[:24] if k.hex() not in on_fs]
        assert only_s3  # ...which now live in S3 alone

        looked = kv.lookup(ns, keys)
        assert looked.prefix_hits == 40
        assert looked.tiers[keys.index(only_s3[0])] == Tier.S3
        assert np.array_equal(load_all(kv, ns, keys), payloads(keys, CHUNK))
        assert tier_stats(d)["s3"].loaded_chunks >= len(only_s3)


def test_s3_outage_keeps_ram_and_fs_serving_and_s3_returns(daemon_factory, rgw, ns_name):
    gateway, endpoint = rgw
    root = short_tmpdir("kvfs")
    d = daemon_factory(
        ladder_args(root, endpoint, f"kv-{uuid.uuid4().hex[:8]}", fs_bytes="64MiB", timeout_s="2", breaker_reset_s="1"),
        cpu_bytes="1MiB",
    )
    first, during, after = make_keys("before", 24), make_keys("during", 24), make_keys("after", 24)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        fill(kv, ns, first)
        s3_before = tier_stats(d)["s3"].stored_chunks
        assert s3_before > 0
        gateway.stop_gateway()
        try:
            fill(kv, ns, during)  # S3 write-downs fail; fs still takes every chunk
            # (packed: the failure shows once the open pack's PUT has timed out, seconds later)
            assert wait_for(lambda: tier_stats(d)["s3"].errors > 0, 30)
            stats = tier_stats(d)
            assert stats["ram"].dropped_dirty == 0
            s3_during = stats["s3"].stored_chunks
            everything = first + during
            assert kv.lookup(ns, everything).prefix_hits == len(everything)
            assert np.array_equal(load_all(kv, ns, everything), payloads(everything, CHUNK))
        finally:
            gateway.start_gateway()
        time.sleep(1.5)  # past breaker_reset_s: the next write-down probes S3 again
        deadline = time.monotonic() + 30
        while tier_stats(d)["s3"].stored_chunks <= s3_during and time.monotonic() < deadline:
            fill(kv, ns, after)
            after = make_keys(f"after-{time.monotonic()}", 24)
        assert tier_stats(d)["s3"].stored_chunks > s3_during


def test_restart_with_an_empty_fs_tier_still_serves_from_s3(daemon_factory, rgw, ns_name):
    _, endpoint = rgw
    bucket = f"kv-{uuid.uuid4().hex[:8]}"
    keys = make_keys("s3-restart", 32)
    d = daemon_factory(ladder_args(short_tmpdir("kvfs"), endpoint, bucket, fs_bytes="64MiB"), cpu_bytes="1MiB")
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        fill(kv, ns, keys)
    d.stop()
    s3_keys = keys[:16]  # evicted from RAM, hence written to S3
    d.start(ladder_args(short_tmpdir("kvfs"), endpoint, bucket, fs_bytes="64MiB"))  # a fresh node
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert kv.lookup(ns, s3_keys).tiers == [Tier.S3] * len(s3_keys)
        assert np.array_equal(load_all(kv, ns, s3_keys), payloads(s3_keys, CHUNK))


@pytest.mark.parametrize(
    "access_key, secret_key",
    [("kvstored-nobody", "whatever"), (None, "not-the-secret")],
    ids=["unknown-key", "wrong-secret"],
)
def test_credentials_refused_at_start_exit_2_without_a_restart_loop(daemon_factory, rgw, access_key, secret_key):
    """Bad credentials are a configuration error: exit 2 (RestartPreventExitStatus=2 in the unit),
    not 1, which systemd's Restart=on-failure would retry every 2 s forever."""
    _, endpoint = rgw
    d = daemon_factory(start=False)
    # from the environment, as the systemd unit's EnvironmentFile hands them over
    creds = {"AWS_ACCESS_KEY_ID": access_key or endpoint.access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    d.spawn(["--tiers", f"kind=s3,bucket=kv-creds,endpoint_url={endpoint.url},region=us-east-1,timeout_s=5"], env=creds)
    assert d.wait(timeout=120) == 2, d.log
    errors = [line for line in d.log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cannot start tier 's3'" in errors[0], d.log
    assert "rejected: 403 (credentials refused: check access_key/secret_key" in errors[0]
    assert "Traceback" not in d.log and not d.socket.exists()
    assert "populating" not in d.log  # refused by the check before the RAM tier is populated
