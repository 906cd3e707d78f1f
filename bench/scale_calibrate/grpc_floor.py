# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""gRPC's own floor for a coalesced follower: one server stream over loopback TCP, no daemon, one
message of a coalesced interval's size every interval, each after the stream went quiet. What a
message costs the receiving process (and the sender) there is what following a peer coalesced
cannot go below with grpc.aio: the wake-ups of gRPC's I/O threads, its poller and the event
loop, per message, whatever the message holds."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import grpc

from bench.lib.daemons import REPO, process_cpu_seconds
from bench.scale_calibrate.subscribers import child_env
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

SERVICE = "kvstored.v1.KVStore"


def interval_payload(keys: int) -> bytes:
    """A coalesced message of `keys` 32-byte keys in four changes (stored and removed, two tiers)."""
    per = max(1, keys // 4)
    changes = [
        pb.KvEvent(type=t, tier=tier, namespace_id="0" * 32, keys=[os.urandom(32) for _ in range(per)])
        for t in (pb.EVENT_TYPE_STORED, pb.EVENT_TYPE_REMOVED)
        for tier in ("ram", "fs")
    ]
    return pb.KvEvent(seq=1, changes=changes).SerializeToString()


async def _measure(messages: int, interval_s: float, keys: int) -> dict[str, Any]:
    payload = interval_payload(keys)
    tick = asyncio.Event()
    opened = asyncio.Event()

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
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"WatchEvents": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.scale_calibrate", "--floor-client", str(port)], env=child_env(), cwd=REPO
    )
    try:
        await asyncio.wait_for(opened.wait(), 30)
        await asyncio.sleep(0.5)
        me, them = os.getpid(), child.pid
        s0, c0, t0 = process_cpu_seconds(me), process_cpu_seconds(them), time.monotonic()
        await asyncio.sleep(1.0)
        s1, c1, t1 = process_cpu_seconds(me), process_cpu_seconds(them), time.monotonic()
        idle_s, idle_c = (s1 - s0) / (t1 - t0), (c1 - c0) / (t1 - t0)
        for _ in range(messages):
            tick.set()
            await asyncio.sleep(interval_s)
        s2, c2, t2 = process_cpu_seconds(me), process_cpu_seconds(them), time.monotonic()
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

    return uvloop.run(_measure(messages, interval_s, keys))


async def floor_client(port: int) -> None:
    """(The child process.) Read the stream until killed."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        async for _ in pb_grpc.KVStoreStub(channel).WatchEvents(pb.WatchEventsRequest(coalesce=True)):
            pass
