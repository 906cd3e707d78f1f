# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Namespaces that outlive the daemon: each lower tier keeps a record of every namespace it holds
chunks of, written when the tier stores its first chunk of that namespace (a KV event) and removed
when the namespace is cleared; at start the records are read back into the registry.

So after a restart `kvstoredctl lookup`, `evict`, `clear` and `namespaces` work on what the tiers
hold before any client registers it again. A tenant namespace's record keeps it private: it is
recovered as a tenant namespace, visible only to sessions that register it (with its salt) again.

Record writes run one after another in one task (a save and a removal of the same record must
land in the order they were asked for); a failure is logged and retried at the next chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvstored.errors import KvstoredError
from kvstored.events.bus import EventType, KvEvent
from kvstored.namespaces import Namespace, NamespaceRegistry, decode_record, encode_record
from kvstored.tiers.base import SecondaryTier

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0  # on stop, how long record writes still queued may take


@dataclass(frozen=True, slots=True)
class _Save:
    tier: SecondaryTier
    ns: Namespace


@dataclass(frozen=True, slots=True)
class _Remove:
    tier: SecondaryTier
    namespace_id: str


class NamespaceRecords:
    def __init__(self, tiers: Sequence[SecondaryTier], registry: NamespaceRegistry) -> None:
        self._tiers = {t.name: t for t in tiers}
        self._registry = registry
        self._recorded: dict[tuple[str, str], Namespace] = {}  # (tier, namespace id) -> what its record says
        self._queue: asyncio.Queue[_Save | _Remove | None] = asyncio.Queue()
        self._worker: asyncio.Task | None = None

    async def recover(self) -> int:
        """Read every tier's records into the registry; returns how many namespaces are known
        from them. A tier whose records cannot be read is logged and skipped (its chunks are
        still served to clients that register their namespace)."""
        for tier in self._tiers.values():
            try:
                records = await tier.namespace_records()
            except Exception as exc:  # noqa: BLE001 - any tier's failure: log it, start anyway
                log.warning(
                    "tier %s: namespace records not read (%s); its namespaces are known again once "
                    "clients register them",
                    tier.name,
                    exc,
                )
                continue
            recovered = tenants = 0
            for namespace_id, raw in records.items():
                try:
                    ns = decode_record(namespace_id, raw)
                    self._registry.recover(ns, tier.name)
                except (ValueError, KvstoredError) as exc:
                    log.warning("tier %s: namespace record %s skipped: %s", tier.name, namespace_id, exc)
                    continue
                self._recorded[(tier.name, namespace_id)] = ns
                recovered += 1
                tenants += ns.private
            if recovered:
                log.info(
                    "tier %s: %d namespace(s) recovered from its records (%d tenant, kept private)",
                    tier.name,
                    recovered,
                    tenants,
                )
        return sum(1 for ns in self._registry.all() if self._registry.recovered_from(ns.namespace_id))

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._run(), name="kvstored-namespace-records")

    def on_event(self, event: KvEvent) -> None:
        """EventBus listener (on the loop, must not block): a tier's chunk of a namespace it has no
        record of (or an outdated one) queues a record; a cleared namespace queues its removal."""
        tier = self._tiers.get(event.tier)
        if tier is None:  # RAM, or a tier that keeps no records
            return
        key = (event.tier, event.namespace_id)
        if event.type is EventType.STORED:
            ns = self._registry.find(event.namespace_id)
            if ns is not None and self._recorded.get(key) != ns:
                self._recorded[key] = ns
                self._queue.put_nowait(_Save(tier, ns))
        elif event.type is EventType.CLEARED:
            self._recorded.pop(key, None)
            self._queue.put_nowait(_Remove(tier, event.namespace_id))

    async def close(self) -> None:
        """Let queued record writes finish (within CLOSE_TIMEOUT_S), then stop."""
        if self._worker is None:
            return
        self._queue.put_nowait(None)
        worker, self._worker = self._worker, None
        done, _ = await asyncio.wait((worker,), timeout=CLOSE_TIMEOUT_S)
        if not done:
            log.warning(
                "namespace records: %d write(s) still queued after %.0f s; abandoned",
                self._queue.qsize(),
                CLOSE_TIMEOUT_S,
            )
            worker.cancel()
            await asyncio.wait((worker,))
        elif worker.exception() is not None:
            log.error("namespace records: the writer failed", exc_info=worker.exception())

    async def _run(self) -> None:
        while (op := await self._queue.get()) is not None:
            try:
                if isinstance(op, _Save):
                    await op.tier.save_namespace_record(op.ns.namespace_id, encode_record(op.ns))
                else:
                    await op.tier.remove_namespace_record(op.namespace_id)
            except Exception as exc:  # noqa: BLE001 - a tier's failure: log it, keep recording
                name = op.ns.namespace_id if isinstance(op, _Save) else op.namespace_id
                log.warning(
                    "tier %s: namespace record of %s not %s: %s",
                    op.tier.name,
                    name,
                    "written" if isinstance(op, _Save) else "removed",
                    exc,
                )
                if isinstance(op, _Save) and self._recorded.get((op.tier.name, name)) == op.ns:
                    del self._recorded[(op.tier.name, name)]  # the next chunk stored tries again
