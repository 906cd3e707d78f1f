# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Block identities: what the daemon's KV events tell routers about a chunk.

llm-d and Dynamo index an engine's KV cache by vLLM's prefix-cache block hashes, one per engine
block (block_size tokens), each chained to its parent. A chunk (one key) holds several engine
blocks; to have routers find it, hand its identity with the store:

    identities = chunk_identities(engine_hashes, token_ids, block_size=16, blocks_per_chunk=4)
    kv.store(ns, keys, data, blocks=identities)

The daemon then publishes, per chunk, `BlockStored(block_hashes, parent_block_hash, token_ids,
block_size, group_idx, medium)` exactly as vLLM's engine does for the same blocks (hashes as
64-bit ints: `int.from_bytes(hash, "big") & (2**64 - 1)`), and `BlockRemoved` with the same
hashes when the chunk leaves a medium. A router computes the same hashes from a prompt's token
ids as vLLM does (vllm.v1.core.kv_cache_utils.hash_block_tokens: sha256 of the parent hash, the
block's tokens and its extra keys, chained from NONE_HASH), or, as Dynamo does, keys its own
tree by the token ids the event carries and uses these hashes as the engine's ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

HASH_MASK = (1 << 64) - 1


def event_hash(block_hash: bytes | int) -> int:
    """vLLM's int form of a block hash (maybe_convert_block_hash with int hashes on)."""
    if isinstance(block_hash, int):
        return block_hash & HASH_MASK
    return int.from_bytes(block_hash, "big") & HASH_MASK


@dataclass(frozen=True, slots=True)
class BlockIdentity:
    block_hashes: tuple[int, ...]  # one 64-bit hash per engine block of the chunk, in order
    parent_block_hash: int | None  # the block before the chunk's first; None at a prefix's start
    token_ids: tuple[int, ...]  # block_size tokens per block
    block_size: int  # the engine's tokens per block
    group_idx: int = 0  # vLLM's KV cache group

    def to_pb(self) -> pb.BlockIdentity:
        return pb.BlockIdentity(
            block_hashes=self.block_hashes,
            parent_block_hash=self.parent_block_hash or 0,
            has_parent=self.parent_block_hash is not None,
            token_ids=self.token_ids,
            block_size=self.block_size,
            group_idx=self.group_idx,
        )


def chunk_identities(
    block_hashes: Sequence[bytes | int],
    token_ids: Sequence[int],
    block_size: int,
    blocks_per_chunk: int,
    group_idx: int = 0,
    parent: bytes | int | None = None,
) -> list[BlockIdentity]:
    """One identity per whole chunk of a prefix: `block_hashes` are the engine's hashes of its
    consecutive blocks (the first chunk's parent is `parent`), `token_ids` their tokens."""
    if block_size <= 0 or blocks_per_chunk <= 0:
        raise ValueError("block_size and blocks_per_chunk must be positive")
    if len(token_ids) < len(block_hashes) * block_size:
        raise ValueError(f"{len(block_hashes)} blocks of {block_size} tokens need that many token_ids")
    hashes = [event_hash(h) for h in block_hashes]
    prev = event_hash(parent) if parent is not None else None
    out = []
    for first in range(0, len(hashes) - blocks_per_chunk + 1, blocks_per_chunk):
        chunk = hashes[first : first + blocks_per_chunk]
        tokens = tuple(token_ids[first * block_size : (first + blocks_per_chunk) * block_size])
        out.append(BlockIdentity(tuple(chunk), prev, tokens, block_size, group_idx))
        prev = chunk[-1]
    return out


def to_pb(blocks: Sequence[BlockIdentity | None] | None, keys: int) -> list[pb.BlockIdentity]:
    """The request's identities: none at all, or one per key (None: this key has none)."""
    if not blocks or all(b is None for b in blocks):
        return []
    if len(blocks) != keys:
        raise ValueError(f"blocks must be one per key: {len(blocks)} identities for {keys} keys")
    return [b.to_pb() if b is not None else pb.BlockIdentity() for b in blocks]
