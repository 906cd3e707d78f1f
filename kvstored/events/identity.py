# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What a router indexes a chunk by: the engine's blocks it holds, as the engine names them.

A chunk's key is opaque to kvstored and to routers. A client that wants routers to find its
chunks hands, with each store, the identity vLLM's engine would publish for the same blocks
(`BlockIdentity`): one 64-bit hash per engine block, the hash of the block before the chunk,
the chunk's token ids and the engine's block size. The daemon never derives one: a chunk stored
without it is not published to routers.

The book keeps an identity while the node holds its chunk (the publisher forgets it, at the end
of each interval, for every chunk touched in it that has left every tier: a key stored again
later may name other blocks), and a bounded number of offered identities whose store has not
landed yet (a store that is dropped leaves one behind until newer offers push it out).

An identity also travels as a record (`encode_record` / `decode_record`): the fs tier keeps it
in its chunk file's header, so a restarted daemon publishes its disk again, and a peer's fetch
reply carries it (kvstored/peer/messages.py). A record is versioned and fully checked: a
record that is truncated, of another version or inconsistent raises ValueError, and the chunk
is then simply not published.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

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
T = TypeVar("T")

# version, flags, block_size, group_idx, blocks, tokens, parent hash; then the hashes ('Q') and
# the tokens ('I' or 'Q', by the flag), little-endian
RECORD_VERSION = 1
_RECORD = struct.Struct("<BBIIIIQ")
_HAS_PARENT, _WIDE_TOKENS = 1, 2


def encode_record(identity: BlockIdentity) -> bytes:
    wide = identity.token_ids.typecode == "Q"
    flags = (_HAS_PARENT if identity.parent_block_hash is not None else 0) | (_WIDE_TOKENS if wide else 0)
    hashes, tokens = array("Q", identity.block_hashes), array(identity.token_ids.typecode, identity.token_ids)
    if sys.byteorder != "little":
        hashes.byteswap()
        tokens.byteswap()
    head = _RECORD.pack(
        RECORD_VERSION,
        flags,
        identity.block_size,
        identity.group_idx,
        len(hashes),
        len(tokens),
        identity.parent_block_hash or 0,
    )
    return head + hashes.tobytes() + tokens.tobytes()


def decode_record(raw: bytes | memoryview) -> BlockIdentity:
    """The identity a record holds; ValueError, naming the problem, for anything but a whole,
    consistent record of this version."""
    if len(raw) < _RECORD.size:
        raise ValueError(f"identity record truncated: {len(raw)} bytes, less than its {_RECORD.size}-byte head")
    version, flags, block_size, group_idx, blocks, tokens, parent = _RECORD.unpack_from(raw)
    if version != RECORD_VERSION:
        raise ValueError(f"identity record of version {version}; this daemon reads version {RECORD_VERSION}")
    if flags & ~(_HAS_PARENT | _WIDE_TOKENS):
        raise ValueError(f"identity record with unknown flags {flags:#x}")
    if parent and not flags & _HAS_PARENT:
        raise ValueError("identity record with a parent hash but no parent flag")
    width = 8 if flags & _WIDE_TOKENS else 4
    want = _RECORD.size + 8 * blocks + width * tokens
    if len(raw) != want:
        raise ValueError(f"identity record of {len(raw)} bytes; its head says {want}")
    hashes = array("Q")
    hashes.frombytes(bytes(raw[_RECORD.size : _RECORD.size + 8 * blocks]))
    token_ids = array("Q" if width == 8 else "I")
    token_ids.frombytes(bytes(raw[_RECORD.size + 8 * blocks :]))
    if sys.byteorder != "little":
        hashes.byteswap()
        token_ids.byteswap()
    return BlockIdentity.of(
        list(hashes), parent if flags & _HAS_PARENT else None, list(token_ids), block_size, group_idx
    )


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

    def hold(self, namespace_id: str, key: bytes, identity: BlockIdentity) -> None:
        """The node holds the chunk already (found on a tier after a restart): known at once."""
        ref = (namespace_id, key)
        self._pending.pop(ref, None)
        self._held.setdefault(ref, identity)

    def holds(self, namespace_id: str, key: bytes) -> bool:
        return (namespace_id, key) in self._held

    def record_of(self, chunk: ChunkRef) -> bytes | None:
        """The chunk's identity as a record (encode_record), if the book knows one."""
        identity = self.get(*chunk)
        return encode_record(identity) if identity is not None else None

    def get(self, namespace_id: str, key: bytes) -> BlockIdentity | None:
        ref = (namespace_id, key)
        return self._held.get(ref) or self._pending.get(ref)

    def forget(self, namespace_id: str, key: bytes) -> None:
        self._held.pop((namespace_id, key), None)

    def __len__(self) -> int:
        return len(self._held)


class ParentsFirst(Generic[T]):
    """Items, each with a block identity, in an order a router can apply: an item whose parent
    block is another item's last block comes after that item (Dynamo's indexer drops a stored
    block whose parent it does not know; a parent evicted and stored again is otherwise met
    after its child); else in the order added. Items may be added a slice at a time and are
    ordered lazily, so that a node's whole snapshot never holds the event loop for long; the
    bookkeeping is flat lists and an int dict, nothing the garbage collector has to walk (a
    snapshot's worth of new containers set off full collections of a large node's heap)."""

    def __init__(self) -> None:
        self._items: list[T] = []
        self._identities: list[BlockIdentity] = []
        self._last: dict[int, int] = {}  # a last block hash -> the latest item added ending with it
        self._same: list[int] = []  # per item: the one added before it with its last block (-1: none)

    def add(self, item: T, identity: BlockIdentity) -> None:
        last = identity.block_hashes[-1]
        self._same.append(self._last.get(last, -1))
        self._last[last] = len(self._items)
        self._items.append(item)
        self._identities.append(identity)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[tuple[T, BlockIdentity]]:
        state = bytearray(len(self._items))  # 0: not reached, 1: waiting for its parents, 2: out
        for i in range(len(self._items)):
            if state[i]:
                continue
            state[i] = 1
            stack = [i]
            while stack:
                j = stack[-1]
                # A parent already waiting is an ancestor of its own (a client's cycle): not waited for.
                parents = [k for k in self._ending_with(self._identities[j].parent_block_hash) if not state[k]]
                if parents:
                    for k in parents:
                        state[k] = 1
                    stack.extend(parents)  # (latest added first: the first added comes out first)
                else:
                    stack.pop()
                    state[j] = 2
                    yield self._items[j], self._identities[j]

    def _ending_with(self, block_hash: int | None) -> Iterator[int]:
        """The items whose last block is `block_hash`, the latest added first."""
        k = self._last.get(block_hash, -1) if block_hash is not None else -1
        while k >= 0:
            yield k
            k = self._same[k]
