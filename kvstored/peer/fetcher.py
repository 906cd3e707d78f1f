# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Reads from one peer, coalesced: the reads of one namespace that are waiting when a batch
starts go to the peer together, up to `max_batch` chunks; reads arriving meanwhile start the
next batch (several may be in flight: TCP keeps a pool of connections per peer). A batch goes
as one order (one Fetch call, one data-plane batch), or, when it is bulk (STREAM_BYTES or more
per stream), as up to `streams` orders of consecutive chunks at once, each on a connection of its
own: over TCP each connection's bytes move in a thread of their own on both sides, so one bulk
fetch uses several CPUs. The batch's verdict for the peer's breaker covers all of them.

A read hands over its slot (the RAM pages it will land in) and waits for its chunk's result.
The slot stays the transfer's until the batch has ended, and, if the transport could not stop
its operations in time, until their quarantine settles: `busy(views)` says so, for the chain to
keep that slot reserved (a read whose caller gave up early is still in its batch).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstored.io.breaker import Permit
from kvstored.namespaces import Namespace
from kvstored.peer.quarantine import span_of
from kvstored.peer.transport import (
    PeerLink,
    Receipt,
    ReceiveOutcome,
    ReceiveResult,
    SendOrder,
    Slot,
    failed_all,
)

log = logging.getLogger(__name__)

AskFor = Callable[[Namespace, list[bytes]], Callable[[SendOrder], Awaitable["Sequence[Receipt] | None"]]]
BatchObserver = Callable[[Permit, list[ReceiveResult]], None]  # the verdict, under the gate's permit
Gate = Callable[[], Permit | None]  # may a batch go to the peer now (its breaker)? None: no

# What a read gets when the peer's breaker kept its batch from going out (no network, no verdict).
REFUSED = ReceiveResult(ReceiveOutcome.FAILED, "the peer's breaker is open")
# A stream carries at least this much of a batch: below it, a Fetch call per stream would cost
# more CPU than a second CPU's copies save (2 MiB chunks: a batch of 16 goes as up to 4 streams).
STREAM_BYTES = 8 << 20


@dataclass(eq=False)
class _Want:
    key: bytes
    slot: Slot
    result: asyncio.Future  # ReceiveResult
    released: asyncio.Future  # done once nothing touches the slot any more


@dataclass(eq=False)
class _Pending:
    ns: Namespace
    wants: list[_Want] = field(default_factory=list)


