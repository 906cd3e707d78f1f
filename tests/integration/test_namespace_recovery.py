# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Namespaces survive a restart: the tiers below RAM keep a record of each namespace they hold, so
after a restart kvstoredctl lists, looks up, evicts and clears them before any client returns,
while a tenant's namespace stays private. A real daemon, a real fs tier, a real radosgw."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from kvstored_client import Tier
from tests.integration.test_ctl import ctl, ok
from tests.integration.test_tier_chain_fs import CHUNK, load_all
from tests.support.daemon import short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.s3 import radosgw_or_fail
from tests.support.wait import wait_for

pytestmark = pytest.mark.radosgw

SALT = b"tenant-a-secret"


@pytest.fixture(scope="module")
def rgw():
    with radosgw_or_fail() as (_, endpoint):
        yield endpoint


def s3_tier(endpoint, bucket: str) -> str:
    return (
        f"kind=s3,bucket={bucket},endpoint_url={endpoint.url},access_key={endpoint.access_key},"
        f"secret_key={endpoint.secret_key},region=us-east-1,timeout_s=5"
    )


def known(daemon) -> dict[str, dict]:
    return {n["namespace_id"]: n for n in json.loads(ok("namespaces", "--json", socket_path=daemon.socket))}


def lookup(daemon, ns_id: str, keys) -> list[str | None]:
    out = json.loads(ok("lookup", "--json", "-n", ns_id, *(k.hex() for k in keys), socket_path=daemon.socket))
    return [k["tier"] for k in out["keys"]]


def test_namespaces_on_fs_and_s3_survive_a_restart_for_kvstoredctl(daemon_factory, rgw, ns_name):
    root, bucket = short_tmpdir("kvfs"), f"kv-{uuid.uuid4().hex[:8]}"
    ladder = ["--tiers", f"kind=fs,root={root},bytes=64MiB", "--tiers", s3_tier(rgw, bucket)]
    d = daemon_factory(ladder, cpu_bytes="4MiB")
    keys, secret_keys = make_keys("recover", 4), make_keys("recover-tenant", 2)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        tenant = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=SALT)
        assert kv.store(ns, keys, payloads(keys, CHUNK)).stored == 4
        assert kv.store(tenant, secret_keys, payloads(secret_keys, CHUNK)).stored == 2
    d.stop()  # writes RAM's chunks down to fs and s3, then their namespaces' records
    records = {p.stem: json.loads(p.read_text()) for p in (root / "_kvstored" / "namespaces").glob("*.json")}
    assert set(records) == {ns.namespace_id, tenant.namespace_id}
    assert records[tenant.namespace_id]["tenant"] is True and SALT.decode() not in json.dumps(records)

    d.start(ladder)
    listed = known(d)
    assert list(listed) == [ns.namespace_id]  # the tenant's namespace is recovered, but not shown
    assert listed[ns.namespace_id]["recovered_from"] == ["fs", "s3"]
    assert listed[ns.namespace_id]["model"] == ns_name and listed[ns.namespace_id]["chunk_bytes"] == CHUNK
    row = next(line for line in ok("namespaces", socket_path=d.socket).splitlines() if line.startswith(ns.namespace_id))
    assert row.split()[-1] == "recovered:fs,s3"

    assert lookup(d, ns.namespace_id, keys) == ["fs"] * 4
    assert "deleted 1 of 1 keys" in ok("evict", "-n", ns.namespace_id, keys[0].hex(), socket_path=d.socket)
    assert lookup(d, ns.namespace_id, keys[:1]) == [None]

    # The tenant's namespace answers others as a miss (not "unknown namespace"), its owner as before.
    assert lookup(d, tenant.namespace_id, secret_keys) == [None, None]
    assert "removed 0 chunks" in ok("clear", "-n", tenant.namespace_id, socket_path=d.socket)
    with d.client() as kv:
        tenant = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=SALT)
        assert kv.lookup(tenant, secret_keys).tiers == [Tier.FS, Tier.FS]
        assert np.array_equal(load_all(kv, tenant, secret_keys), payloads(secret_keys, CHUNK))
        assert list(known(d)) == [ns.namespace_id]
        kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)  # a client registers it again
        assert known(d)[ns.namespace_id]["recovered_from"] == []
    d.stop()

    # A fresh node with only the S3 tier (unbounded: it lists nothing at start) knows it too.
    d.start(["--tiers", s3_tier(rgw, bucket)])
    assert known(d)[ns.namespace_id]["recovered_from"] == ["s3"]
    assert lookup(d, ns.namespace_id, keys) == [None, "s3", "s3", "s3"]  # keys[0] was evicted everywhere
    # a lookup is a use: it promotes what it finds below into RAM (wait for that to settle)
    assert wait_for(lambda: lookup(d, ns.namespace_id, keys) == [None, "ram", "ram", "ram"])
    # 3 from S3 and their copies in RAM (counts are summed over tiers)
    assert "removed 6 chunks" in ok("clear", "-n", ns.namespace_id, socket_path=d.socket)
    assert lookup(d, ns.namespace_id, keys) == [None] * 4
    d.stop()

    d.start(["--tiers", s3_tier(rgw, bucket)])  # cleared: its objects and its record are gone
    assert ns.namespace_id not in known(d)
    proc = ctl("lookup", "-n", ns.namespace_id, keys[1].hex(), socket_path=d.socket)
    assert proc.returncode == 1 and "unknown namespace" in proc.stderr
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert kv.lookup(ns, keys).tiers == [Tier.NONE] * 4
