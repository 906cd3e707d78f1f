# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Namespace registry: model/layout scopes for keys. Ids are derived from the declaring fields,
so every process and every daemon that declares the same namespace agrees on its id.

A namespace is known by registration (a client declares it) or by recovery: the tiers below RAM
keep a small record of each namespace they hold chunks of (`encode_record`), read back at start,
so an operator can inspect and purge what is on disk before any client returns."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvstored.errors import BatchTooLarge, InvalidRequest, PoolExhausted, UnknownNamespace, shown
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
    tenant: str = ""  # registered with a tenant salt: that tenant's key (see tenant_key); "" public
    # How fast the engine recomputes (registration only, never in a record): 0 is unknown.
    prefill_tokens_per_s: float = 0.0
    kv_bytes_per_token: int = 0

    @property
    def private(self) -> bool:
        """A tenant namespace: only the sessions that registered it may see it."""
        return bool(self.tenant)

    @property
    def recompute_bytes_per_s(self) -> float:
        """The load rate at which loading a chunk takes as long as recomputing its tokens (the
        break-even); 0 where the engine did not say how fast it recomputes."""
        return self.prefill_tokens_per_s * self.kv_bytes_per_token

    @property
    def recompute_chunk_s(self) -> float:
        """Seconds the engine takes to recompute one chunk's tokens (0: unknown)."""
        rate = self.recompute_bytes_per_s
        return self.chunk_bytes / rate if rate else 0.0


def tenant_key(salt: bytes) -> str:
    """A tenant's name inside the daemon (arenas, quotas, metrics): a digest of its salt, which
    itself is never kept or shown. "" for no salt."""
    return hashlib.sha256(b"kvstored-tenant\0" + salt).hexdigest()[:16] if salt else ""


# The tenant of a tenant namespace recovered from a tier's record: the record keeps no salt (nor
# anything derived from it), so the namespace is private to nobody until a session registers it
# again with its salt, which replaces this with the real tenant key.
RECOVERED_TENANT = "recovered"


RECORD_FORMAT = 1
_ENGINE_FIELDS = ("prefill_tokens_per_s", "kv_bytes_per_token")


def encode_record(ns: Namespace) -> bytes:
    """The record a tier keeps of a namespace it holds chunks of. A tenant namespace's record says
    so, without its salt: recovered, it stays private until a session registers it again."""
    fields = asdict(ns)
    fields["tenant"] = ns.private  # whether, never which (see RECOVERED_TENANT)
    for engine_only in _ENGINE_FIELDS:  # the engine's speed is its registration's, not the tier's
        del fields[engine_only]
    return json.dumps({"format": RECORD_FORMAT, **fields}, sort_keys=True).encode()


def decode_record(namespace_id: str, raw: bytes) -> Namespace:
    """The namespace a record describes; ValueError (naming what is wrong) for anything that is
    not a record of `namespace_id`. A public namespace's id must follow from its fields, so a
    record cannot make a tenant's namespace public."""
    try:
        fields = json.loads(raw)
        if not isinstance(fields, dict) or fields.get("format") != RECORD_FORMAT:
            raise ValueError(f"not a format-{RECORD_FORMAT} namespace record")
        ns = Namespace(
            namespace_id=_typed(fields, "namespace_id", str),
            model=_typed(fields, "model", str),
            dtype=_typed(fields, "dtype", str),
            chunk_bytes=_typed(fields, "chunk_bytes", int),
            layout=_typed(fields, "layout", str),
            key_bytes=_typed(fields, "key_bytes", int),
            block_tokens=_typed(fields, "block_tokens", int),
            tenant=RECOVERED_TENANT if _typed(fields, "tenant", bool) else "",
        )
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"namespace record is not JSON: {exc}") from None
    if ns.namespace_id != namespace_id:
        raise ValueError(f"record names namespace {ns.namespace_id!r}, stored as {namespace_id!r}")
    public = namespace_id_for(ns.model, ns.dtype, ns.chunk_bytes, ns.layout, b"", ns.key_bytes) == namespace_id
    if public == ns.private:
        raise ValueError(
            "its fields give a public namespace id for a tenant namespace"
            if public
            else "its fields do not give its namespace id"
        )
    return ns


