"""Namespace registry: model/layout scopes for keys. Ids are derived from the declaring fields,
so every process and every daemon that declares the same namespace agrees on its id."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

from kvstored.errors import BatchTooLarge, InvalidRequest, UnknownNamespace
from kvstored_client.keys import namespace_id_for

MIN_KEY_BYTES, MAX_KEY_BYTES, DEFAULT_KEY_BYTES = 8, 64, 32


@dataclass(frozen=True, slots=True)
class Namespace:
    namespace_id: str
    model: str
    dtype: str
    chunk_bytes: int
    layout: str
    key_bytes: int
    block_tokens: int = 0  # tokens per chunk, for KV events (0: not given)
    tenant: str = ""  # registered with a tenant salt: that tenant's key (see tenant_key); "" public

    @property
    def private(self) -> bool:
        """A tenant namespace: only the sessions that registered it may see it."""
        return bool(self.tenant)


def tenant_key(salt: bytes) -> str:
    """A tenant's name inside the daemon (arenas, quotas, metrics): a digest of its salt, which
    itself is never kept or shown. "" for no salt."""
    return hashlib.sha256(b"kvstored-tenant\0" + salt).hexdigest()[:16] if salt else ""


class NamespaceRegistry:
    def __init__(self, pool_bytes: int) -> None:
        self._pool_bytes = pool_bytes
        self._by_id: dict[str, Namespace] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def register(
        self, model: str, dtype: str, chunk_bytes: int, layout: str, tenant_salt: bytes, key_bytes: int,
        block_tokens: int = 0,
    ) -> Namespace:
        if not model:
            raise InvalidRequest("namespace needs a model name")
        if chunk_bytes <= 0:
            raise InvalidRequest("namespace chunk_bytes must be positive")
        if chunk_bytes > self._pool_bytes:
            raise InvalidRequest(
                f"chunk_bytes {chunk_bytes} exceeds the RAM tier ({self._pool_bytes} bytes)"
            )
        key_bytes = key_bytes or DEFAULT_KEY_BYTES
        if not MIN_KEY_BYTES <= key_bytes <= MAX_KEY_BYTES:
            raise InvalidRequest(
                f"key_bytes must be between {MIN_KEY_BYTES} and {MAX_KEY_BYTES}, got {key_bytes}"
            )
        ns_id = namespace_id_for(model, dtype, chunk_bytes, layout, tenant_salt, key_bytes)
        ns = Namespace(ns_id, model, dtype, chunk_bytes, layout, key_bytes, block_tokens, tenant_key(tenant_salt))
        known = self._by_id.setdefault(ns_id, ns)
        if block_tokens and not known.block_tokens:
            self._by_id[ns_id] = known = ns
        return known

    def block_tokens(self, namespace_id: str) -> int:
        ns = self._by_id.get(namespace_id)
        return ns.block_tokens if ns else 0

    def get(self, namespace_id: str) -> Namespace:
        try:
            return self._by_id[namespace_id]
        except KeyError:
            raise UnknownNamespace(
                f"unknown namespace {namespace_id!r}: register it first (RegisterNamespace)"
            ) from None

    def find(self, namespace_id: str) -> Namespace | None:
        return self._by_id.get(namespace_id)

    def all(self) -> list[Namespace]:
        return list(self._by_id.values())


def check_keys(ns: Namespace, keys: Sequence[bytes], max_keys: int) -> None:
    if len(keys) > max_keys:
        raise BatchTooLarge(f"batch of {len(keys)} keys exceeds max_batch_keys={max_keys}")
    if all(len(key) == ns.key_bytes for key in keys):
        return
    for i, key in enumerate(keys):
        if len(key) != ns.key_bytes:
            raise InvalidRequest(
                f"key {i} is {len(key)} bytes; namespace {ns.namespace_id} uses {ns.key_bytes}-byte keys"
            )
