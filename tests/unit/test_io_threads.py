# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The tiers' priority thread pool: most urgent queued job first, FIFO within a priority; nothing
queued is lost at shutdown; errors reach the submitter; a job submitted from the event loop
outlives its caller's cancellation."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvstored.io.scheduler import Priority
from kvstored.io.threads import PriorityThreadPool


def test_queued_jobs_run_most_urgent_first_and_fifo_within_a_priority():
    pool = PriorityThreadPool(1, "test")
    gate, busy = threading.Event(), threading.Event()
    ran: list[str] = []

    def hold() -> None:
        busy.set()
        gate.wait()

    first = pool.submit(Priority.DELETE, hold)
    assert busy.wait(10)  # the only thread is taken: what follows queues
    queued = [
        (Priority.DELETE, "delete"),
        (Priority.WRITEDOWN, "write-1"),
        (Priority.LOAD, "load-1"),
        (Priority.WRITEDOWN, "write-2"),
        (Priority.LOAD, "load-2"),
    ]
    futures = [pool.submit(priority, ran.append, name) for priority, name in queued]
    gate.set()
    for future in [first, *futures]:
        future.result(10)
    assert ran == ["load-1", "load-2", "write-1", "write-2", "delete"]
    pool.shutdown()


def test_threads_run_jobs_at_once_up_to_the_bound():
    pool = PriorityThreadPool(3, "test")
    arrived = threading.Barrier(3, timeout=10)  # fails unless three jobs run at the same time
    futures = [pool.submit(Priority.LOAD, arrived.wait) for _ in range(3)]
    assert sorted(f.result(10) for f in futures) == [0, 1, 2]
    pool.shutdown()


def test_shutdown_runs_what_is_queued_then_refuses_more():
    pool = PriorityThreadPool(1, "test")
    gate = threading.Event()
    done: list[int] = []
    pool.submit(Priority.LOAD, gate.wait)
    futures = [pool.submit(Priority.WRITEDOWN, done.append, i) for i in range(5)]
    stopper = threading.Thread(target=pool.shutdown)
    stopper.start()
    gate.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert done == [0, 1, 2, 3, 4] and all(f.done() for f in futures)
    with pytest.raises(RuntimeError):
        pool.submit(Priority.LOAD, done.append, 5)


def test_an_exception_reaches_the_submitter_and_the_thread_goes_on():
    pool = PriorityThreadPool(1, "test")

    def fail() -> None:
        raise OSError(5, "boom")

    with pytest.raises(OSError, match="boom"):
        pool.submit(Priority.LOAD, fail).result(10)
    assert pool.submit(Priority.LOAD, lambda: 42).result(10) == 42
    pool.shutdown()


def test_a_cancelled_queued_job_never_runs():
    pool = PriorityThreadPool(1, "test")
    gate = threading.Event()
    ran: list[str] = []
    pool.submit(Priority.LOAD, gate.wait)
    doomed = pool.submit(Priority.LOAD, ran.append, "doomed")
    assert doomed.cancel()
    kept = pool.submit(Priority.LOAD, ran.append, "kept")
    gate.set()
    kept.result(10)
    pool.shutdown()
    assert ran == ["kept"]


async def test_submit_async_delivers_results_and_errors_on_the_loop():
    pool = PriorityThreadPool(2, "test")
    loop = asyncio.get_running_loop()

    def fail() -> None:
        raise OSError(5, "boom")

    assert await pool.submit_async(loop, Priority.LOAD, lambda x: x * 2, 21) == 42
    with pytest.raises(OSError, match="boom"):
        await pool.submit_async(loop, Priority.LOAD, fail)
    # A future refuses StopIteration; the caller must still get an outcome, not wait forever.
    with pytest.raises(RuntimeError, match="StopIteration"):
        await asyncio.wait_for(pool.submit_async(loop, Priority.LOAD, next, iter(())), 30)
    pool.shutdown()


async def test_a_cancelled_caller_sees_the_cancellation_only_once_its_job_has_ended():
    pool = PriorityThreadPool(1, "test")
    loop = asyncio.get_running_loop()
    started, gate = threading.Event(), threading.Event()
    ended: list[str] = []

    def job() -> str:
        started.set()
        gate.wait(10)
        ended.append("job")
        return "done"

    future = pool.submit_async(loop, Priority.LOAD, job)

    async def caller() -> None:
        try:
            await future
        finally:
            ended.append(f"caller, job ended: {future.done()}")

    task = asyncio.create_task(caller())
    assert await asyncio.to_thread(started.wait, 10)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done() and not future.cancel()  # still waiting for the job, which runs on
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended == ["job", "caller, job ended: True"] and future.result() == "done"
    pool.shutdown()
