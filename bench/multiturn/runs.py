# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""One run: a configuration at a number of conversations, on fresh daemons (one node's or, with --nodes,
every node's: Nodes); its results."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from bench.lib.daemons import Daemon, free_port
from bench.lib.report import GIB
from bench.lib.s3 import S3
from bench.multiturn.model import TIERS, Config, Plan, Sizes
from bench.multiturn.offload import Offload
from bench.multiturn.sim import Simulation

if TYPE_CHECKING:
    from bench.multiturn.nodes import ClusterSim


@dataclass
class TurnsResult:
    """What one run measured and modelled: one node's, or the nodes' summed (NodesRunResult)."""

    config: str
    conversations: int
    turns: int = 0
    prompt_tokens: int = 0
    reusable_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    hit_rate: dict[str, float] = field(default_factory=dict)  # share of reusable tokens, per tier (measured)
    hit_rate_overall: float = 0.0
    throughput_tokens_s: float = 0.0  # modelled: prompt tokens / the makespan
    makespan_s: float = 0.0
    think_floor_s: float = 0.0  # the latest start + think times of a conversation: no makespan is shorter
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    gpu_busy: float = 0.0  # share of the makespan (several nodes: their mean)
    loader_busy: float = 0.0
    loaded_bytes: dict[str, int] = field(default_factory=dict)  # scaled bytes really loaded, per tier
    load_seconds: dict[str, float] = field(default_factory=dict)  # measured, per tier
    load_gib_s: dict[str, float] = field(default_factory=dict)  # measured: bytes / time of the load calls
    marginal_gib_s: dict[str, float] = field(default_factory=dict)  # median per-byte cost, per call floor removed
    lookup_ms_p50: float = 0.0
    lookups: int = 0
    load_calls: int = 0
    load_call_floor_ms: float = 0.0  # fixed cost of one load call, measured at the start of the run
    load_shortfall_chunks: int = 0  # looked up as hits but gone at load time
    store: dict[str, Any] = field(default_factory=dict)
    daemon: dict[str, dict[str, int]] = field(default_factory=dict)  # Stats deltas per tier
    corrupt_chunks: int = 0
    wall_s: float = 0.0
    load_average: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at the run's start and end
    skipped: str = ""

    def progress(self) -> str:
        """The run's line as the sweep goes (here: its wall seconds and the load average at its end)."""
        return f"wall {self.wall_s:.1f} s  load {self.load_average[1]:.1f}"

    def summarize_turns(self, sim: Simulation | ClusterSim, tiers: Sequence[str], chunk_bytes: int | None) -> None:
        """The turns' hit rates, modelled throughput and latency; with chunk_bytes (a run with offload), the
        scaled bytes loaded from each tier below the GPU and their measured rates."""
        w, recs = sim.w, sim.records
        self.turns = len(recs)
        self.prompt_tokens = sum(x.prompt_tokens for x in recs)
        self.reusable_tokens = sum(x.reusable_chunks for x in recs) * w.chunk_tokens
        self.hit_tokens = {t: sum(x.hits.get(t, 0) for x in recs) * w.chunk_tokens for t in tiers}
        self.hit_rate = {t: v / max(self.reusable_tokens, 1) for t, v in self.hit_tokens.items()}  # (hits <= reusable)
        self.hit_rate_overall = sum(self.hit_rate.values())
        self.makespan_s = sim.makespan
        self.think_floor_s = float(np.max(sim.starts + sim.thinks[:, 1:].sum(axis=1)))
        self.throughput_tokens_s = self.prompt_tokens / sim.makespan
        ttft = np.array([x.done - x.arrive for x in recs])
        self.ttft_p50_s, self.ttft_p99_s = float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99))
        if chunk_bytes is None:
            return
        self.loaded_bytes = {t: self.hit_tokens[t] // w.chunk_tokens * chunk_bytes for t in tiers if t != "gpu"}
        self.load_seconds = {t: sum(x.load_seconds.get(t, 0.0) for x in recs) for t in self.loaded_bytes}
        self.load_gib_s = {
            t: b / GIB / self.load_seconds[t] for t, b in self.loaded_bytes.items() if b and self.load_seconds[t] > 0
        }

    def summarize_offloads(
        self, sims: Sequence[Simulation], offloads: Sequence[Offload], before: Sequence[dict], after: Sequence[dict]
    ) -> dict[str, list[float]]:
        """The load calls' rates and counts, the stores and the daemons' Stats deltas (`before`, `after`: each
        daemon's Stats), summed over the nodes; returns the load calls' costs per byte, per tier."""
        costs: dict[str, list[float]] = {}
        for sim in sims:
            for t, c in sim.all_costs.items():
                costs.setdefault(t, []).extend(c)
        self.marginal_gib_s = gib_s_of_costs(costs)
        lookups = [s for sim in sims for s in sim.lookup_s]
        self.lookups = len(lookups)
        self.lookup_ms_p50 = float(np.percentile(lookups, 50) * 1e3) if lookups else 0.0
        self.load_calls = sum(sim.load_calls for sim in sims)
        self.load_shortfall_chunks = sum(sim.shortfall for sim in sims)
        self.load_call_floor_ms = float(np.mean([o.call_floor_s for o in offloads]) * 1e3)
        self.store = {k: sum(o.store_counts[k] for o in offloads) for k in ("stored", "already_present", "dropped")}
        self.store["seconds"] = seconds = sum(o.store_s for o in offloads)
        self.store["gib_s"] = self.store["stored"] * offloads[0].chunk_bytes / GIB / seconds if seconds else 0.0
        self.corrupt_chunks = sum(o.corrupt for o in offloads)
        for b, a in zip(before, after):
            for name, vals in stats_delta(b, a).items():
                total = self.daemon.get(name, {})
                self.daemon[name] = {k: total.get(k, 0) + v for k, v in vals.items()}
        return costs


R = TypeVar("R", bound=TurnsResult)


def gib_s_of_costs(costs: dict[str, list[float]], stat: Callable[[list[float]], Any] = np.median) -> dict[str, float]:
    """GiB/s from per-byte costs (a `stat` of 0: calls no slower than the fixed cost measured at the start: no rate)."""
    return {t: 1 / float(stat(c)) / GIB for t, c in costs.items() if c and stat(c) > 0}


AS_AT_END = ("used_bytes", "chunks", "load_bytes_per_s")  # Stats fields that are a state, not a count


def stats_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """A daemon's Stats per tier over a run (AS_AT_END: as at the end)."""
    return {
        name: {k: v - before.get(name, {}).get(k, 0) if k not in AS_AT_END else v for k, v in vals.items()}
        for name, vals in after.items()
    }


@dataclass
class RunResult(TurnsResult):
    cached_share_of_prompt: float = 0.0
    gpu_busy_s: float = 0.0  # modelled seconds
    loader_busy_s: float = 0.0
    charged_s: dict[str, float] = field(default_factory=dict)  # modelled loader seconds per tier (fixed + bytes)
    charged_fixed_s: dict[str, float] = field(default_factory=dict)  # of which the load calls' fixed cost
    lookup_s: float = 0.0  # measured lookup time, all turns (on the loader's timeline)
    call_latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # per kind: calls, p50, p99

    def progress(self) -> str:
        return (
            f"hit {100 * self.hit_rate_overall:.1f}%  {self.throughput_tokens_s:,.0f} tokens/s  TTFT p50 "
            f"{self.ttft_p50_s:.2f} s p99 {self.ttft_p99_s:.2f} s  {super().progress()}"
        )


def summarize(
    config: str, sim: Simulation, offload: Offload | None = None, before: dict | None = None, after: dict | None = None
) -> RunResult:
    r = RunResult(config, sim.n)
    r.summarize_turns(sim, TIERS, offload.chunk_bytes if offload is not None else None)
    r.cached_share_of_prompt = sum(r.hit_tokens.values()) / r.prompt_tokens
    r.gpu_busy_s, r.loader_busy_s = sim.lane.gpu_s, sim.lane.loader_s
    r.gpu_busy, r.loader_busy = r.gpu_busy_s / sim.makespan, r.loader_busy_s / sim.makespan
    r.charged_s, r.charged_fixed_s = dict(sim.charged), dict(sim.charged_fixed)
    r.lookup_s = float(sum(sim.lookup_s))
    if offload is not None and before is not None and after is not None:
        r.summarize_offloads([sim], [offload], [before], [after])
        r.call_latency_ms = offload.latency.summary()
    return r


PEERS_UP_S = 60.0  # a bound for the nodes to see each other, never a measurement
# the directory's writes once per 0.1 s (within --settle-s); a lookup's round trip bounded as in tests/directory/
DIRECTORY_OPTIONS = "directory_interval_s=0.1,directory_timeout_s=0.5"


class Nodes:
    """N daemons of one set-up (one node: N = 1), with their tiers' resources (fs roots, S3 buckets) and
    listeners; close() stops them all and removes the resources."""

    def __init__(self, config: Config, n: int, workdir: Path, tag: str, s3: S3 | None) -> None:
        self.config, self.n, self.workdir, self.tag, self.s3 = config, n, workdir, tag, s3
        self.fs_roots: list[Path] = []
        self.buckets: list[str] = []
        self.daemons: list[Daemon] = []
        self.addresses: list[str] = []

    def make(self, sizes: Sizes, peer_transport: str = "tcp", events: Sequence[str] = (), directory: str = "") -> None:
        """The daemons, not started. events: each node's ZMQ events endpoint, for a KV-aware router;
        directory: the fleet directory's URL (set-ups with `directory`)."""
        config, n = self.config, self.n
        if config.pooled:  # one daemon holding what n nodes' RAM and fs hold
            n = 1
            sizes = replace(sizes, ram_bytes=sizes.ram_bytes * self.n, fs_bytes=sizes.fs_bytes * self.n)
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)] if config.uses("peer") else []
        prefix = f"kvmt{uuid.uuid4().hex[:8]}"  # this run's keys only: runs share one cluster
        shared_s3 = self._s3_spec(sizes.s3_bytes) if config.uses("s3") else ""  # one bucket for all
        peer = f"kind=peer,transport={peer_transport},tcp_port=0,ucx_port=0,ucx_net_devices=lo,reconnect_s=1"
        if config.directory:  # reconnect_s: the nodes start one after another and find each other sooner
            peer += f",directory={directory},directory_prefix={prefix},{DIRECTORY_OPTIONS}"
        else:
            peer += f",peers={' '.join(self.addresses)}"
        specs = {"s3": shared_s3, "peer": peer}  # the same for every node (fs: a root of its own)
        for i in range(n):
            args = ["--metrics-addr", "off"]
            if events:
                args += ["--events-zmq-endpoint", events[i]]
            if config.write_through:
                args += ["--write-policy", "write-through"]
            if self.addresses:
                args += ["--tcp-listen", self.addresses[i]]
            for kind, size_field in config.lower:
                args += ["--tiers", specs[kind] if kind in specs else self._fs_spec(getattr(sizes, size_field))]
            self.daemons.append(Daemon(sizes.ram_bytes, extra_args=args + list(config.daemon_args)))

    def _fs_spec(self, nbytes: int) -> str:
        root = Path(tempfile.mkdtemp(prefix=f"fs-{self.tag}-", dir=self.workdir))
        self.fs_roots.append(root)
        return f"kind=fs,root={root},bytes={nbytes}"

    def _s3_spec(self, nbytes: int) -> str:
        assert self.s3 is not None  # (the sweep skips a set-up with S3 when there is no server)
        self.buckets.append(self.s3.new_bucket())
        return self.s3.tier_spec(self.buckets[-1], nbytes)

    def start(self) -> None:
        for d in self.daemons:
            d.start()
        if self.addresses and not self.config.directory:  # (the directory's holders are found by lookups)
            self._wait_peers_up()

    def _wait_peers_up(self) -> None:
        from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

        def sees_all_up(i: int) -> bool:
            up = {p.address for p in self.daemons[i].peer_status().peers if p.state == pb.PEER_STATE_UP}
            return set(self.addresses) - {self.addresses[i]} <= up

        deadline = time.monotonic() + PEERS_UP_S
        pending = list(range(len(self.daemons)))
        while pending := [i for i in pending if not sees_all_up(i)]:
            if time.monotonic() > deadline:
                status = "; ".join(str(self.daemons[i].peer_status()).replace("\n", " ") for i in pending)
                raise TimeoutError(f"nodes {pending} did not see every peer up within {PEERS_UP_S:.0f} s: {status}")
            time.sleep(0.05)

    def daemon_of(self, node: int) -> Daemon:
        return self.daemons[node % len(self.daemons)]

    def failure_log(self) -> str:
        if len(self.daemons) == 1:
            return self.daemons[0].log_tail(8)
        return " | ".join(f"node {i}: {d.log_tail(4)}" for i, d in enumerate(self.daemons))

    def close(self) -> None:
        for d in self.daemons:
            d.stop()
        for root in self.fs_roots:
            shutil.rmtree(root, ignore_errors=True)
        if self.s3 is not None:
            for name in self.buckets:
                with contextlib.suppress(Exception):
                    self.s3.empty_bucket(name)


