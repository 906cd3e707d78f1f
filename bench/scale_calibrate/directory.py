# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fleet directory's costs per operation against a real Redis Cluster (tests/support/redis_cluster.py):
daemon D has a peer tier with `directory =` it, daemon P none; D - P is what the directory costs (its
heartbeat, writes and lookups; medians: docs/scale-out.md, "Its costs per operation")."""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import numpy as np

from bench.lib.daemons import process_cpu_seconds, rss_anon
from bench.scale_calibrate.common import SMALL, WAIT_S, batches, new_keys, ns_fields, timed
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from tests.support.cluster import PeerDaemon
from tests.support.daemon import short_tmpdir, stop_all
from tests.support.ports import free_port
from tests.support.redis_cluster import RedisCluster
from tests.support.wait import wait_for

INTERVAL_S = 0.5  # the daemon's default directory_interval_s
WINDOWS = 5  # idle windows of WINDOW_S each
WINDOW_S = 4.0
WRITE_REPS = 3
WRITE_KEYS = 10_000
WRITE_BATCH = 500
CLIENT_KEYS = 10_000
LOOKUP_KEYS = 16  # (the directory's buckets: one lookup's keys span at most that many slots)
LOOKUP_REPS = 2_000


class Rig:
    def __init__(self, rc: RedisCluster) -> None:
        self.rc = rc
        self.workdir = short_tmpdir("kvcald")
        ram = f"{(WRITE_REPS * WRITE_KEYS * SMALL * 3 // 2) >> 20}MiB"
        address = f"127.0.0.1:{free_port()}"
        spec = f"kind=peer,transport=tcp,tcp_port=0,ucx_port=0,directory={rc.url},directory_interval_s={INTERVAL_S}"
        self.d = PeerDaemon(0, address, None, cpu_bytes=ram, workdir=self.workdir / "d")
        self.p = PeerDaemon(1, "", None, cpu_bytes=ram, workdir=self.workdir / "p")
        for x in (self.d, self.p):
            x.workdir.mkdir()
        self.p.args = ["--page-bytes", "4096"]
        self.d.args = ["--tcp-listen", address, "--tiers", spec + ",directory_timeout_s=0.5", *self.p.args]

    def start(self) -> None:
        self.d.start(self.d.args)
        self.p.start(self.p.args)
        if not wait_for(lambda: self.status().breaker == pb.BREAKER_STATE_CLOSED and self.status().shards, WAIT_S, 0.1):
            raise TimeoutError("D never connected to the directory:\n" + self.d.log[-3000:])

    def close(self) -> None:
        stop_all([self.d, self.p])

    def status(self) -> pb.DirectoryStatus:
        return self.d.status().directory

    def cpu(self) -> tuple[float, float, float, float]:
        redis = sum(process_cpu_seconds(n.proc.pid) for n in self.rc.nodes if n.proc is not None)
        return time.monotonic(), process_cpu_seconds(self.d.pid), process_cpu_seconds(self.p.pid), redis

    def used_memory(self) -> int:
        total = 0
        for port in self.rc.master_ports():
            info = dict(line.partition(":")[::2] for line in self.rc.cli(port, "info", "memory").split())
            total += int(info.get("used_memory", 0))
        return total


def rates(before: tuple[float, ...], after: tuple[float, ...]) -> tuple[float, float, float]:
    dt = after[0] - before[0]
    return tuple((after[i] - before[i]) / dt for i in (1, 2, 3))  # type: ignore[return-value]


def measure_directory(reps: int) -> dict[str, Any]:
    print("the fleet directory (a Redis Cluster on loopback)", flush=True)
    with RedisCluster() as rc:
        rig = Rig(rc)
        try:
            rig.start()
            out = _measure(rig, reps)
        finally:
            rig.close()
        out["clients"] = measure_clients(rc)
        print(f"  clients: {out['clients']}", flush=True)
        return out


def _measure(rig: Rig, reps: int) -> dict[str, Any]:
    d, p = rig.d, rig.p
    time.sleep(2 * INTERVAL_S)  # (the first, urgent refresh pass is done)
    idle = []
    for _ in range(WINDOWS):
        a = rig.cpu()
        time.sleep(WINDOW_S)
        idle.append(rates(a, rig.cpu()))
    d_idle, p_idle, redis_idle = (statistics.median(x[i] for x in idle) for i in range(3))
    out: dict[str, Any] = {"interval_s": INTERVAL_S}
    out["idle"] = {
        "basis": f"CPU rates of D, P and the 6 Redis processes, {WINDOWS} windows of {WINDOW_S:g} s, medians",
        "d_cpu_s_per_s": d_idle,
        "p_cpu_s_per_s": p_idle,
        "redis_cpu_s_per_s": redis_idle,
        "samples_d_minus_p": [x[0] - x[1] for x in idle],
        "heartbeat_cpu_s_per_interval": max(0.0, d_idle - p_idle) * INTERVAL_S,
        "client_rss_bytes": rss_anon(d.pid) - rss_anon(p.pid),
    }
    print(f"  idle: D {d_idle * 1e3:.2f}, P {p_idle * 1e3:.2f}, Redis {redis_idle * 1e3:.2f} ms/s", flush=True)

    zeros = np.zeros((WRITE_BATCH, SMALL), np.uint8)
    writes = []
    with d.client() as kv_d, p.client() as kv_p:
        small = ns_fields("directory", SMALL)
        ns_d, ns_p = kv_d.register_namespace(**small), kv_p.register_namespace(**small)
        for rep in range(WRITE_REPS):
            keys = new_keys(WRITE_KEYS, f"w{rep}")
            s0, (t0, d0, _, r0) = rig.status(), rig.cpu()
            for part in batches(keys, WRITE_BATCH):
                kv_d.store(ns_d, part, zeros[: len(part)])
            if not wait_for(lambda: rig.status().pending_changes == 0 and rig.status().lag_s == 0.0, WAIT_S, 0.05):
                raise TimeoutError("the directory never caught up with D's changes")
            time.sleep(INTERVAL_S)  # (the batch in flight when pending reached 0)
            t1, d1, _, r1 = rig.cpu()
            s1, m1 = rig.status(), rig.used_memory()
            p0, tp0 = process_cpu_seconds(p.pid), time.monotonic()
            for part in batches(keys, WRITE_BATCH):
                kv_p.store(ns_p, part, zeros[: len(part)])
            p_work = process_cpu_seconds(p.pid) - p0 - p_idle * (time.monotonic() - tp0)
            commands = s1.write_commands - s0.write_commands
            writes.append(
                {
                    "daemon_cpu_s_per_key": max(0.0, d1 - d0 - d_idle * (t1 - t0) - p_work) / WRITE_KEYS,
                    "redis_cpu_s_per_command": max(0.0, r1 - r0 - redis_idle * (t1 - t0)) / commands,
                    "commands_per_key": commands / WRITE_KEYS,
                    "used_memory_after": m1,
                }
            )
            print(f"  writes {rep + 1}: {writes[-1]}", flush=True)
        out["writes"] = {
            "basis": f"{WRITE_KEYS:,} chunks of 4 KiB stored on D in batches of {WRITE_BATCH} until written, minus "
            f"on P; Redis: CPU per command, masters' used_memory growth per entry; medians of {WRITE_REPS}",
            **{k: statistics.median(w[k] for w in writes) for k in writes[0] if k != "used_memory_after"},
            # the slope after the first pass (which also allocates the replication backlog and such)
            "redis_bytes_per_entry": (writes[-1]["used_memory_after"] - writes[0]["used_memory_after"])
            / ((WRITE_REPS - 1) * WRITE_KEYS),
            "samples": writes,
        }

        misses = new_keys(64, "")
        lookups: dict[str, Any] = {}
        for label, keys in (("one_key", misses[:1]), ("keys_64", misses)):
            s0, (t0, d0, p0, r0) = rig.status(), rig.cpu()
            on_d = timed(functools.partial(kv_d.lookup, ns_d, keys), reps)
            t1, d1, p1, r1 = rig.cpu()
            on_p = timed(functools.partial(kv_p.lookup, ns_p, keys), reps)
            t2, _, p2, _ = rig.cpu()
            asked = rig.status().lookup_chunks - s0.lookup_chunks
            d_work, p_work = d1 - d0 - d_idle * (t1 - t0), p2 - p1 - p_idle * (t2 - t1)
            lookups[label] = {
                "d_ms": on_d * 1e3,
                "p_ms": on_p * 1e3,
                "added_ms": (on_d - on_p) * 1e3,
                "daemon_cpu_s_per_call": max(0.0, d_work - p_work) / reps,
                "redis_cpu_s_per_key": max(0.0, r1 - r0 - redis_idle * (t1 - t0)) / max(1, asked),
            }
        one, many = lookups["one_key"], lookups["keys_64"]
        out["lookups"] = {
            "basis": f"Lookups of keys nobody holds, D minus P (latency medians of {reps}; CPU per call, idle "
            "subtracted); Redis CPU per key asked",
            **lookups,
            "daemon_cpu_s_per_lookup": one["daemon_cpu_s_per_call"],
            "daemon_cpu_s_per_key": max(0.0, many["daemon_cpu_s_per_call"] - one["daemon_cpu_s_per_call"]) / 63,
            "added_ms_per_lookup": one["added_ms"],
            "added_ms_per_key": max(0.0, many["added_ms"] - one["added_ms"]) / 63,
            "redis_cpu_s_per_key": many["redis_cpu_s_per_key"],
        }
        print(f"  lookups: {lookups}", flush=True)
    return out


def measure_clients(rc: RedisCluster) -> dict[str, Any]:
    """This process's CPU per chunk's HSET + PEXPIRE through the daemon's client, redis-py's asyncio
    cluster pipeline (the baseline) and raw RESP packed by hiredis, one blocking socket per master (the floor)."""
    import asyncio
    import socket

    import hiredis
    import uvloop
    from redis.asyncio.cluster import ClusterNode
    from redis.asyncio.cluster import RedisCluster as Client

    from kvstored.chunks.ids import TierKind
    from kvstored.directory.cluster import ClusterClient
    from kvstored.directory.commands import Commands
    from kvstored.directory.config import parse_url
    from kvstored.directory.keys import KeyLayout, field
    from kvstored.directory.resp import Batch
    from kvstored.directory.slots import key_slot

    layout = KeyLayout()
    chunks = [("ns", k) for k in new_keys(CLIENT_KEYS, "")]
    keys = [layout.chunk_key(c) for c in chunks]
    holder = field("10.0.0.1:7070", 0x1F, TierKind.RAM)
    url = parse_url(rc.url)

    async def through_the_daemons_client() -> tuple[float, float, dict[int, tuple[str, int]]]:
        commands = Commands(layout, "10.0.0.1:7070", 0x1F, entry_ttl_s=600, heartbeat_ttl_s=3)
        client = ClusterClient(url.nodes, url.username, url.password)
        await client.refresh()
        try:
            c0 = time.process_time()
            batch = Batch()
            for chunk in chunks:
                commands.gained(batch, TierKind.RAM, chunk)
            await client.execute(batch)
            per_key = (time.process_time() - c0) / CLIENT_KEYS
            assert client.map is not None
            owner = {slot: a for slot in range(16384) if (a := client.map.owner(slot)) is not None}
            # a lookup's cost per master it asks: LOOKUP_KEYS keys in one bucket (one slot: one
            # master) against as many keys spread over every bucket (every master)
            one = [c for c in chunks if layout.bucket(c[1]) == 0][:LOOKUP_KEYS]
            spread = [next(c for c in chunks if layout.bucket(c[1]) == b) for b in range(layout.buckets)]
            masters = len({owner[commands.chunk_key(c)[1]] for c in spread})
            cost = {}
            for label, asked in (("one", one), ("spread", spread[:LOOKUP_KEYS])):
                _, lookup = commands.holders(asked)
                c0 = time.process_time()
                for _ in range(LOOKUP_REPS):
                    await client.execute(lookup)
                cost[label] = (time.process_time() - c0) / LOOKUP_REPS
            return per_key, max(0.0, cost["spread"] - cost["one"]) / max(1, masters - 1), owner
        finally:
            client.close()

    async def through_redis_py() -> float:
        client = Client(startup_nodes=[ClusterNode(*url.nodes[0])])
        await client.initialize()
        try:
            c0 = time.process_time()
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.hset(key, holder, b"1")
                pipe.pexpire(key, 600_000)
            await pipe.execute(raise_on_error=True)
            return (time.process_time() - c0) / CLIENT_KEYS
        finally:
            await client.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # (the daemon's loop)
        per_key_lean, per_master, owner = runner.run(through_the_daemons_client())
        per_key_redis_py = runner.run(through_redis_py())
    c0 = time.process_time()
    out: dict[tuple[str, int], list[bytes]] = {}
    for key in keys:
        buf = out.setdefault(owner[key_slot(key)], [])
        buf.append(hiredis.pack_command(("HSET", key, holder, b"1")))  # type: ignore[arg-type]
        buf.append(hiredis.pack_command(("PEXPIRE", key, 600_000)))  # type: ignore[arg-type]
    for address, packed in out.items():
        with socket.create_connection(address) as sock:
            sock.sendall(b"".join(packed))
            reader, got = hiredis.Reader(), 0
            while got < len(packed):
                reader.feed(sock.recv(1 << 16))
                while reader.gets() is not False:
                    got += 1
    per_key_raw = (time.process_time() - c0) / CLIENT_KEYS
    return {
        "basis": f"{CLIENT_KEYS:,} chunks' HSET + PEXPIRE from this process, its CPU per chunk, on uvloop: the "
        "daemon's client, redis-py's asyncio cluster pipeline (the baseline), raw RESP by hiredis (the floor)",
        "client_cpu_s_per_key": per_key_lean,
        "redis_py_cpu_s_per_key": per_key_redis_py,
        "raw_resp_cpu_s_per_key": per_key_raw,
        "redis_py_over_client": per_key_redis_py / per_key_lean if per_key_lean else None,
        "lookup_cpu_s_per_master": per_master,
        "lookup_basis": f"the daemon's client: {LOOKUP_KEYS} HGETALLs in one slot against {LOOKUP_KEYS} in as many "
        f"buckets (every master), {LOOKUP_REPS} each; the difference per further master",
    }
