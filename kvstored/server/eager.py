# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Run a coroutine's first step at once, and give it a task only if it has to wait.

Most fast-path calls never wait (the keys are in RAM, there is room): a task each would cost a
task object and one more event-loop iteration per call, on the fast path's clock. This is
Python 3.12's asyncio.eager_task_factory for one call site (the daemon runs on 3.11).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any


def eager_task(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None] | None:
    """Step `coro` now; None when it finished in that step, else the task that carries it on
    (the caller keeps a reference and awaits or cancels it, as with create_task)."""
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_carry_on(coro, waiting), name=name)


async def _carry_on(coro: Coroutine[Any, Any, None], waiting: Any) -> None:
    await _Resumed(coro, waiting)


class _Resumed:
    """Awaitable: `coro`, which suspended on `waiting` (a future, or None for a bare yield),
    driven on by the awaiting task: the task waits on what coro waits on, and what the task is
    sent or thrown (a result, a cancellation) goes into coro."""

    def __init__(self, coro: Coroutine[Any, Any, None], waiting: Any) -> None:
        self._coro = coro
        self._waiting = waiting

    def __await__(self) -> Generator[Any, Any, None]:
        coro, waiting = self._coro, self._waiting
        while True:
            try:
                try:
                    sent = yield waiting
                except BaseException as exc:  # the task's cancellation (or close): coro's to handle
                    waiting = coro.throw(exc)
                else:
                    waiting = coro.send(sent)
            except StopIteration:
                return
