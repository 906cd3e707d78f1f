# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Driving one transfer's concurrent parts (the transport's operations and the caller's `ask`)
to a verdict within a deadline, and stopping them afterwards without leaving any behind."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class Stop(enum.Enum):
    OPS_DONE = "ops_done"  # every transport operation finished without error
    OP_FAILED = "op_failed"
    ASK_FAILED = "ask_failed"  # the control plane could not deliver the order
    TIMED_OUT = "timed_out"


@dataclass(frozen=True, slots=True)
class Verdict:
    stop: Stop
    error: BaseException | None = None

    def describe(self) -> str:
        if self.error is None:
            return self.stop.value
        text = str(self.error)
        return f"{type(self.error).__name__}: {text}" if text else type(self.error).__name__


async def wait_transfer(ops: Sequence[asyncio.Future], asking: asyncio.Future | None, deadline: float) -> Verdict:
    """Until every op is done, or an op or `asking` fails, or the deadline (loop time) passes.
    `asking` finishing without error is no verdict: the bytes decide."""
    loop = asyncio.get_running_loop()
    pending = set(ops)
    watch = set(pending)
    if asking is not None:
        watch.add(asking)
    while pending:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return Verdict(Stop.TIMED_OUT)
        done, _ = await asyncio.wait(watch, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        for fut in done:
            watch.discard(fut)
            pending.discard(fut)
            if fut.cancelled():
                stop = Stop.ASK_FAILED if fut is asking else Stop.OP_FAILED
                return Verdict(stop, asyncio.CancelledError("cancelled"))
            exc = fut.exception()
            if exc is not None:
                return Verdict(Stop.ASK_FAILED if fut is asking else Stop.OP_FAILED, exc)
    return Verdict(Stop.OPS_DONE)


async def wait_quietly(futures: Sequence[asyncio.Future], timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `futures`, even if this task is cancelled meanwhile (the
    cancellation is raised afterwards): a transfer's parts must stop before its views are handed
    back. Their exceptions are retrieved (they were reported through the verdict). True if all
    are done."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    cancelled = False
    while True:
        pending = [f for f in futures if not f.done()]
        remaining = end - loop.time()
        if not pending or remaining <= 0:
            break
        try:
            await asyncio.wait(pending, timeout=remaining)
        except asyncio.CancelledError:
            cancelled = True
    for fut in futures:
        if fut.done() and not fut.cancelled():
            fut.exception()
    if cancelled:
        raise asyncio.CancelledError
    return not pending


async def finish_ask(asking: asyncio.Future, deadline: float, grace_s: float) -> None:
    """Let the control call finish until the deadline (it answers after the server acted), then
    cancel it; its outcome no longer matters (the bytes were judged already)."""
    loop = asyncio.get_running_loop()
    if not asking.done():
        remaining = deadline - loop.time()
        if remaining > 0:
            await asyncio.wait([asking], timeout=remaining)
    if not asking.done():
        asking.cancel()
    await wait_quietly([asking], grace_s)


async def call(fn: Callable[..., Awaitable[T]], *args) -> T:
    """Run `fn(*args)` as a coroutine (for create_task on callables returning any awaitable)."""
    return await fn(*args)
