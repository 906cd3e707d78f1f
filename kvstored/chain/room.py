# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Room in RAM for a namespace's new chunks: within its quotas (its tenant's, its own) and in the
tier, made by writing dirty chunks down first (write-back) so reservations evict clean ones."""

from __future__ import annotations

from kvstored.chain.writeback import WriteBack
from kvstored.namespaces import Namespace
from kvstored.tiers.ram import QuotaScope, RamTier


class RamRoom:
    def __init__(self, ram: RamTier, writeback: WriteBack) -> None:
        self._ram = ram
        self._writeback = writeback

    async def make(self, ns: Namespace, chunks: int, deadline: float | None = None) -> bool:
        """Write down what a reservation would evict: within the namespace's quotas first, then
        in the tier; the waits end at `deadline` (by default the write-back wait from when it
        starts). Returns whether the room is there now (no await follows the check); False once
        it gives up, and the reservation evicts what it must."""
        nbytes = chunks * self.slot_bytes(ns)
        deadline = self._writeback.deadline() if deadline is None else deadline
        while True:
            # Each wait may let others take the room an earlier one made: check them all again.
            for scope in self.scopes(ns):
                if not await self._writeback.make_room(nbytes, ns.chunk_bytes, deadline, scope):
                    return False
            if not await self._writeback.make_room(nbytes, ns.chunk_bytes, deadline):
                return False
            if self.has(ns, chunks):
                return True

    def has(self, ns: Namespace, chunks: int) -> bool:
        """Room for `chunks` chunks of `ns` in the tier and in each of its quotas, evicting nothing."""
        nbytes = chunks * self.slot_bytes(ns)
        return all(self._ram.room_bytes(scope) >= nbytes for scope in (None, *self.scopes(ns)))

    def start(self, ns: Namespace, nbytes: int) -> None:
        """Start the write-downs make() would wait for (quotas first), without waiting."""
        for scope in self.scopes(ns):
            self._writeback.start_room(nbytes, ns.chunk_bytes, scope)
        self._writeback.start_room(nbytes, ns.chunk_bytes)

    def deadline(self, start_by: float | None = None) -> float:
        """When a wait for room that starts now gives up: the write-back wait, or `start_by`."""
        deadline = self._writeback.deadline()
        return deadline if start_by is None else min(deadline, start_by)

    def scopes(self, ns: Namespace) -> tuple[QuotaScope, ...]:
        placement = self._ram.placement_of(ns.namespace_id)
        return placement.scopes if placement is not None else ()

    def slot_bytes(self, ns: Namespace) -> int:
        """RAM one chunk of `ns` takes (whole pages)."""
        return self._ram.pages_for(ns.chunk_bytes) * self._ram.page_bytes