def _typed(fields: dict, name: str, kind: type):
    value = fields.get(name)
    if type(value) is not kind:  # (bool is an int: exact types only)
        raise ValueError(f"namespace record field {name!r} must be {kind.__name__}, got {value!r}")
    return value


class TooManyNamespaces(PoolExhausted):
    """max_namespaces are registered: a new one is refused (RESOURCE_EXHAUSTED)."""


class NamespaceRegistry:
    def __init__(self, pool_bytes: int, max_namespaces: int = 1 << 62) -> None:
        """max_namespaces bounds what clients register; those recovered from tiers' records
        at start are always known."""
        self._pool_bytes = pool_bytes
        self._max = max_namespaces
        self._by_id: dict[str, Namespace] = {}
        self._recovered: dict[str, tuple[str, ...]] = {}  # recovered and not registered since: tier names

    def __len__(self) -> int:
        return len(self._by_id)

    def register(
        self,
        model: str,
        dtype: str,
        chunk_bytes: int,
        layout: str,
        tenant_salt: bytes,
        key_bytes: int,
        block_tokens: int = 0,
        prefill_tokens_per_s: float = 0.0,
        kv_bytes_per_token: int = 0,
    ) -> Namespace:
        """Declare a namespace (or again). Not part of the id, and kept from earlier registrations
        where this one gives none: block_tokens, and the recompute rates (given together: the
        latest non-zero prefill rate wins, with its bytes per token)."""
        if not model:
            raise InvalidRequest("namespace needs a model name")
        for name, value in (("model", model), ("dtype", dtype), ("layout", layout), ("tenant_salt", tenant_salt)):
            size = len(value.encode() if isinstance(value, str) else value)
            if size > MAX_NAME_BYTES:
                raise InvalidRequest(f"namespace {name} is {size} bytes; at most {MAX_NAME_BYTES}")
        key_bytes = key_bytes or DEFAULT_KEY_BYTES
        self._check_sizes(chunk_bytes, key_bytes)
        kv_bytes_per_token = _check_rates(chunk_bytes, block_tokens, prefill_tokens_per_s, kv_bytes_per_token)
        ns_id = namespace_id_for(model, dtype, chunk_bytes, layout, tenant_salt, key_bytes)
        ns = Namespace(
            ns_id,
            model,
            dtype,
            chunk_bytes,
            layout,
            key_bytes,
            block_tokens,
            tenant_key(tenant_salt),
            prefill_tokens_per_s,
            kv_bytes_per_token if prefill_tokens_per_s else 0,
        )
        known = self._by_id.get(ns_id)
        if known is None and len(self._by_id) >= self._max:
            raise TooManyNamespaces(
                f"{len(self._by_id)} namespaces are registered (max_namespaces={self._max}); "
                f"a new one cannot be, until a restart with a larger max_namespaces"
            )
        # A registration replaces what a record said (a recovered tenant namespace learns its
        # tenant here); what it leaves out, an earlier one may have said.
        recovered = self._recovered.pop(ns_id, None) is not None
        if known is not None:
            if not block_tokens or (known.block_tokens and not recovered):  # once given, kept
                ns = dataclasses.replace(ns, block_tokens=known.block_tokens)
            if not prefill_tokens_per_s:
                ns = dataclasses.replace(
                    ns, prefill_tokens_per_s=known.prefill_tokens_per_s, kv_bytes_per_token=known.kv_bytes_per_token
                )
            if ns == known:
                return known
        self._by_id[ns_id] = ns
        return ns

    def recover(self, ns: Namespace, tier: str) -> None:
        """Know `ns` from a tier's record (at start). Raises InvalidRequest if this daemon could
        not serve it (a chunk larger than the RAM tier, a key length out of range)."""
        self._check_sizes(ns.chunk_bytes, ns.key_bytes)
        known = self._by_id.get(ns.namespace_id)
        tiers = self._recovered.get(ns.namespace_id, ())
        if known is not None and not tiers:
            return  # registered by a client: that registration stands
        if known is None or (ns.block_tokens and not known.block_tokens):
            self._by_id[ns.namespace_id] = ns
        if tier not in tiers:
            self._recovered[ns.namespace_id] = tiers + (tier,)

    def recovered(self) -> dict[str, tuple[str, ...]]:
        """Namespaces known from tier records and not registered since: their tiers (for a hand-over)."""
        return dict(self._recovered)

    def adopt(self, ns: Namespace, recovered_from: tuple[str, ...] = ()) -> None:
        """Know a namespace the previous daemon knew (a hand-over), as it knew it."""
        self._check_sizes(ns.chunk_bytes, ns.key_bytes)
        self._by_id[ns.namespace_id] = ns
        if recovered_from:
            self._recovered[ns.namespace_id] = recovered_from

    def recovered_from(self, namespace_id: str) -> tuple[str, ...]:
        """The tiers whose records brought the namespace back at start; () once a client has
        registered it (or for one only registered)."""
        return self._recovered.get(namespace_id, ())

    def find(self, namespace_id: str) -> Namespace | None:
        return self._by_id.get(namespace_id)

    def block_tokens(self, namespace_id: str) -> int:
        ns = self._by_id.get(namespace_id)
        return ns.block_tokens if ns else 0

    def model_of(self, namespace_id: str) -> str:
        """The namespace's model ("" for one not registered since the daemon started)."""
        ns = self._by_id.get(namespace_id)
        return ns.model if ns else ""

    def _check_sizes(self, chunk_bytes: int, key_bytes: int) -> None:
        if chunk_bytes <= 0:
            raise InvalidRequest("namespace chunk_bytes must be positive")
        if chunk_bytes > self._pool_bytes:
            raise InvalidRequest(f"chunk_bytes {chunk_bytes} exceeds the RAM tier ({self._pool_bytes} bytes)")
        if not MIN_KEY_BYTES <= key_bytes <= MAX_KEY_BYTES:
            raise InvalidRequest(f"key_bytes must be between {MIN_KEY_BYTES} and {MAX_KEY_BYTES}, got {key_bytes}")

    def get(self, namespace_id: str) -> Namespace:
        try:
            return self._by_id[namespace_id]
        except KeyError:
            raise UnknownNamespace(
                f"unknown namespace {shown(namespace_id)}: register it first (RegisterNamespace)"
            ) from None

    def all(self) -> list[Namespace]:
        return list(self._by_id.values())