class Skipped(Exception):
    """A run that could not be made (its tiers, its daemons): the sweep reports it skipped, with this why."""


@contextlib.contextmanager
def started(config: Config, conversations: int, n: int, p: Plan, s3: S3 | None, *make_args: Any) -> Iterator[Nodes]:
    """The run's daemons (Nodes.make's further arguments: make_args), started, then stopped and their
    resources removed; what could not be made or started raises Skipped."""
    tag = f"{config.key.replace('+', '-')}-{conversations}"
    with contextlib.closing(Nodes(config, n, p.workdir, tag, s3)) as nodes:
        try:
            nodes.make(p.sizes, *make_args)
        except Exception as exc:  # noqa: BLE001 - a tier whose resources cannot be made: say so, go on
            raise Skipped(f"tier set-up failed: {exc}") from exc
        try:
            nodes.start()
        except Exception as exc:  # noqa: BLE001 - daemons that did not come up: say so, go on
            raise Skipped(f"{'nodes' if n > 1 else 'daemon'} did not start: {exc}: {nodes.failure_log()}") from exc
        yield nodes


def run_one(config: Config, conversations: int, p: Plan, s3: S3 | None) -> RunResult:
    if not config.offload:
        sim = Simulation(p.w, p.m, conversations, None)
        sim.run()
        return summarize(config.key, sim)
    with started(config, conversations, 1, p, s3) as nodes:
        with contextlib.closing(Offload(nodes.daemons[0].socket, p.w, p.m)) as offload:
            before = offload.stats()
            sim = Simulation(p.w, p.m, conversations, offload)
            sim.run()
            after = offload.stats()
            offload.latency.print(f"{config.key}: per-call latency at the client ({p.m.transfer.value} transfers)")
            return summarize(config.key, sim, offload, before, after)
