# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""KV-aware routing for `--nodes N --route kv`: each turn goes to the node that Dynamo 1.6.1's standalone
indexer (tests/vllm/install_dynamo.sh), fed by the daemons' ZMQ events, says holds the longest prefix of
the conversation; ties, and a prompt no node holds, fall back to round robin. Every stored chunk carries
vLLM's block identity (kvstored_client.blocks), so that the daemons publish what a router indexes."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.support.dynamo import DynamoIndexer, DynamoMissing

BLOCK_SIZE = 16  # the modelled engine's tokens per block (vLLM's default)
ROUTING = "KV-aware: each turn on the node whose chunks Dynamo's indexer matches longest (ties: round robin)"


def token_ids(conv: int, start: int, count: int) -> list[int]:
    """The conversation's tokens at positions [start, start + count): unique to the conversation."""
    return [conv * (1 << 20) + p for p in range(start, start + count)]


def block_id(seed: int, conv: int, block: int) -> int:
    """The engine's id for one block (vLLM's hash, as an int): what parents and removals name."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{conv}:{block}".encode(), digest_size=8).digest(), "big")


def identity_for(chunk_tokens: int, seed: int) -> Callable[[int, int], object]:
    """(conversation, chunk index) -> the chunk's BlockIdentity."""
    from kvstored_client.blocks import BlockIdentity

    per_chunk = chunk_tokens // BLOCK_SIZE

    def identity(conv: int, index: int) -> BlockIdentity:
        first = index * per_chunk
        return BlockIdentity(
            tuple(block_id(seed, conv, b) for b in range(first, first + per_chunk)),
            block_id(seed, conv, first - 1) if first else None,
            tuple(token_ids(conv, first * BLOCK_SIZE, chunk_tokens)),
            BLOCK_SIZE,
        )

    return identity


class KvIndex:
    """Dynamo's standalone indexer subscribed to every node's stream (worker id = node index)."""

    def __init__(self, endpoints: Sequence[str], log: Path) -> None:
        try:
            self._indexer = DynamoIndexer(dict(enumerate(endpoints)), BLOCK_SIZE, log)
        except DynamoMissing as exc:
            raise RuntimeError(f"--route kv needs {exc}") from None
        self.queries = 0

    def matched(self, tokens: list[int]) -> dict[int, int]:
        """Node -> the tokens of `tokens`' prefix its daemon holds (any tier), per the index."""
        self.queries += 1
        return {node: int(row.get("longest_matched", 0)) for node, row in self._indexer.scores(tokens).items()}

    def close(self) -> None:
        self._indexer.stop()


def choose(matched: dict[int, int], fallback: int) -> int:
    """The node with the longest match; the round-robin node on a tie with it or when none holds any."""
    best = max(matched.values(), default=0)
    return (
        fallback if best == 0 or matched.get(fallback, 0) == best else min(i for i, v in matched.items() if v == best)
    )
