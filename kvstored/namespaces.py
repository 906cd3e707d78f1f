"""Namespace registry: model/layout scopes for keys. Ids are derived from the declaring fields,
so every process and every daemon that declares the same namespace agrees on its id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvstored.errors import BatchTooLarge, InvalidRequest, UnknownNamespace, shown
from kvstored_client.keys import namespace_id_for

MIN_KEY_BYTES, MAX_KEY_BYTES, DEFAULT_KEY_BYTES = 8, 64, 32
MAX_NAME_BYTES = 4096  # model, dtype, layout, tenant salt: each namespace is kept (and listed) for good


@dataclass(frozen=True, slots=True)
class Namespace:
    namespace_id: str
    model: str
    dtype: str
    chunk_bytes: int
    layout: str
    key_bytes: int
    block_tokens: int = 0  # tokens per chunk, for KV events (0: not given)
    private: bool = False  # registered with a tenant salt: only its sessions may see it


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
        for name, value in (("model", model), ("dtype", dtype), ("layout", layout), ("tenant_salt", tenant_salt)):
            size = len(value.encode() if isinstance(value, str) else value)
            if size > MAX_NAME_BYTES:
                raise InvalidRequest(f"namespace {name} is {size} bytes; at most {MAX_NAME_BYTES}")
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
        ns = Namespace(ns_id, model, dtype, chunk_bytes, layout, key_bytes, block_tokens, bool(tenant_salt))
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
                f"unknown namespace {shown(namespace_id)}: register it first (RegisterNamespace)"
            ) from None

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
