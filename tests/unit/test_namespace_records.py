# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Namespace records: what a tier keeps so a restarted daemon knows its namespaces (and cannot be
fooled by a record into exposing a tenant's namespace), and the registry's recovered marker."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvstored.errors import InvalidRequest
from kvstored.namespaces import (
    RECOVERED_TENANT,
    Namespace,
    NamespaceRegistry,
    TooManyNamespaces,
    decode_record,
    encode_record,
)
from kvstored.tiers.fs.tier import FsTier

MIB = 1 << 20


def registered(salt: bytes = b"") -> Namespace:
    return NamespaceRegistry(64 * MIB).register("m", "bf16", MIB, "tp1", salt, 32, block_tokens=16)


def test_a_record_round_trips_and_names_no_salt():
    for ns in (registered(), registered(b"tenant-secret")):
        raw = encode_record(ns)
        assert b"tenant-secret" not in raw and b"salt" not in raw
        assert ns.tenant.encode() not in raw or not ns.private  # nor the tenant key derived from it
        back = decode_record(ns.namespace_id, raw)
        # A recovered tenant namespace is private to no tenant until registered again with its salt
        assert back == (dataclasses.replace(ns, tenant=RECOVERED_TENANT) if ns.private else ns)
    assert json.loads(encode_record(registered(b"x")))["tenant"] is True


@pytest.mark.parametrize(
    "change, error",
    [
        ({"model": "other"}, "do not give its namespace id"),  # a forged public record
        ({"tenant": True}, "public namespace id for a tenant"),  # would hide a public namespace
        ({"chunk_bytes": "1048576"}, "chunk_bytes"),  # wrong type
        ({"format": 99}, "format-1"),
    ],
)
def test_a_record_that_does_not_add_up_is_refused(change, error):
    ns = registered()
    fields = {**json.loads(encode_record(ns)), **change}
    with pytest.raises(ValueError, match=error):
        decode_record(ns.namespace_id, json.dumps(fields).encode())


def test_a_tenant_record_cannot_be_made_public():
    tenant = registered(b"s")
    fields = {**json.loads(encode_record(tenant)), "tenant": False}
    with pytest.raises(ValueError, match="do not give its namespace id"):
        decode_record(tenant.namespace_id, json.dumps(fields).encode())


def test_a_record_stored_under_another_id_or_not_json_is_refused():
    ns = registered()
    with pytest.raises(ValueError, match="stored as"):
        decode_record("0" * 32, encode_record(ns))
    with pytest.raises(ValueError, match="not JSON"):
        decode_record(ns.namespace_id, b"\xff{")


def test_registry_marks_recovered_namespaces_until_a_client_registers_them():
    reg = NamespaceRegistry(64 * MIB)
    ns = registered()
    reg.recover(ns, "fs")
    reg.recover(ns, "s3")
    reg.recover(ns, "s3")
    assert reg.find(ns.namespace_id) == ns and reg.recovered_from(ns.namespace_id) == ("fs", "s3")
    assert reg.register("m", "bf16", MIB, "tp1", b"", 32) == ns
    assert reg.recovered_from(ns.namespace_id) == ()
    reg.recover(ns, "peer")  # (a registration stands)
    assert reg.recovered_from(ns.namespace_id) == ()


def test_a_recovered_tenant_namespace_learns_its_tenant_when_registered_again():
    """Recovered, a tenant namespace belongs to no tenant (its record keeps no salt); registered
    again with the salt it gets that tenant's key, so two tenants' recovered namespaces never
    share an arena or a quota."""
    registry = NamespaceRegistry(64 * MIB)
    mine, theirs = registered(b"salt-a"), registered(b"salt-b")
    for ns in (mine, theirs):
        registry.recover(decode_record(ns.namespace_id, encode_record(ns)), "fs")
        assert registry.get(ns.namespace_id).tenant == RECOVERED_TENANT
    again = registry.register("m", "bf16", MIB, "tp1", b"salt-a", 32)
    assert again.tenant == mine.tenant != theirs.tenant and again.block_tokens == 16
    assert registry.recovered_from(mine.namespace_id) == ()
    assert registry.get(theirs.namespace_id).tenant == RECOVERED_TENANT


def test_registry_refuses_to_recover_what_it_could_not_serve():
    big = NamespaceRegistry(64 * MIB).register("m", "bf16", 32 * MIB, "", b"", 32)
    with pytest.raises(InvalidRequest, match="exceeds the RAM tier"):
        NamespaceRegistry(16 * MIB).recover(big, "fs")


async def test_fs_tier_keeps_records_beside_its_chunks_and_the_index_ignores_them(tmp_path):
    ns, tenant = registered(), registered(b"s")
    tier = FsTier("fs", tmp_path, 64 * MIB)
    await tier.start()
    await tier.save_namespace_record(ns.namespace_id, encode_record(ns))
    await tier.save_namespace_record(tenant.namespace_id, encode_record(tenant))
    await tier.save_namespace_record(ns.namespace_id, encode_record(ns))  # replaced, not duplicated
    assert await tier.namespace_records() == {
        ns.namespace_id: encode_record(ns),
        tenant.namespace_id: encode_record(tenant),
    }
    await tier.remove_namespace_record(tenant.namespace_id)
    await tier.remove_namespace_record(tenant.namespace_id)  # (gone already: no error)
    await tier.close()

    again = FsTier("fs", tmp_path, 64 * MIB)
    await again.start()  # the index rebuild walks the root: records are not chunks
    assert again.usage().chunks == 0
    assert list(await again.namespace_records()) == [ns.namespace_id]
    await again.close()


def test_registrations_past_max_namespaces_are_refused_but_records_still_recover():
    reg = NamespaceRegistry(64 * MIB, max_namespaces=2)
    first = reg.register("m1", "bf16", MIB, "", b"", 32)
    reg.register("m2", "bf16", MIB, "", b"", 32)
    with pytest.raises(TooManyNamespaces, match=r"2 namespaces are registered \(max_namespaces=2\)"):
        reg.register("m3", "bf16", MIB, "", b"", 32)
    assert reg.register("m1", "bf16", MIB, "", b"", 32, block_tokens=16).namespace_id == first.namespace_id
    # What tiers' records bring back at start is known whatever the bound (the chunks are there).
    reg.recover(NamespaceRegistry(64 * MIB).register("m4", "bf16", MIB, "", b"", 32), "fs")
    assert len(reg) == 3