class PeerFetcher:
    def __init__(
        self,
        link: PeerLink,
        ask_for: AskFor,
        max_batch: int,
        streams: int,
        timeout_s: float,
        gate: Gate,
        on_batch: BatchObserver,
        busy: dict[tuple[int, int], asyncio.Future],
    ) -> None:
        self.link = link
        self._ask_for = ask_for
        self._gate = gate
        self._max_batch = max_batch
        self._streams = streams
        self._timeout_s = timeout_s
        self._on_batch = on_batch  # the caller's verdict on the peer (breaker, counters)
        self._busy = busy  # shared by the tier's fetchers: slot span -> released
        self._pending: dict[str, _Pending] = {}
        self._batches: set[asyncio.Task] = set()
        self._closed = False

    @property
    def in_flight(self) -> int:
        return sum(len(p.wants) for p in self._pending.values()) + len(self._batches)

    async def read(self, ns: Namespace, key: bytes, slot: Slot) -> ReceiveResult:
        loop = asyncio.get_running_loop()
        if self._closed:
            return ReceiveResult(ReceiveOutcome.FAILED, "the peer tier is closing")
        want = _Want(key, slot, loop.create_future(), loop.create_future())
        span = span_of(slot.views[0])
        self._busy[span] = want.released
        want.released.add_done_callback(lambda _: self._busy.pop(span, None))
        pending = self._pending.get(ns.namespace_id)
        if pending is None:
            pending = self._pending[ns.namespace_id] = _Pending(ns)
            self._spawn(ns.namespace_id)
        pending.wants.append(want)
        try:
            return await asyncio.shield(want.result)
        except asyncio.CancelledError:
            if want in pending.wants:  # its batch has not started: take it out
                pending.wants.remove(want)
                _finish(want.released, None)
            raise

    def _spawn(self, namespace_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._batch(namespace_id))
        self._batches.add(task)
        task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task) -> None:
        self._batches.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a batch of peer reads from %s failed: %r", self.link.address, task.exception())

    async def _batch(self, namespace_id: str) -> None:
        """Runs one loop turn after the first read: takes what is waiting by then."""
        await asyncio.sleep(0)
        pending = self._pending.pop(namespace_id, None)
        if pending is None or not pending.wants:
            return
        wants, rest = pending.wants[: self._max_batch], pending.wants[self._max_batch :]
        if rest:  # the next batch starts at once
            self._pending[namespace_id] = _Pending(pending.ns, rest)
            self._spawn(namespace_id)
        permit = self._gate()
        if permit is None:
            self._settle(wants, [REFUSED] * len(wants))
            return
        try:
            results = await self._receive(pending.ns, wants)
        except asyncio.CancelledError:  # (the loop is going away) the slots go once the link lets go
            self._on_batch(permit, [])  # no verdict: a probe's turn goes back
            self._settle(wants, failed_all(wants, ReceiveOutcome.FAILED, "cancelled"))
            raise
        except Exception as exc:  # the contract says it returns results: a failure is a miss anyway
            log.error("peer read from %s raised: %r", self.link.address, exc)
            results = failed_all(wants, ReceiveOutcome.FAILED, f"receive raised {exc!r}")
        self._on_batch(permit, results)
        self._settle(wants, results)

    async def _receive(self, ns: Namespace, wants: list[_Want]) -> list[ReceiveResult]:
        """The batch's results, in order: one order, or one per stream, all at once (a stream that
        fails fails its chunks only; the others' stay received)."""
        groups = split(wants, self._streams, sum(w.slot.size for w in wants))
        if len(groups) == 1:
            return await self.link.receive_batch(
                [w.slot for w in wants], self._ask_for(ns, [w.key for w in wants]), self._timeout_s
            )
        async with asyncio.TaskGroup() as tg:  # (a cancellation stops every stream's transfer)
            parts = [
                tg.create_task(
                    self.link.receive_batch(
                        [w.slot for w in group], self._ask_for(ns, [w.key for w in group]), self._timeout_s
                    )
                )
                for group in groups
            ]
        return [result for part in parts for result in part.result()]

    def _settle(self, wants: list[_Want], results: list[ReceiveResult]) -> None:
        for want, result in zip(wants, results):
            _finish(want.result, result)
            quarantine = result.quarantine or self.link.quarantines.covers(want.slot.views)
            if quarantine is None:
                _finish(want.released, None)
            else:
                quarantine.settled.add_done_callback(functools.partial(_released, want))

    async def close(self) -> None:
        """Fail what has not started; wait for batches in flight (bounded by their timeouts)."""
        self._closed = True
        for pending in self._pending.values():
            for want in pending.wants:
                _finish(want.result, ReceiveResult(ReceiveOutcome.FAILED, "the peer tier is closing"))
                _finish(want.released, None)
        self._pending.clear()
        if self._batches:
            await asyncio.wait(list(self._batches))


def split(items: list, streams: int, nbytes: int) -> list[list]:
    """`items` in consecutive groups of near-equal length: as many as `streams` allows with at
    least STREAM_BYTES of `nbytes` each (one group for a small batch)."""
    count = max(1, min(streams, len(items), nbytes // STREAM_BYTES))
    size, extra = divmod(len(items), count)
    groups, start = [], 0
    for g in range(count):
        end = start + size + (g < extra)
        groups.append(items[start:end])
        start = end
    return groups


def _released(want: Any, _settled: asyncio.Future) -> None:
    _finish(want.released, None)


def _finish(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)
