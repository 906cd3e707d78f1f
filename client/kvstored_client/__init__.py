# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""kvstored client: store and load KV-cache chunks through a local kvstored daemon.

from kvstored_client import Client, chunk_keys
with Client() as kv:
    ns = kv.register_namespace(model="my-model", dtype="bfloat16", chunk_bytes=2 << 20)
    keys = chunk_keys(token_ids, chunk_tokens=256, namespace_id=ns.namespace_id)
    kv.store(ns, keys, chunks)
"""

from kvstored_client.aio import AsyncClient
from kvstored_client.blocks import BlockIdentity, chunk_identities
from kvstored_client.client import Client
from kvstored_client.errors import KvstoredError, TransferOutcomeUnknown, Unavailable
from kvstored_client.keys import chunk_keys, namespace_id_for
from kvstored_client.kinds import DropReason, LoadInto, StoreOutcome, TierKind
from kvstored_client.ops import Health, LookupResult, Namespace, NamespaceSpec, Region, StoreResult, Tier

__all__ = [
    "AsyncClient",
    "BlockIdentity",
    "Client",
    "DropReason",
    "Health",
    "KvstoredError",
    "LoadInto",
    "LookupResult",
    "Namespace",
    "NamespaceSpec",
    "Region",
    "StoreOutcome",
    "StoreResult",
    "Tier",
    "TierKind",
    "TransferOutcomeUnknown",
    "Unavailable",
    "chunk_identities",
    "chunk_keys",
    "namespace_id_for",
]
