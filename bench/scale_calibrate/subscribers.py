# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The subscribers' child process: extra WatchEvents streams on A."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from bench.lib.daemons import REPO
from bench.scale_calibrate.common import WAIT_S, rss_anon


async def serve_subscribers(address: str, streams: int, coalesce: bool = False) -> None:
    """(The child process.) `streams` WatchEvents streams on `address`, each on its own gRPC
    channel as a follower opens them; prints its RSS, "ready" once every stream has had an event,
    then the events received, every 0.1 s, until killed."""
    from kvstored.peer.control import ControlChannel
    from kvstored.peer.membership import parse_address

    print(f"rss {rss_anon(os.getpid())}", flush=True)
    channels = [ControlChannel(parse_address(address), None, 0.5) for _ in range(streams)]
    counts = [0] * streams

    async def follow(i: int) -> None:
        async for _ in channels[i].watch(0, coalesce):
            counts[i] += 1

    tasks = [asyncio.create_task(follow(i)) for i in range(streams)]
    ready = False
    while not any(t.done() for t in tasks):
        await asyncio.sleep(0.1)
        if not ready and all(counts):
            ready = True
            print(f"ready {rss_anon(os.getpid())}", flush=True)
        print(f"count {sum(counts)}", flush=True)
    for t in tasks:
        if t.done() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]


class Subscribers:
    """The child process of serve_subscribers, and what it reports."""

    def __init__(self, address: str, streams: int, coalesce: bool = False) -> None:
        self.streams = streams
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.scale_calibrate", "--serve-subscribers", address, str(streams)]
            + (["--serve-coalesced"] if coalesce else []),
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=REPO,
        )
        self.rss_before = self.rss_ready = 0
        self.received = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._read, name="scale-calibrate-subs", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            word, _, value = line.strip().partition(" ")
            if word == "rss":
                self.rss_before = int(value)
            elif word == "ready":
                self.rss_ready = int(value)
                self._ready.set()
            elif word == "count":
                self.received = int(value)

    def wait_ready(self, nudge: Callable[[], object]) -> None:
        """Until every stream has received an event (`nudge` publishes one)."""
        deadline = time.monotonic() + WAIT_S
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the subscribers' process never got its streams going")
            nudge()

    def wait_received(self, total: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.received < total and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)
        self._thread.join(5)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "client"), env.get("PYTHONPATH", "")])
    return env
