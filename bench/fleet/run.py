# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""One set-up at one N: N daemons in network namespaces (tests/support/netns.py, cluster.py), the same
load on each (Driver; docs/benchmarks.md, "The fleet, measured"), and what each daemon (and Redis) spent
over a measured window."""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.lib.daemons import process_cpu_seconds, rss_anon
from bench.lib.report import MIB
from kvstored_client import LoadInto
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from tests.support.cluster import Cluster, PeerDaemon
from tests.support.netns import IFACE, Node, Topology
from tests.support.redis_cluster import RedisCluster

SETUPS = ("mesh", "directory", "islands")  # islands: no peer tier, the machine's own drift with N
WAIT_S = 120.0  # a bound on every wait for the fleet's state, never a measurement
FILL_BATCH = 64


@dataclass(frozen=True)
class Load:
    turns_per_s: float = 2.0
    chunks: int = 8  # stored per turn
    chunk_bytes: int = 64 << 10
    ram: str = "64MiB"
    fs_bytes: int = 32 << 20
    warm_s: float = 5.0
    window_s: float = 20.0
    directory_interval_s: float = 0.5  # the daemon's default
    directory_timeout_s: float = 0.5  # (the default 0.1 s is tight for 16 daemons on 2 cores)


@dataclass
class NodeFigures:
    cpu_s_per_s: float  # the daemon's CPU per second of wall time (all its threads)
    rss_anon_bytes: int  # its heap (the pool is shared memory, not counted)
    rx_bytes_per_s: float  # into its namespace's eth0 (peers' events and data, Redis's replies)
    upkeep_rx_bytes_per_s: float  # TCP payload received, the peer data plane's left out (lookups ready chunks)
    messages_per_s: float  # mesh: its peers' event messages it applied
    directory_lookups_per_s: float
    directory_commands_per_s: float  # written (heartbeat, HSET/PEXPIRE/HDEL)
    directory_failures: int  # lookups that timed out or failed in the window
    turns: int
    late_turns: int  # started late: the driver did not keep the rate


@dataclass
class RunResult:
    setup: str
    nodes: int
    window_s: float
    per_node: list[NodeFigures]
    redis_cpu_s_per_s: float = 0.0  # every Redis process (masters and replicas)
    redis_rss_bytes: int = 0
    redis_used_memory_bytes: int = 0  # INFO memory of the masters
    redis_keys: int = 0
    load_average: list[float] = field(default_factory=list)

    def mean(self, attr: str) -> float:
        return sum(getattr(n, attr) for n in self.per_node) / len(self.per_node)

    def max(self, attr: str) -> float:
        return max(getattr(n, attr) for n in self.per_node)


def output(*command: str) -> str:
    return subprocess.run(command, capture_output=True, text=True, timeout=10, check=True).stdout


def rx_bytes(node: Node) -> int:
    out = output("ip", "-n", node.ns, "-j", "-s", "link", "show", "dev", IFACE)
    return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def control_rx(node: Node, data_port: int) -> int:
    """Bytes its TCP sockets received (tcp_info, payload only), less those of the peer data plane:
    the control streams (events, Lookups) and Redis's replies."""
    total, data = 0, False
    for line in output("ip", "netns", "exec", node.ns, "ss", "-tinH", "state", "established").splitlines():
        if not line.startswith((" ", "\t")):  # a socket's line: its addresses; tcp_info follows
            ports = {int(a.rpartition(":")[2]) for a in line.split()[2:4] if a.rpartition(":")[2].isdigit()}
            data = data_port in ports
        elif not data and (got := re.search(r"\bbytes_received:(\d+)", line)):
            total += int(got[1])
    return total


