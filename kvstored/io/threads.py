# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A thread pool that runs the most urgent queued job first (loads before write-downs before
unlinks), for a tier's blocking I/O.

The tier's queue (io/scheduler.py) keeps more operations in flight than the pool has threads, so
a thread that finishes one I/O takes the next one at once instead of idling until the event loop
has handled the completion and submitted another (under CPU contention that hop costs
milliseconds per I/O, and the disk sees fewer I/Os at once than it could). With that surplus
queued here, the order in which the threads take the jobs is what decides priority, so it is a
priority order, FIFO within one priority.

The event loop submits with submit_async: the job's thread hands the outcome to the loop with one
call_soon_threadsafe, with no concurrent.futures.Future and no asyncio.wrap_future in between
(each of those costs the loop and the threads GIL time per I/O, which, on a machine with few
cores, the I/O threads are short of).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class JobFuture(asyncio.Future):
    """The outcome of a job submitted with submit_async. It cannot be cancelled: the job runs on
    regardless (into buffers its caller owns), so a task cancelled while awaiting it goes on
    waiting until the job ends and only then sees the cancellation (asyncio.Task.cancel does
    so when the future it awaits refuses to be cancelled)."""

    def cancel(self, msg: Any | None = None) -> bool:
        return False


def _settle(future: JobFuture, result: Any, error: BaseException | None) -> None:
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class PriorityThreadPool:
    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"a thread pool needs at least one thread, got {threads}")
        self._threads = threads
        self._name = name
        self._heap: list[tuple[int, int, Callable[[], None]]] = []  # (priority, FIFO order, run)
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._workers: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a job
        self._shutdown = False

    def submit(self, priority: int, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue `fn(*args)`; lower `priority` values run first. RuntimeError after shutdown()."""
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args)
            except BaseException as exc:  # delivered to the submitter
                future.set_exception(exc)
            else:
                future.set_result(result)

        self._push(priority, run)
        return future

    def submit_async(
        self, loop: asyncio.AbstractEventLoop, priority: int, fn: Callable[..., Any], *args: Any
    ) -> JobFuture:
        """Queue `fn(*args)` like submit(); its outcome arrives on `loop` (see JobFuture)."""
        future = JobFuture(loop=loop)

        def run() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn(*args)
            except StopIteration as exc:  # (a future refuses it: its awaiter would wait forever)
                error = RuntimeError(f"job raised StopIteration: {exc!r}")
            except BaseException as exc:  # delivered to the submitter
                error = exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        self._push(priority, run)
        return future

    def _push(self, priority: int, run: Callable[[], None]) -> None:
        with self._cond:
            if self._shutdown:
                raise RuntimeError(f"thread pool {self._name} is shut down")
            heapq.heappush(self._heap, (priority, next(self._seq), run))
            if self._idle < len(self._heap) and len(self._workers) < self._threads:  # threads start on demand
                self._start_worker()
            self._cond.notify()

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then end the threads (their jobs hold buffers callers wait on)."""
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()
            workers = list(self._workers)
        if wait:
            for worker in workers:
                worker.join()

    def _start_worker(self) -> None:
        worker = threading.Thread(target=self._work, name=f"{self._name}-{len(self._workers)}", daemon=True)
        self._workers.append(worker)
        worker.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._shutdown:
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                if not self._heap:
                    return  # shut down and drained
                _, _, run = heapq.heappop(self._heap)
            run()
