# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""One run: a configuration at a number of conversations, on a fresh daemon with its tiers; its results."""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, Protocol, TypeVar

import numpy as np

from bench.lib.daemons import Daemon
from bench.lib.report import GIB, load_average
from bench.lib.s3 import S3
from bench.multiturn.model import TIERS, Config, Model, Sizes, Workload
from bench.multiturn.offload import Offload
from bench.multiturn.sim import Simulation, TurnRecord

T = TypeVar("T", bound="TurnsResult")
P = ParamSpec("P")


class Clock(Protocol):
    """A simulation's model clock (Simulation, or the nodes' ClusterSim)."""

    @property
    def makespan(self) -> float: ...
    @property
    def starts(self) -> np.ndarray: ...
    @property
    def thinks(self) -> np.ndarray: ...


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

    def summarize_turns(
        self, w: Workload, recs: Sequence[TurnRecord], sim: Clock, tiers: Sequence[str], chunk_bytes: int | None
    ) -> None:
        """The hit rates, modelled throughput and latency of the turns; with chunk_bytes (a run with
        offload), the scaled bytes loaded from each tier below the GPU and their measured rates."""
        self.turns = len(recs)
        self.prompt_tokens = sum(x.prompt_tokens for x in recs)
        self.reusable_tokens = sum(x.reusable_chunks for x in recs) * w.chunk_tokens
        self.hit_tokens = {t: sum(x.hits.get(t, 0) for x in recs) * w.chunk_tokens for t in tiers}
        self.hit_rate = {
            t: (v / self.reusable_tokens if self.reusable_tokens else 0.0) for t, v in self.hit_tokens.items()
        }
        self.hit_rate_overall = sum(self.hit_rate.values())
        self.makespan_s = sim.makespan
        self.think_floor_s = float(np.max(sim.starts + sim.thinks[:, 1:].sum(axis=1)))
        self.throughput_tokens_s = self.prompt_tokens / sim.makespan
        ttft = np.array([x.done - x.arrive for x in recs])
        self.ttft_p50_s, self.ttft_p99_s = float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99))
        if chunk_bytes is None:
            return
        secs: dict[str, float] = {}
        for x in recs:
            for t, s in x.load_seconds.items():
                secs[t] = secs.get(t, 0.0) + s
        self.loaded_bytes = {t: self.hit_tokens[t] // w.chunk_tokens * chunk_bytes for t in tiers if t != "gpu"}
        self.load_seconds = {t: secs.get(t, 0.0) for t in self.loaded_bytes}
        self.load_gib_s = {
            t: (self.loaded_bytes[t] / GIB / self.load_seconds[t])
            for t in self.loaded_bytes
            if self.load_seconds[t] > 0 and self.loaded_bytes[t] > 0
        }


def gib_s_of_costs(costs: dict[str, list[float]], stat: Callable[[list[float]], Any] = np.median) -> dict[str, float]:
    """GiB/s from per-byte costs (a `stat` of 0: calls no slower than the fixed cost measured at the start: no rate)."""
    return {t: 1 / float(stat(c)) / GIB for t, c in costs.items() if c and stat(c) > 0}


def store_summary(counts: dict[str, int], seconds: float, chunk_bytes: int) -> dict[str, Any]:
    gib = counts["stored"] * chunk_bytes / GIB
    return {**counts, "seconds": seconds, "gib_s": gib / seconds if seconds else 0.0}


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


def summarize(
    config: str, sim: Simulation, offload: Offload | None, before: dict | None, after: dict | None
) -> RunResult:
    recs = sim.records
    r = RunResult(config, sim.n)
    r.summarize_turns(sim.w, recs, sim, TIERS, offload.chunk_bytes if offload is not None else None)
    r.cached_share_of_prompt = sum(r.hit_tokens.values()) / r.prompt_tokens
    r.gpu_busy = sim.busy["gpu"] / sim.makespan
    r.loader_busy = sim.busy["loader"] / sim.makespan
    r.gpu_busy_s, r.loader_busy_s = sim.busy["gpu"], sim.busy["loader"]
    r.charged_s, r.charged_fixed_s = dict(sim.charged), dict(sim.charged_fixed)
    r.lookup_s = float(sum(sim.lookup_s))
    if offload is not None:
        r.marginal_gib_s = gib_s_of_costs(sim.all_costs)
        r.lookups = len(sim.lookup_s)
        r.lookup_ms_p50 = float(np.percentile(sim.lookup_s, 50) * 1e3) if sim.lookup_s else 0.0
        r.load_shortfall_chunks = sim.shortfall
        r.load_calls = sim.load_calls
        r.load_call_floor_ms = offload.call_floor_s * 1e3
        r.store = store_summary(offload.store_counts, offload.store_s, offload.chunk_bytes)
        r.corrupt_chunks = offload.corrupt
        r.call_latency_ms = offload.latency.summary()
        if before is not None and after is not None:
            r.daemon = stats_delta(before, after)
    return r


class TierResources:
    """What the tiers under RAM need for one run (an fs root, an S3 bucket): created when a spec
    asks for them, removed by close()."""

    def __init__(self, workdir: Path, tag: str, s3: S3 | None) -> None:
        self.workdir, self.tag, self.s3 = workdir, tag, s3
        self.fs_roots: list[Path] = []
        self.buckets: list[str] = []

    def fs_root(self) -> Path:
        root = Path(tempfile.mkdtemp(prefix=f"fs-{self.tag}-", dir=self.workdir))
        self.fs_roots.append(root)
        return root

    def bucket(self) -> str:
        if self.s3 is None:
            raise RuntimeError("no S3 server")
        name = self.s3.new_bucket()
        self.buckets.append(name)
        return name

    def close(self) -> None:
        for root in self.fs_roots:
            shutil.rmtree(root, ignore_errors=True)
        for name in self.buckets:
            if self.s3 is not None:
                with contextlib.suppress(Exception):
                    self.s3.empty_bucket(name)


def _fs_spec(res: TierResources, nbytes: int) -> str:
    return f"kind=fs,root={res.fs_root()},bytes={nbytes}"


def _s3_spec(res: TierResources, nbytes: int) -> str:
    bucket = res.bucket()
    assert res.s3 is not None
    return res.s3.tier_spec(bucket, nbytes)


TIER_SPECS = {"fs": _fs_spec, "s3": _s3_spec}  # a tier kind under RAM -> its --tiers value for one run


def tier_args(config: Config, sizes: Sizes, res: TierResources) -> list[str]:
    args: list[str] = []
    for kind, size_field in config.lower:
        args += ["--tiers", TIER_SPECS[kind](res, getattr(sizes, size_field))]
    return args


def timed(run: Callable[P, T]) -> Callable[P, T]:
    """A run with its wall seconds and the load average at its start and end."""

    @functools.wraps(run)
    def timed_run(*args: P.args, **kwargs: P.kwargs) -> T:
        t0, load0 = time.perf_counter(), load_average()
        r = run(*args, **kwargs)
        r.wall_s = time.perf_counter() - t0
        r.load_average = (load0, load_average())
        return r

    return timed_run


@timed
def run_one(
    config: Config, conversations: int, w: Workload, m: Model, sizes: Sizes, workdir: Path, s3: S3 | None
) -> RunResult:
    if not config.offload:
        sim = Simulation(w, m, conversations, None)
        sim.run()
        return summarize(config.key, sim, None, None, None)
    res = TierResources(workdir, f"{config.key.replace('+', '-')}-{conversations}", s3)
    try:
        extra = ["--metrics-addr", "off", *tier_args(config, sizes, res), *config.daemon_args]
    except Exception as exc:  # noqa: BLE001 - a tier whose resources cannot be made: say so, go on
        res.close()
        return RunResult(config.key, conversations, skipped=f"tier set-up failed: {exc}")
    chunk_bytes = w.chunk_tokens * m.kv_bytes_per_token
    daemon = Daemon(sizes.ram_bytes, extra_args=extra)
    try:
        daemon.start()
    except Exception as exc:  # noqa: BLE001 - a tier that is not ready yet: say so, go on
        res.close()
        return RunResult(config.key, conversations, skipped=f"daemon did not start: {exc}: {daemon.log_tail(8)}")
    offload = None
    try:
        offload = Offload(
            daemon.socket,
            chunk_bytes,
            w.chunk_tokens,
            w.final_tokens // w.chunk_tokens,
            w.seed,
            m.transfer,
            m.gate_prefill_tokens_per_s,
        )
        before = offload.stats()
        sim = Simulation(w, m, conversations, offload)
        sim.run()
        after = offload.stats()
        offload.latency.print(f"{config.key}: per-call latency at the client ({m.transfer.value} transfers)")
        return summarize(config.key, sim, offload, before, after)
    finally:
        if offload is not None:
            offload.close()
        daemon.stop()
        res.close()