def _check_rates(chunk_bytes: int, block_tokens: int, prefill_tokens_per_s: float, kv_bytes_per_token: int) -> int:
    """The namespace's KV bytes per token (given, or chunk_bytes / block_tokens); InvalidRequest
    naming the field for a rate that is negative, not finite, or cannot be used."""
    if not math.isfinite(prefill_tokens_per_s) or prefill_tokens_per_s < 0:
        raise InvalidRequest(
            f"namespace prefill_tokens_per_s must be a finite number >= 0 (0: unknown), got {prefill_tokens_per_s}"
        )
    if kv_bytes_per_token > chunk_bytes:
        raise InvalidRequest(
            f"namespace kv_bytes_per_token {kv_bytes_per_token} exceeds chunk_bytes {chunk_bytes}: "
            "a chunk holds at least one token"
        )
    per_token = kv_bytes_per_token or (chunk_bytes // block_tokens if block_tokens else 0)
    if prefill_tokens_per_s and not per_token:
        raise InvalidRequest("namespace prefill_tokens_per_s needs kv_bytes_per_token (or block_tokens) too")
    return per_token


def check_keys(ns: Namespace, keys: Sequence[bytes], max_keys: int) -> None:
    if len(keys) > max_keys:
        raise BatchTooLarge(f"batch of {len(keys)} keys exceeds max_batch_keys={max_keys}")
    if set(map(len, keys)) <= {ns.key_bytes}:  # (in C: lookups of hundreds of keys per engine step)
        return
    for i, key in enumerate(keys):
        if len(key) != ns.key_bytes:
            raise InvalidRequest(
                f"key {i} is {len(key)} bytes; namespace {ns.namespace_id} uses {ns.key_bytes}-byte keys"
            )
