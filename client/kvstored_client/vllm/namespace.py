# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Namespaces for vLLM's offloaded chunks.

A namespace scopes keys by everything that changes the bytes of a chunk. It is derived from the
fields vLLM's own fs tier hashes into its directory name (`FileMapper`: model, dtype, tokens per
hash, blocks per chunk, parallel sizes, rank, KV-cache group layout, canonical format...), plus the
chunk size, the kind of chunk (a whole primary-tier row, or one worker's part of it) and, when a
request carries one, its cache salt. Two vLLM instances serving the same model with the same
layout derive the same namespace and share chunks; any difference gives another namespace, so
chunks of different models or layouts never collide.

Keys are vLLM's `OffloadKey`s (block hash + 4-byte group index, 36 bytes with sha256), registered
with `key_bytes = len(key)`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstored_client.ops import NamespaceSpec

# What a chunk holds; part of the layout so the two integrations never read each other's chunks.
TIER_ROW_FORMAT = "vllm-primary-row/1"  # secondary tier: one row of the primary CPU region
WORKER_PART_FORMAT = "vllm-worker-part/1"  # direct spec: one worker's bytes of a chunk
SHA256_OFFLOAD_KEY_BYTES = 36
CACHE_SALT_PARAM = "cache_salt"  # kv_transfer_params key whose value scopes a request's chunks
# The engine's prefill rate (tokens/s), which vLLM does not measure: a config option of either
# integration, else this environment variable; unset, 0: unknown (every hit below RAM counts).
PREFILL_OPTION = "prefill_tokens_per_s"
PREFILL_ENV = "KVSTORED_PREFILL_TOKENS_PER_S"


@dataclass(frozen=True)
class LayoutInfo:
    model: str
    dtype: str
    layout: str  # canonical JSON of the layout fields
    block_tokens: int  # tokens per chunk (reported in the daemon's KV events)


def layout_info(
    offloading_spec: Any,
    chunk_format: str,
    parallel_agnostic: bool,
    include_rank: bool = True,
    extra: dict[str, Any] | None = None,
) -> LayoutInfo:
    """Derive the layout from an OffloadingSpec through vLLM's own FileMapper fields.

    include_rank: the rank is part of the layout (the fs tier puts it in its path); the direct
    spec leaves it out and puts each rank's part under its own key instead."""
    from vllm.v1.kv_offload.file_mapper import FileMapper

    mapper = FileMapper.from_offloading_spec(
        root_dir="",
        offloading_spec=offloading_spec,
        blocks_per_file=offloading_spec.blocks_per_chunk,
        parallel_agnostic=parallel_agnostic,
    )
    config = offloading_spec.config
    fields = dict(mapper.get_run_config())
    if include_rank:
        fields["rank"] = mapper.rank
    fields["chunk_format"] = chunk_format
    # The page layout (e.g. HND vs NHD pages) changes the bytes; FileMapper only includes it for
    # canonical layouts, so two engines with different attention backends would collide.
    if getattr(config, "kv_cache_layout", None):
        fields["kv_cache_layout"] = config.kv_cache_layout
    fields.update(extra or {})
    groups = config.groups
    block_tokens = groups[0].tokens_per_block * offloading_spec.blocks_per_chunk if groups else 0
    return LayoutInfo(
        model=config.model.name,
        dtype=str(config.model.dtype),
        layout=json.dumps(fields, sort_keys=True, separators=(",", ":")),
        block_tokens=block_tokens,
    )


def prefill_rate(option: Any = None) -> float:
    """The engine's prefill tokens per second: `option` (the integration's config value), else
    $KVSTORED_PREFILL_TOKENS_PER_S, else 0 (unknown). ValueError naming it for a bad value."""
    raw = option if option not in (None, "") else os.environ.get(PREFILL_ENV, "")
    if raw in (None, ""):
        return 0.0
    try:
        rate = float(raw)
    except (TypeError, ValueError):
        rate = math.nan
    if not math.isfinite(rate) or rate < 0:
        raise ValueError(f"{PREFILL_OPTION} (or ${PREFILL_ENV}) must be a number >= 0, got {raw!r}")
    return rate


def namespace_spec(
    info: LayoutInfo,
    chunk_bytes: int,
    key_bytes: int,
    cache_salt: bytes = b"",
    prefill_tokens_per_s: float = 0.0,
    node_bytes_per_chunk: int = 0,
) -> NamespaceSpec:
    """The spec of one of the integration's namespaces. With a prefill rate, the KV bytes per
    token follow from the layout: the bytes the node loads per chunk (`node_bytes_per_chunk`, by
    default `chunk_bytes`; the direct spec's parts of all ranks) over its tokens."""
    per_token = 0
    if prefill_tokens_per_s and info.block_tokens:
        per_token = min(chunk_bytes, max(1, (node_bytes_per_chunk or chunk_bytes) // info.block_tokens))
    return NamespaceSpec(
        model=info.model,
        dtype=info.dtype,
        chunk_bytes=chunk_bytes,
        layout=info.layout,
        tenant_salt=cache_salt,
        key_bytes=key_bytes,
        block_tokens=info.block_tokens,
        prefill_tokens_per_s=prefill_tokens_per_s if per_token else 0.0,
        kv_bytes_per_token=per_token,
    )


def request_cache_salt(kv_transfer_params: dict[str, Any] | None) -> bytes:
    """The cache salt a request carries in kv_transfer_params, as bytes (b"" when none)."""
    if not kv_transfer_params:
        return b""
    salt = kv_transfer_params.get(CACHE_SALT_PARAM)
    if salt is None or salt == "":
        return b""
    return salt.encode() if isinstance(salt, str) else bytes(salt)


@dataclass(frozen=True, slots=True)
class CacheSaltScope:
    """A request's cache salt, kept as its ReqContext state."""

    cache_salt: bytes


class RequestNamespaces:
    """The namespace ids one manager uses, per (key length, cache salt), registered with the
    daemon through `register` on first use (both the tier and the direct spec)."""

    def __init__(self, make_spec: Callable[[int, bytes], NamespaceSpec], register: Callable[[NamespaceSpec], str]):
        self._make_spec = make_spec
        self._register = register
        self._ids: dict[tuple[int, bytes], str] = {}

    @staticmethod
    def on_new_request(req_context: Any) -> None:
        salt = request_cache_salt(req_context.kv_transfer_params)
        if salt:
            req_context.set_state(CacheSaltScope(salt))

    @staticmethod
    def salt_of(req_context: Any) -> bytes:
        scope = req_context.get_state(CacheSaltScope)
        return scope.cache_salt if scope else b""

    def id_for(self, key_bytes: int, salt: bytes = b"") -> str:
        namespace_id = self._ids.get((key_bytes, salt))
        if namespace_id is None:
            namespace_id = self._ids[(key_bytes, salt)] = self._register(self._make_spec(key_bytes, salt))
        return namespace_id

    def id_of(self, key: bytes, req_context: Any) -> str:
        return self.id_for(len(key), self.salt_of(req_context))
