# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""eager_task: a coroutine that does not wait is run to its end at once, with no task; one that
waits is carried on by a task that waits, resumes, fails and is cancelled as create_task's would."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from kvstored.server.eager import eager_task


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request):
    return asyncio.run if request.param == "asyncio" else uvloop.run


def test_a_coroutine_that_never_waits_gets_no_task(run):
    done: list[str] = []

    async def quick() -> None:
        done.append("quick")

    async def main() -> None:
        assert eager_task(quick(), "quick") is None
        assert done == ["quick"]  # before anything else ran

    run(main())


def test_a_coroutine_that_waits_is_carried_on_by_a_task(run):
    seen: list[object] = []

    async def waits(future: asyncio.Future[int]) -> None:
        seen.append("first step")
        await asyncio.sleep(0)  # a bare yield
        seen.append(await future)  # a future's result

    async def main() -> None:
        future = asyncio.get_running_loop().create_future()
        task = eager_task(waits(future), "waits")
        assert task is not None and task.get_name() == "waits" and seen == ["first step"]
        asyncio.get_running_loop().call_later(0.01, future.set_result, 7)
        await task
        assert seen == ["first step", 7]

    run(main())


def test_its_task_waits_fails_and_is_cancelled_like_any(run):
    events: list[str] = []

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("late")

    async def hangs() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    async def main() -> None:
        failing = eager_task(fails(), "fails")
        assert failing is not None
        with pytest.raises(ValueError, match="late"):
            await failing
        hanging = eager_task(hangs(), "hangs")
        assert hanging is not None
        await asyncio.sleep(0)
        hanging.cancel()
        with pytest.raises(asyncio.CancelledError):
            await hanging
        assert events == ["cancelled"] and hanging.cancelled()

    run(main())
