# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The API is usable with stock tools: grpcurl over the unix socket, via server reflection."""

from __future__ import annotations

import base64
import json
import subprocess

import numpy as np
import pytest

from kvstored_client.keys import namespace_id_for
from tests.support.daemon import REPO_ROOT
from tests.support.data import make_keys, payloads
from tests.support.rpc import pb

CHUNK = 64 << 10


@pytest.fixture
def grpcurl_run(grpcurl, shared_daemon):
    def run(*args: str, data: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
        argv = [grpcurl, "-plaintext", "-unix"]
        if data is not None:
            argv += ["-d", json.dumps(data)]
        argv += [str(shared_daemon.socket), *args]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if check:
            assert out.returncode == 0, (argv, out.stdout, out.stderr)
        return out

    return run


def b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


def test_list_shows_the_services(grpcurl_run):
    services = set(grpcurl_run("list").stdout.split())
    assert "kvstored.v1.KVStore" in services
    assert "kvstored.v1.Peer" in services  # the peer tier's control plane (Status answers without one)
    assert "grpc.health.v1.Health" in services
    assert any(s.startswith("grpc.reflection.") and s.endswith(".ServerReflection") for s in services), services


def test_list_methods_and_describe(grpcurl_run):
    rpcs = [m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods]
    listed = set(grpcurl_run("list", "kvstored.v1.KVStore").stdout.split())
    assert listed == {f"kvstored.v1.KVStore.{name}" for name in rpcs}
    described = grpcurl_run("describe", "kvstored.v1.KVStore").stdout
    assert "kvstored.v1.KVStore is a service" in described
    for name in rpcs:
        assert f"rpc {name} (" in described, name
    message = grpcurl_run("describe", "kvstored.v1.NamespaceSpec").stdout
    for field in ("model", "dtype", "chunk_bytes", "layout", "tenant_salt", "key_bytes"):
        assert field in message


def test_health_check_is_serving(grpcurl_run):
    assert json.loads(grpcurl_run("grpc.health.v1.Health/Check").stdout) == {"status": "SERVING"}
    named = grpcurl_run("grpc.health.v1.Health/Check", data={"service": "kvstored.v1.KVStore"})
    assert json.loads(named.stdout) == {"status": "SERVING"}


def test_stats(grpcurl_run):
    stats = json.loads(grpcurl_run("kvstored.v1.KVStore/Stats", data={}).stdout)
    ram = stats["tiers"][0]
    assert ram["name"] == "ram"
    assert ram["kind"] == "TIER_KIND_RAM"
    assert int(ram["capacity_bytes"]) == 64 << 20  # uint64 travels as a JSON string
    assert stats["version"]


def test_register_namespace_and_lookup_with_json(grpcurl_run, shared_daemon, ns_name):
    spec = {"model": ns_name, "dtype": "bfloat16", "chunk_bytes": str(CHUNK), "layout": "tp1"}
    reg = json.loads(grpcurl_run("kvstored.v1.KVStore/RegisterNamespace", data={"spec": spec}).stdout)
    ns_id = reg["namespace_id"]
    assert ns_id == namespace_id_for(ns_name, "bfloat16", CHUNK, "tp1")
    assert int(reg["chunk_bytes"]) == CHUNK and reg["key_bytes"] == 32
    assert int(reg["pool_bytes"]) == 64 << 20

    # Store one key with the Python client, then look both up from grpcurl (bytes are base64).
    keys = make_keys(ns_name, 2)
    with shared_daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="bfloat16", chunk_bytes=CHUNK, layout="tp1")
        assert c.store(ns, keys[:1], payloads(keys[:1], CHUNK)).stored == 1
    found = json.loads(
        grpcurl_run("kvstored.v1.KVStore/Lookup", data={"namespace_id": ns_id, "keys": [b64(k) for k in keys]}).stdout
    )
    assert found["prefix_hits"] == 1
    assert found["tiers"] == ["TIER_KIND_RAM", "TIER_KIND_UNSPECIFIED"]
    # what a newcomer sees for the miss is explained where the docs show this call
    grpcurl_doc = (REPO_ROOT / "docs" / "operations.md").read_text().split("## Inspecting with grpcurl", 1)[1]
    assert "`TIER_KIND_UNSPECIFIED` (0, the enum's default) for a **miss**" in grpcurl_doc.split("\n## ", 1)[0]

    deleted = json.loads(
        grpcurl_run("kvstored.v1.KVStore/Delete", data={"namespace_id": ns_id, "keys": [b64(keys[0])]}).stdout
    )
    assert deleted["deleted"] == 1
    with shared_daemon.client() as c:
        assert c.lookup(ns, keys).prefix_hits == 0
        assert c.load(ns, keys[:1], np.zeros((1, CHUNK), np.uint8)) == 0


def test_errors_show_code_and_message(grpcurl_run, ns_name):
    spec = {"model": ns_name, "dtype": "uint8", "chunk_bytes": str(CHUNK)}
    ns_id = json.loads(grpcurl_run("kvstored.v1.KVStore/RegisterNamespace", data={"spec": spec}).stdout)["namespace_id"]
    bad = grpcurl_run("kvstored.v1.KVStore/Lookup", data={"namespace_id": ns_id, "keys": [b64(b"short")]}, check=False)
    assert bad.returncode != 0
    assert "InvalidArgument" in bad.stderr and "5 bytes" in bad.stderr
    missing = grpcurl_run("kvstored.v1.KVStore/Lookup", data={"namespace_id": "nope", "keys": []}, check=False)
    assert missing.returncode != 0
    assert "NotFound" in missing.stderr and "nope" in missing.stderr


def test_peer_status_as_the_docs_show_it(grpcurl, grpcurl_run, shared_daemon):
    """docs/operations.md: without -emit-defaults grpcurl prints `{}` for a reply of defaults;
    with it, a daemon without a peer tier says "enabled": false."""
    assert json.loads(grpcurl_run("kvstored.v1.Peer/Status").stdout) == {}
    documented = "grpcurl -plaintext -unix -emit-defaults $S kvstored.v1.Peer/Status"
    assert documented in (REPO_ROOT / "docs" / "operations.md").read_text()
    argv = [grpcurl, "-plaintext", "-unix", "-emit-defaults", str(shared_daemon.socket), "kvstored.v1.Peer/Status"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout)["enabled"] is False
