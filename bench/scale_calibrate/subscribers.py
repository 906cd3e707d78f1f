# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Streams in child processes: the subscribers' (extra WatchEvents streams on A), and gRPC's own floor
for a coalesced follower (one grpc.aio server stream, no daemon: what a message costs whatever it holds)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from bench.lib.daemons import REPO, process_cpu_seconds, rss_anon
from bench.scale_calibrate.common import WAIT_S
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from tests.support.wait import wait_for


async def serve_subscribers(address: str, streams: int, coalesce: bool = False) -> None:
    """(The child process.) `streams` WatchEvents streams on `address`, a gRPC channel each; prints its
    RSS, "ready" once every stream has had an event, then the events received every 0.1 s, until killed."""
    from kvstored.peer.control import ControlChannel
    from kvstored.peer.membership import parse_address

    print(f"rss {rss_anon(os.getpid())}", flush=True)
    channels = [ControlChannel(parse_address(address), None, 0.5) for _ in range(streams)]
    counts = [0] * streams

    async def follow(i: int) -> None:
        async for _ in channels[i].watch(0, 0, coalesce):  # (incarnation 0: any run)
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
        if t.done():
            t.result()  # (raises what ended it)


class Subscribers:
    """The child process of serve_subscribers, and what it reports."""

    def __init__(self, address: str, streams: int, coalesce: bool = False) -> None:
        self.streams = streams
        self.proc = spawn("serve", address, str(streams), str(int(coalesce)), stdout=subprocess.PIPE, text=True)
        self.rss_before = self.rss_ready = self.received = 0
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
        wait_for(lambda: self.received >= total, WAIT_S, 0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)
        self._thread.join(5)


def spawn(*args: str, **popen: Any) -> subprocess.Popen:
    """This module's `__main__` in a child process: `serve ADDRESS STREAMS COALESCE` or `floor PORT`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "client"), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-m", __name__, *args], env=env, cwd=REPO, **popen)


# -- gRPC's floor ---------------------------------------------------------------------------------


def interval_payload(keys: int) -> bytes:
    """A coalesced message of `keys` 32-byte keys in four changes (stored and removed, two tiers)."""
    per = max(1, keys // 4)
    changes = [
        pb.KvEvent(type=t, tier=tier, namespace_id="0" * 32, keys=[os.urandom(32) for _ in range(per)])
        for t in (pb.EVENT_TYPE_STORED, pb.EVENT_TYPE_REMOVED)
        for tier in ("ram", "fs")
    ]
    return pb.KvEvent(seq=1, changes=changes).SerializeToString()


async def _measure_floor(messages: int, interval_s: float, keys: int) -> dict[str, Any]:
    payload = interval_payload(keys)
    tick, opened = asyncio.Event(), asyncio.Event()

    async def watch(request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext):
        opened.set()
        while True:
            await tick.wait()
            tick.clear()
            yield payload

    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(
        watch, request_deserializer=pb.WatchEventsRequest.FromString, response_serializer=bytes
    )
    service = grpc.method_handlers_generic_handler("kvstored.v1.KVStore", {"WatchEvents": handler})
    server.add_generic_rpc_handlers((service,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    child = spawn("floor", str(port))

    def cpu() -> tuple[float, float, float]:  # this process's, the child's, when
        return process_cpu_seconds(os.getpid()), process_cpu_seconds(child.pid), time.monotonic()

    try:
        await asyncio.wait_for(opened.wait(), 30)
        await asyncio.sleep(0.5)
        s0, c0, t0 = cpu()
        await asyncio.sleep(1.0)
        s1, c1, t1 = cpu()
        idle_s, idle_c = (s1 - s0) / (t1 - t0), (c1 - c0) / (t1 - t0)
        for _ in range(messages):
            tick.set()
            await asyncio.sleep(interval_s)
        s2, c2, t2 = cpu()
        dt = t2 - t1
    finally:
        child.kill()
        child.wait()
        await server.stop(0)
    return {
        "basis": f"{messages} messages of {len(payload):,} B ({keys} keys), one every {interval_s:g} s, one "
        "grpc.aio server stream over loopback TCP to a child process (uvloop both ends), idle subtracted",
        "payload_bytes": len(payload),
        "receiver_s_per_message": max(0.0, c2 - c1 - idle_c * dt) / messages,
        "sender_s_per_message": max(0.0, s2 - s1 - idle_s * dt) / messages,
    }


def measure_grpc_floor(messages: int = 60, interval_s: float = 0.1, keys: int = 200) -> dict[str, Any]:
    import uvloop

    return uvloop.run(_measure_floor(messages, interval_s, keys))


async def floor_client(port: int) -> None:
    """(The child process.) Read the stream until killed."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        async for _ in pb_grpc.KVStoreStub(channel).WatchEvents(pb.WatchEventsRequest(coalesce=True)):
            pass


if __name__ == "__main__":
    if sys.argv[1] == "floor":
        import uvloop

        uvloop.run(floor_client(int(sys.argv[2])))
    else:
        asyncio.run(serve_subscribers(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"))