class Driver(threading.Thread):
    """One node's client: turns at a fixed rate until told to stop. A turn stores `chunks` new chunks and
    looks up its node's previous turn (local hits), another node's of two turns ago (peer tier hits) and
    `chunks / 2` keys nobody stored (misses everywhere, as a prompt's new tail)."""

    def __init__(self, i: int, fleet: Fleet) -> None:
        super().__init__(name=f"fleet-load-{i}", daemon=True)
        self.i, self.fleet = i, fleet
        self.turns = self.late = 0
        self.recent: deque[list[bytes]] = deque(maxlen=3)  # this node's last turns' keys
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the run, which fails loudly
            self.failure = exc

    def _run(self) -> None:
        f, load = self.fleet, self.fleet.load
        data = np.zeros((load.chunks, load.chunk_bytes), np.uint8)
        period = 1.0 / load.turns_per_s
        with f.cluster[self.i].client() as kv:
            ns = kv.register_namespace(**f.ns_fields)
            next_at = time.monotonic()
            while not f.stop.is_set():
                keys = f.keys(self.i, self.turns, load.chunks)
                kv.store(ns, keys, data)
                other = f.drivers[(self.i + 1) % len(f.drivers)].recent
                asked = (self.recent[-1] if self.recent else []) + (other[0] if len(other) == 3 else [])
                kv.lookup(ns, asked + [secrets.token_bytes(32) for _ in range(load.chunks // 2)], LoadInto.REGION)
                self.recent.append(keys)
                self.turns += 1
                next_at += period
                delay = next_at - time.monotonic()
                if delay < 0:
                    self.late += 1
                    next_at = time.monotonic()
                f.stop.wait(max(0.0, delay))


class Fleet:
    """N daemons of one set-up on a topology, Redis on the topology's last node (directory)."""

    def __init__(self, setup: str, n: int, net: Topology, load: Load) -> None:
        self.setup, self.n, self.net, self.load = setup, n, net, load
        self.salt = secrets.token_bytes(8)
        self.ns_fields = {"model": f"bench-fleet/{setup}/{n}", "dtype": "u8", "chunk_bytes": load.chunk_bytes}
        self.redis: RedisCluster | None = None
        self.stop = threading.Event()
        self.drivers: list[Driver] = []
        options = {"breaker_reset_s": "1"}
        if setup == "directory":
            self.redis = RedisCluster(host=net.nodes[-1].ip, wrap=net.nodes[-1].exec)
            options |= {"directory_interval_s": str(load.directory_interval_s)}
            options |= {"directory_timeout_s": str(load.directory_timeout_s)}
        directory, fs = self.redis.url if self.redis is not None else "", f"{load.fs_bytes >> 20}MiB"
        self.cluster = Cluster(
            n, "tcp", net=net, peer_options=options, cpu_bytes=load.ram, fs_bytes=fs, directory=directory
        )
        if setup == "islands":
            for d in self.cluster:
                at = next(i for i, a in enumerate(d.args) if a.startswith("kind=peer"))
                del d.args[at - 1 : at + 1]  # (its --tiers and the peer tier's spec)

    def keys(self, i: int, turn: int, count: int, prefix: bytes = b"") -> list[bytes]:
        """Node i's keys of a turn (`prefix` b"fill": of its fill, `turn` the first's number)."""
        head = prefix + i.to_bytes(4, "big")
        if prefix:
            return [head + (turn + c).to_bytes(8, "big") + self.salt * 2 for c in range(count)]
        return [head + turn.to_bytes(8, "big") + c.to_bytes(4, "big") + self.salt * 2 for c in range(count)]

    def __enter__(self) -> Fleet:
        try:
            if self.redis is not None:
                self.redis.start()
            self.cluster.start()
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.stop.set()
        for d in self.drivers:
            d.join(30)
        try:
            self.cluster.close()
        finally:
            if self.redis is not None:
                self.redis.close()

    def _wait_ready(self) -> None:
        if self.setup == "islands":
            return
        if self.setup == "mesh":
            for i in range(self.n):
                self.cluster.wait_up(i)
            return

        def connected(d: PeerDaemon) -> bool:
            s = d.status().directory
            return s.breaker == pb.BREAKER_STATE_CLOSED and len(s.shards) == self.redis.masters  # type: ignore[union-attr]

        for d in self.cluster:
            self.cluster.wait_for(f"node {d.index} writes the directory", functools.partial(connected, d), WAIT_S)

    def fill(self) -> None:
        """Every node's RAM and fs full (in batches), so that every turn's stores write down and evict."""
        load = self.load
        ram = int(load.ram.removesuffix("MiB")) << 20
        count = (ram + load.fs_bytes) // load.chunk_bytes * 11 // 10
        data = np.zeros((FILL_BATCH, load.chunk_bytes), np.uint8)
        for d in self.cluster:
            with d.client() as kv:
                ns = kv.register_namespace(**self.ns_fields)
                for start in range(0, count, FILL_BATCH):
                    kv.store(ns, self.keys(d.index, start, FILL_BATCH, b"fill"), data)

    # -- the measurement ----------------------------------------------------------------------

    def measure(self) -> RunResult:
        self.fill()
        self.drivers = [Driver(i, self) for i in range(self.n)]
        for d in self.drivers:
            d.start()
        self.stop.wait(self.load.warm_s)
        before = self._snapshot()
        self.stop.wait(self.load.window_s)
        after = self._snapshot()
        self.stop.set()
        for d in self.drivers:
            d.join(30)
            if d.failure is not None:
                raise RuntimeError(f"node {d.i}'s load failed: {d.failure!r}")
        return self._result(before, after)

    def _snapshot(self) -> dict:
        daemons = list(self.cluster)
        statuses = [d.status() for d in daemons]
        snap = {
            "at": time.monotonic(),
            "cpu": [process_cpu_seconds(d.pid) for d in daemons],
            "rx": [rx_bytes(d.node) for d in daemons],
            "messages": [sum(p.events for p in s.peers) for s in statuses],
            "control": [control_rx(d.node, s.tcp_port) for d, s in zip(daemons, statuses)],
            "lookups": [s.directory.lookups for s in statuses],
            "commands": [s.directory.write_commands for s in statuses],
            "failures": [s.directory.timeouts + s.directory.errors + s.directory.refused for s in statuses],
            "turns": [(dr.turns, dr.late) for dr in self.drivers],
            "redis_cpu": 0.0,
        }
        if self.redis is not None:
            snap["redis_cpu"] = sum(process_cpu_seconds(r.proc.pid) for r in self.redis.nodes if r.proc is not None)
        return snap

    def _result(self, a: dict, b: dict) -> RunResult:
        dt = b["at"] - a["at"]

        def rate(key: str, i: int) -> float:
            return (b[key][i] - a[key][i]) / dt

        per_node = [
            NodeFigures(
                cpu_s_per_s=rate("cpu", i),
                rss_anon_bytes=rss_anon(d.pid),
                rx_bytes_per_s=rate("rx", i),
                upkeep_rx_bytes_per_s=rate("control", i),
                messages_per_s=rate("messages", i),
                directory_lookups_per_s=rate("lookups", i),
                directory_commands_per_s=rate("commands", i),
                directory_failures=b["failures"][i] - a["failures"][i],
                turns=b["turns"][i][0] - a["turns"][i][0],
                late_turns=b["turns"][i][1] - a["turns"][i][1],
            )
            for i, d in enumerate(self.cluster)
        ]
        result = RunResult(self.setup, self.n, dt, per_node, load_average=[round(x, 2) for x in os.getloadavg()])
        if self.redis is not None:
            rc = self.redis
            result.redis_cpu_s_per_s = (b["redis_cpu"] - a["redis_cpu"]) / dt
            result.redis_rss_bytes = sum(rss_anon(r.proc.pid, "VmRSS") for r in rc.nodes if r.proc is not None)
            for port in rc.master_ports():
                info = dict(line.partition(":")[::2] for line in rc.cli(port, "info").split())
                result.redis_used_memory_bytes += int(info.get("used_memory", 0))
                result.redis_keys += int(rc.cli(port, "dbsize").strip() or 0)
        return result


def sweep(setups: Sequence[str], counts: Sequence[int], load: Load, repeats: int = 1) -> list[RunResult]:
    """Every (set-up, N) `repeats` times, interleaved (a loaded machine drifts: each pass sees it alike)."""
    results = []
    with Topology(nodes=max(counts) + 1) as net:  # (the last node: Redis)
        for rep in range(repeats):
            for n in counts:
                for setup in setups:
                    print(f"{setup}, {n} nodes (pass {rep + 1} of {repeats}) ...", flush=True)
                    with Fleet(setup, n, net, load) as fleet:
                        r = fleet.measure()
                    print(
                        f"  CPU {r.mean('cpu_s_per_s'):.4f} s/s per node, "
                        f"heap {r.mean('rss_anon_bytes') / MIB:.1f} MiB, "
                        f"control in {r.mean('upkeep_rx_bytes_per_s') / 1024:.1f} KiB/s "
                        f"(load average {r.load_average[0]})",
                        flush=True,
                    )
                    results.append(r)
    return results
