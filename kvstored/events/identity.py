# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What a router indexes a chunk by: the engine's blocks it holds, as the engine names them.

A chunk's key is opaque to kvstored and to routers. A client that wants routers to find its
chunks hands, with each store, the identity vLLM's engine would publish for the same blocks
(`BlockIdentity`): one 64-bit hash per engine block, the hash of the block before the chunk,
the chunk's token ids and the engine's block size. The daemon never derives one: a chunk stored
without it is not published to routers.

The book keeps an identity while the node holds its chunk (the publisher forgets it when the
chunk has left every tier), and a bounded number of offered identities whose store has not
landed yet (a store that is dropped leaves one behind until newer offers push it out).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

# Offered identities waiting for their chunk's STORED event. More than a few engine steps of
# stores in flight at once (each RPC at most max_batch_keys) is not expected.
PENDING_IDENTITIES = 65_536


@dataclass(frozen=True, slots=True, eq=False)
class BlockIdentity:
    # Compact arrays: a node may hold millions of chunks (64 tokens: ~0.3 KB each).
    block_hashes: array  # 'Q': one unsigned 64-bit hash per engine block, in order
    parent_block_hash: int | None  # the block before the chunk's first; None at a prefix's start
    token_ids: array  # 'I' or 'Q': block_size tokens per block
    block_size: int
    group_idx: int

    @classmethod
    def of(
        cls,
        block_hashes: list[int],
        parent_block_hash: int | None,
        token_ids: list[int],
        block_size: int,
        group_idx: int = 0,
    ) -> BlockIdentity:
        """Checked: raises ValueError naming what is wrong."""
        if not block_hashes:
            raise ValueError("a block identity needs at least one block hash")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if len(token_ids) != block_size * len(block_hashes):
            raise ValueError(
                f"token_ids must hold block_size x block hashes = {block_size} x {len(block_hashes)} tokens, "
                f"got {len(token_ids)}"
            )
        if group_idx < 0:
            raise ValueError(f"group_idx must not be negative, got {group_idx}")
        tokens = array("I", token_ids) if max(token_ids, default=0) < 1 << 32 else array("Q", token_ids)
        return cls(array("Q", block_hashes), parent_block_hash, tokens, block_size, group_idx)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockIdentity):
            return NotImplemented
        return (
            self.block_hashes == other.block_hashes
            and self.parent_block_hash == other.parent_block_hash
            and list(self.token_ids) == list(other.token_ids)
            and (self.block_size, self.group_idx) == (other.block_size, other.group_idx)
        )

    __hash__ = None  # type: ignore[assignment]


ChunkRef = tuple[str, bytes]  # (namespace id, key)


class IdentityBook:
    def __init__(self, pending_limit: int = PENDING_IDENTITIES) -> None:
        self._held: dict[ChunkRef, BlockIdentity] = {}
        self._pending: OrderedDict[ChunkRef, BlockIdentity] = OrderedDict()
        self._pending_limit = pending_limit

    def offer(self, namespace_id: str, key: bytes, identity: BlockIdentity) -> None:
        """A store is about to land: its identity, until the chunk is held (or pushed out)."""
        ref = (namespace_id, key)
        if ref in self._held:
            return  # the same key names the same blocks: the one routers know stays
        self._pending[ref] = identity
        self._pending.move_to_end(ref)
        while len(self._pending) > self._pending_limit:
            self._pending.popitem(last=False)

    def on_stored(self, namespace_id: str, key: bytes) -> None:
        ref = (namespace_id, key)
        identity = self._pending.pop(ref, None)
        if identity is not None:
            self._held[ref] = identity

    def get(self, namespace_id: str, key: bytes) -> BlockIdentity | None:
        ref = (namespace_id, key)
        return self._held.get(ref) or self._pending.get(ref)

    def forget(self, namespace_id: str, key: bytes) -> None:
        self._held.pop((namespace_id, key), None)

    def __len__(self) -> int:
        return len(self._held)
