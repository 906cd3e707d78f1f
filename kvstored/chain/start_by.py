# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A transfer's start deadline (`start_by`, loop time): waits that end there with TransferNotStarted."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from kvstored.errors import TransferNotStarted

log = logging.getLogger(__name__)
T = TypeVar("T")


def not_started() -> TransferNotStarted:
    return TransferNotStarted(
        "the transfer could not start within start_within_ms (lower tiers were too slow "
        "to deliver its chunks); nothing was copied"
    )


def check_started(start_by: float | None) -> None:
    """Raise TransferNotStarted if the start deadline `start_by` (loop time) has passed."""
    if start_by is not None and asyncio.get_running_loop().time() >= start_by:
        raise not_started()


class StartWaits:
    """Waits bounded by a start deadline, and the work they gave up on (it ends in the background;
    close() cancels what is left once the tiers' queues are closed)."""

    def __init__(self) -> None:
        self._outwaited: set[asyncio.Future] = set()

    async def until(self, start_by: float | None, work: Awaitable[T]) -> T:
        """Await `work`, or raise TransferNotStarted once `start_by` (loop time) has passed. The
        work itself is not cancelled: lookups and promotions serve other callers too (and a
        lookup's verdict teaches the tier's circuit breaker); it ends in the background."""
        if start_by is None:
            return await work
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait((task,), timeout=max(0.0, start_by - asyncio.get_running_loop().time()))
        except BaseException:  # our caller is cancelled: as if it had awaited `work` itself
            task.cancel()
            raise
        if task.done():
            return task.result()
        self._outwaited.add(task)
        task.add_done_callback(self._outwaited_done)
        raise not_started()

    def _outwaited_done(self, task: asyncio.Future) -> None:
        self._outwaited.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a wait given up by a transfer failed later: %s", task.exception())

    async def close(self) -> None:
        """Cancel the work given up on (what it waited for will not come) and let it end."""
        for waited in list(self._outwaited):
            waited.cancel()
        if self._outwaited:
            await asyncio.wait(self._outwaited)
