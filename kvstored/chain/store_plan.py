# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Where a store's chunks go. A chunk RAM holds, or that a tier below holds by its own index (fs,
s3: no I/O asked), is already present: it is not copied into RAM (only a load brings it up), and
the reply says which tier has it. The others get RAM reservations; those refused say why.
Bookkeeping only, no awaits: what place() sees is what the store does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstored.chain.lower import LowerTier
from kvstored.chain.promotion import DeletionGuard
from kvstored.chunks.ids import ChunkId, TierKind
from kvstored.namespaces import Namespace
from kvstored.tiers.ram import RamEntry, RamTier, ReserveOutcome
from kvstored_client.kinds import DropReason


@dataclass(frozen=True, slots=True)
class KeyPlan:
    """What a store does with one key: RESERVED ones carry the entry to fill and commit."""

    outcome: ReserveOutcome
    entry: RamEntry | None = None
    present_in: TierKind = TierKind.NONE  # ALREADY_PRESENT: where
    drop: DropReason = DropReason.NONE  # IN_PROGRESS, NO_SPACE: why


@dataclass(frozen=True, slots=True)
class StorePlan:
    per_key: list[KeyPlan]
    evicted: list[ChunkId]  # chunks RAM evicted to make room for the reservations

    @property
    def reserved(self) -> list[RamEntry]:
        return [p.entry for p in self.per_key if p.entry is not None]


class StorePlanner:
    def __init__(self, ram: RamTier, lower: Sequence[LowerTier], deleting: DeletionGuard) -> None:
        self._ram = ram
        self._lower = list(lower)
        self._deleting = deleting

    def held(self, chunks: Sequence[ChunkId]) -> list[TierKind]:
        """The tier already holding each chunk: RAM (READY), else the first tier below whose own
        index has it; NONE for the rest. A chunk being deleted is nowhere (the delete removes
        every copy below)."""
        where = [TierKind.RAM if self._ram.is_ready(c) else TierKind.NONE for c in chunks]
        todo = [i for i, t in enumerate(where) if t is TierKind.NONE and not self._deleting.blocks(chunks[i])]
        for lower in self._lower:
            if not todo:
                break
            for i, hit in zip(list(todo), lower.tier.holds([chunks[i] for i in todo])):
                if hit:
                    where[i] = lower.tier.kind
            todo = [i for i in todo if where[i] is TierKind.NONE]
        return where

    def to_store(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """How many of the keys a store would need RAM for (to size the room it makes first)."""
        return sum(t is TierKind.NONE for t in self.held([(ns.namespace_id, k) for k in keys]))

    def place(self, ns: Namespace, keys: Sequence[bytes]) -> StorePlan:
        """Reserve RAM for the keys held nowhere; the caller fills and commits (or aborts) them."""
        chunks = [(ns.namespace_id, k) for k in keys]
        per_key, evicted = [], []
        for chunk, where in zip(chunks, self.held(chunks)):
            if where is not TierKind.NONE:
                per_key.append(KeyPlan(ReserveOutcome.ALREADY_PRESENT, present_in=where))
                continue
            result = self._ram.reserve(chunk, ns.chunk_bytes)
            evicted += result.evicted
            if result.outcome is ReserveOutcome.RESERVED:
                per_key.append(KeyPlan(result.outcome, result.entry))
            elif result.outcome is ReserveOutcome.IN_PROGRESS:
                per_key.append(KeyPlan(result.outcome, drop=DropReason.IN_PROGRESS))
            elif result.outcome is ReserveOutcome.NO_SPACE:
                drop = DropReason.QUOTA_FULL if result.over_quota else DropReason.RAM_FULL
                per_key.append(KeyPlan(result.outcome, drop=drop))
            else:  # (READY in RAM was answered above)
                per_key.append(KeyPlan(result.outcome, present_in=TierKind.RAM))
        return StorePlan(per_key, evicted)
