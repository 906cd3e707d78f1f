# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Bounded, prioritised I/O queue per secondary tier: loads before write-downs before deletions.

Each tier gets `concurrency` worker tasks draining one priority queue. Write-downs and deletions
have a bounded backlog: past it, `submit` refuses the job (returns None) and counts the drop,
so a tier that falls behind sheds work instead of queueing without bound. Loads are never
refused: a client is waiting on them, and their number is bounded by request batch limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)


class Priority(enum.IntEnum):
    LOAD = 0
    WRITEDOWN = 1
    DELETE = 2


Job = Callable[[], Awaitable[Any]]


class TierQueue:
    def __init__(self, name: str, concurrency: int, max_backlog: int) -> None:
        self.name = name
        self._concurrency = concurrency
        self._max_backlog = max_backlog
        self._queue: asyncio.PriorityQueue = asyncio.PriorityQueue()
        self._seq = itertools.count()
        self._workers: list[asyncio.Task] = []
        self.backlog: Counter[Priority] = Counter()
        self.dropped: Counter[Priority] = Counter()
        self._running: set[asyncio.Future] = set()

    @property
    def concurrency(self) -> int:
        """Jobs run at once (worker tasks)."""
        return self._concurrency

    @property
    def loads_ahead(self) -> int:
        """Jobs a load submitted now would wait for: loads queued, and every job running."""
        return self.backlog[Priority.LOAD] + len(self._running)

    def start(self) -> None:
        self._workers = [
            asyncio.create_task(self._work(), name=f"io-{self.name}-{i}") for i in range(self._concurrency)
        ]

    def has_room(self, priority: Priority) -> bool:
        """Whether submit() would take a job of this priority now."""
        return priority is Priority.LOAD or self.backlog[priority] < self._max_backlog

    def withdraw(self, future: asyncio.Future) -> bool:
        """Cancel a job that has not started (a worker skips it); a running one goes on."""
        if future in self._running or future.done():
            return False
        return future.cancel()

    def submit(self, priority: Priority, job: Job) -> asyncio.Future | None:
        if priority is not Priority.LOAD and self.backlog[priority] >= self._max_backlog:
            self.dropped[priority] += 1
            return None
        future = asyncio.get_running_loop().create_future()
        self.backlog[priority] += 1
        self._queue.put_nowait((priority, next(self._seq), future, job))
        return future

    async def _work(self) -> None:
        while True:
            priority, _, future, job = await self._queue.get()
            self.backlog[priority] -= 1
            if future.cancelled():
                continue
            self._running.add(future)
            try:
                result = await job()
            except asyncio.CancelledError:
                future.cancel()
                raise
            except Exception as exc:  # the submitter decides what a failure means
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(result)
            finally:
                self._running.discard(future)

    async def close(self) -> None:
        """Cancel the workers and every job still queued."""
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        while not self._queue.empty():
            _, _, future, _ = self._queue.get_nowait()
            with contextlib.suppress(asyncio.InvalidStateError):
                future.cancel()
