"""Multi-turn benchmark of kvstored (not a test): the article's workload against the real daemon,
with the GPU modelled. Workload: multi-turn conversations with a 12K-token first prompt and 4K more
tokens per turn, 8 turns, 20 s think time, at 16 to 256 simultaneous conversations. Compared: no
offload, RAM tier, RAM + fs, RAM + fs + S3, by modelled throughput and hit rate of reusable tokens.

Workload (every parameter is a flag; defaults are the article's): each conversation sends a
12K-token prompt, then 7 more turns that each append 4K tokens (the answer plus the next
question) and resend the whole history: prompts of 12K, 16K, ... 40K tokens. Token ids are
synthetic and seeded per conversation; chunk keys come from kvstored_client.chunk_keys, so a
turn's prompt shares its leading keys with the previous turn's. Conversations start at random
times within one think time and think (uniformly 0.5-1.5x --think-s) between turns.

Modelled GPU (a discrete-event simulation on a model clock):
- a prefix cache of --gpu-tokens tokens, LRU over chunks. A turn's chunks are touched tail
  first, so a conversation's prefix is the last of it to go (vLLM frees blocks in that order);
- a prefill cost per token (--prefill-tokens-per-s) for every prompt token not already cached
  (the new tokens of the turn and every reusable token that missed);
- loads from kvstored go through a loader that runs beside the GPU (vLLM loads KV
  asynchronously and keeps computing other requests); --serial-loads puts them on the GPU's
  timeline instead. Each resource is first-come first-served.
Every offloaded chunk really goes through the daemon (client library, pool mapping):
- when the GPU cache evicts chunks, they are stored into kvstored (Client.store, real bytes);
- on a turn, the reusable chunks that are not on the GPU are looked up (Client.lookup: hits per
  tier from the per-key tier kinds) and loaded (Client.load, one call per run of chunks from the
  same tier, each timed). The loader's service time is the measured lookup time plus, per load
  call, its fixed cost (measured at the start of each run with a 4 KiB chunk) and its bytes times
  the tier's cost per byte times the byte scale (below). The cost per byte is the running median,
  over the tier's last 64 load calls, of (measured time - fixed cost) / bytes: taken from the
  daemon's own transfers, never a constant, with the noise of a shared machine filtered out.
  Stores are not charged (engines offload in the background) but are timed and reported.
- misses (chunks the daemon does not have, or lost between lookup and load) are prefilled.
Configurations: no offload (no daemon), RAM tier only, RAM + fs, RAM + fs + S3 (fs smaller in
that configuration so the object store serves the overflow). One fresh daemon (and fs directory,
and bucket) per configuration and conversation count.

Scaling (printed with the results): the modelled model is Llama-3.1-8B in bf16, 128 KiB of KV
per token. The bytes that really move are --kv-bytes-per-token (default 512: 1/256 of that), so
a 4096-token chunk is 2 MiB instead of 512 MiB; the measured cost per byte is charged for the
full-size model's bytes (x256; the fixed cost of a call is charged once, unscaled). The GPU
cache, the RAM tier and the fs tier are sized in conversations (at their final 40K-token
history): GPU 64 (as in the article), RAM 128 (2.5 GiB at the scaled size), fs 512 (RAM + fs) or
128 (RAM + fs + S3), S3 unbounded. The output also prints what a token loaded from each tier
costs relative to recomputing it (break-even: KV bytes per token x prefill rate, 1.95 GiB/s).

Metrics per configuration and conversation count: hit rate per tier as a share of the reusable
tokens (tokens of the previous turn's prompt, the only ones a cache can serve: at most 81% of
all prompt tokens with the default shape), bytes moved per tier (client side, and the daemon's
own Stats counters), measured load GiB/s per tier, modelled throughput (prompt tokens per
modelled second, decode not modelled) and time to first token p50/p99 (arrival to end of
prefill, modelled seconds). Token ids, start times and think times are seeded per conversation;
the order in which turns are served depends on the measured load times, so figures with offload
move a little from run to run (no offload is exactly reproducible).

Usage: .venv/bin/python bench/multiturn.py [--conversations 16,32,64,128,192,256]
           [--configs none,ram,ram+fs,ram+fs+s3] [--s3 auto|radosgw|moto] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import os
import shutil
import sys
import tempfile
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from _common import GIB, MIB, REPO, Daemon, load_average, machine_info, populate, write_json  # noqa: E402
from compare import apply_nt_threshold, nt_threshold_arg  # noqa: E402

CONFIGS = ("none", "ram", "ram+fs", "ram+fs+s3")
CONFIG_LABELS = {"none": "no offload", "ram": "RAM", "ram+fs": "RAM + fs", "ram+fs+s3": "RAM + fs + S3"}
TIERS = ("gpu", "ram", "fs", "s3")  # where a reusable chunk was found
VOCAB = 128_256  # Llama 3 vocabulary (token ids are synthetic; only their hashes matter)
HEADER = 48  # bytes of each stored chunk that identify it: key (32) + conversation (8) + index (8)
TARGET_HIT = 0.90  # RAM + fs at the largest count: overall hit rate of reusable tokens
TARGET_SPEEDUP = 2.0  # RAM + fs at the largest count: modelled throughput vs no offload
COST_WINDOW = 64  # load calls per tier over which the cost per byte is a running median


# -- parameters ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    initial_tokens: int = 12 * 1024
    turn_tokens: int = 4 * 1024
    turns: int = 8
    think_s: float = 20.0
    chunk_tokens: int = 4096
    seed: int = 0

    def prompt_tokens(self, turn: int) -> int:
        """Tokens sent at turn 1..turns: the whole history."""
        return self.initial_tokens + (turn - 1) * self.turn_tokens

    @property
    def final_tokens(self) -> int:
        return self.prompt_tokens(self.turns)

    def reusable_chunks(self, turn: int) -> int:
        """Full chunks of the previous turn's prompt: what a cache can serve at this turn."""
        return 0 if turn == 1 else self.prompt_tokens(turn - 1) // self.chunk_tokens

    @property
    def tokens_per_conversation(self) -> int:
        return sum(self.prompt_tokens(t) for t in range(1, self.turns + 1))

    @property
    def reusable_per_conversation(self) -> int:
        return sum(self.reusable_chunks(t) for t in range(1, self.turns + 1)) * self.chunk_tokens


@dataclass(frozen=True)
class Model:
    model_name: str = "Llama-3.1-8B bf16"
    model_kv_bytes_per_token: int = 131_072  # 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes
    kv_bytes_per_token: int = 512  # what really moves
    prefill_tokens_per_s: float = 16_000.0  # one H100, ~26K-token average context (see --help)
    gpu_tokens: int = 0
    serial_loads: bool = False

    @property
    def byte_scale(self) -> float:
        return self.model_kv_bytes_per_token / self.kv_bytes_per_token


@dataclass(frozen=True)
class Sizes:
    ram_bytes: int
    fs_bytes: int
    s3_fs_bytes: int
    s3_bytes: int = 0  # 0: unbounded


# -- the modelled GPU prefix cache ---------------------------------------------------------------


class GpuCache:
    """Chunks resident on the modelled GPU, least recently used first."""

    def __init__(self, capacity_chunks: int) -> None:
        self.capacity = capacity_chunks
        self._lru: OrderedDict[bytes, tuple[int, int]] = OrderedDict()

    def prefix_hits(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if key not in self._lru:
                break
            n += 1
        return n

    def admit(self, keys: Sequence[bytes], conv: int) -> list[tuple[bytes, int, int]]:
        """Make the prompt's chunks resident (tail first, so the prefix is most recent); returns
        the evicted chunks as (key, conversation, index)."""
        for index in range(len(keys) - 1, -1, -1):
            key = keys[index]
            if key in self._lru:
                self._lru.move_to_end(key)
            else:
                self._lru[key] = (conv, index)
        evicted = []
        while len(self._lru) > self.capacity:
            key, (c, i) = self._lru.popitem(last=False)
            evicted.append((key, c, i))
        return evicted


# -- kvstored as the modelled engine's offload target --------------------------------------------


@dataclass
class LoadResult:
    hits: dict[str, int]  # chunks loaded, per tier
    seconds: dict[str, float]  # measured load time, per tier
    lookup_s: float
    looked_up: int  # chunks the lookup reported as a prefix hit
    loaded: int
    segments: list[tuple[str, float, int]]  # one per load call: (tier, measured seconds, chunks loaded)


class Offload:
    """The modelled engine's connection to kvstored: stores GPU evictions, looks up and loads."""

    TIER_NAMES = {1: "ram", 2: "fs", 3: "s3", 4: "peer"}

    def __init__(self, socket: Path, chunk_bytes: int, chunk_tokens: int, max_chunks: int, seed: int) -> None:
        from kvstored_client import Client, NamespaceSpec

        self.client = Client(socket, deadline_s=120.0, client_name="bench-multiturn")
        self.ns = self.client.register_namespace(NamespaceSpec(
            model="bench/multiturn", dtype="scaled-bf16", chunk_bytes=chunk_bytes, layout="sim",
            block_tokens=chunk_tokens))
        self.chunk_bytes = chunk_bytes
        rng = np.random.default_rng(seed)
        self._noise = populate(rng.integers(0, 256, chunk_bytes, dtype=np.uint8))
        self._staging = populate(np.empty(max_chunks * chunk_bytes, dtype=np.uint8))
        self._out = populate(np.empty(max_chunks * chunk_bytes, dtype=np.uint8))
        self.max_chunks = max_chunks
        self.call_floor_s = self._calibrate_call_floor()
        self.store_s = 0.0
        self.store_counts = {"stored": 0, "already_present": 0, "dropped": 0}
        self.corrupt = 0

    def _calibrate_call_floor(self, calls: int = 40) -> float:
        """The fixed cost of one load call (Acquire + Release RPCs, client bookkeeping), measured
        with a 4 KiB chunk in a namespace of its own: charged once per call, as measured, while
        the rest of a load's time is charged per byte."""
        from kvstored_client import NamespaceSpec

        ns = self.client.register_namespace(NamespaceSpec(model="bench/multiturn-call-floor", dtype="u8",
                                                          chunk_bytes=4096))
        key = b"\x01" * 32
        self.client.store(ns, [key], np.ones(4096, dtype=np.uint8))
        out = populate(np.empty(4096, dtype=np.uint8))
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            if self.client.load(ns, [key], out) != 1:
                raise RuntimeError("call-floor calibration: the 4 KiB chunk did not load")
            times.append(time.perf_counter() - t0)
        self.client.delete(ns, [key])
        return float(np.median(times[calls // 4:]))

    @property
    def namespace_id(self) -> str:
        return self.ns.namespace_id

    def close(self) -> None:
        self.client.close()

    def stats(self) -> dict[str, dict[str, int]]:
        fields = ("read_bytes", "written_bytes", "loaded_chunks", "stored_chunks", "hits", "lookups", "evictions",
                  "promotions", "writebacks", "dropped_dirty", "dropped_backpressure", "errors", "checksum_failures",
                  "rejected_full", "used_bytes", "chunks")
        out = {}
        for tier in self.client.stats().tiers:
            out[tier.name] = {f: int(getattr(tier, f)) for f in fields}
        return out

    def store(self, evicted: Sequence[tuple[bytes, int, int]]) -> None:
        """Store the chunks the GPU evicted, with real (scaled) bytes: a header naming the chunk,
        then noise."""
        cb = self.chunk_bytes
        for start in range(0, len(evicted), self.max_chunks):
            batch = evicted[start:start + self.max_chunks]
            n = len(batch)
            buf = self._staging[:n * cb].reshape(n, cb)
            buf[:, HEADER:] = self._noise[HEADER:]
            for row, (key, conv, index) in enumerate(batch):
                buf[row, :HEADER] = np.frombuffer(_header(key, conv, index), dtype=np.uint8)
            t0 = time.perf_counter()
            result = self.client.store(self.ns, [k for k, _, _ in batch], buf)
            self.store_s += time.perf_counter() - t0
            self.store_counts["stored"] += result.stored
            self.store_counts["already_present"] += result.already_present
            self.store_counts["dropped"] += result.dropped

    def lookup_load(self, keys: Sequence[bytes], conv: int, first_index: int) -> LoadResult:
        """Look the keys up; load the leading hits, one timed call per run of the same tier."""
        t0 = time.perf_counter()
        found = self.client.lookup(self.ns, keys)
        lookup_s = time.perf_counter() - t0
        hits = {name: 0 for name in TIERS}
        seconds = {name: 0.0 for name in TIERS}
        n = min(found.prefix_hits, self.max_chunks)
        tiers = [self.TIER_NAMES.get(int(t), "peer") for t in found.tiers[:n]]
        loaded = 0
        segments = []
        cb = self.chunk_bytes
        while loaded < n:
            start, tier = loaded, tiers[loaded]
            end = start
            while end < n and tiers[end] == tier:
                end += 1
            t1 = time.perf_counter()
            got = self.client.load(self.ns, keys[start:end], self._out[start * cb:end * cb])
            elapsed = time.perf_counter() - t1
            seconds[tier] = seconds.get(tier, 0.0) + elapsed
            for i in range(start, start + got):  # wrong bytes are counted, never served as a hit
                if bytes(self._out[i * cb:i * cb + HEADER]) != _header(keys[i], conv, first_index + i):
                    self.corrupt += 1
                    break
                loaded += 1
            hits[tier] = hits.get(tier, 0) + loaded - start
            segments.append((tier, elapsed, loaded - start))
            if loaded < end:
                break  # evicted between lookup and load (or corrupt): the rest is prefilled
        return LoadResult(hits, seconds, lookup_s, n, loaded, segments)


def _header(key: bytes, conv: int, index: int) -> bytes:
    return key + conv.to_bytes(8, "little") + index.to_bytes(8, "little")


# -- one run: a configuration at a number of conversations ---------------------------------------


@dataclass
class TurnRecord:
    conv: int
    turn: int
    arrive: float
    prompt_tokens: int
    reusable_chunks: int
    hits: dict[str, int]
    load_s: float = 0.0  # charged to the loader
    prefill_s: float = 0.0
    done: float = 0.0
    load_seconds: dict[str, float] = field(default_factory=dict)  # measured, per tier


@dataclass
class RunResult:
    config: str
    conversations: int
    turns: int = 0
    prompt_tokens: int = 0
    reusable_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    hit_rate: dict[str, float] = field(default_factory=dict)  # share of reusable tokens, per tier
    hit_rate_overall: float = 0.0
    cached_share_of_prompt: float = 0.0
    throughput_tokens_s: float = 0.0
    makespan_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    gpu_busy: float = 0.0  # share of the makespan
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
    skipped: str = ""


class Simulation:
    def __init__(self, workload: Workload, model: Model, conversations: int, offload: Offload | None) -> None:
        self.w = workload
        self.m = model
        self.n = conversations
        self.offload = offload
        self.gpu = GpuCache(model.gpu_tokens // workload.chunk_tokens)
        ns_id = offload.namespace_id if offload else "no-offload"
        self.keys = [_conversation_keys(workload, c, ns_id) for c in range(conversations)]
        # per conversation, fixed in advance: its start time and its think times (the order in
        # which turns are served depends on measured load times; these do not)
        rng = np.random.default_rng([workload.seed, 1])
        self.starts = rng.uniform(0.0, workload.think_s, conversations) if workload.think_s > 0 else \
            np.zeros(conversations)
        self.thinks = rng.uniform(0.5, 1.5, (conversations, workload.turns)) * workload.think_s
        self.records: list[TurnRecord] = []
        self.lookup_s: list[float] = []
        self.load_calls = 0
        self.shortfall = 0
        self.cost_per_byte: dict[str, deque[float]] = {}
        self.all_costs: dict[str, list[float]] = {}

    def run(self) -> list[TurnRecord]:
        events: list[tuple[float, int, str, Any]] = []
        seq = 0

        def push(t: float, kind: str, payload: Any) -> None:
            nonlocal seq
            heapq.heappush(events, (t, seq, kind, payload))
            seq += 1

        for conv in range(self.n):
            push(float(self.starts[conv]), "arrive", (conv, 1))
        loader_q: list[TurnRecord] = []
        gpu_q: list[TurnRecord] = []
        loader_busy = gpu_busy = False
        self.busy = {"loader": 0.0, "gpu": 0.0}
        now = 0.0

        def start_loader() -> None:  # loads beside compute
            nonlocal loader_busy
            if loader_busy or not loader_q:
                return
            rec = loader_q.pop(0)
            load_s = self.serve_load(rec)
            loader_busy = True
            self.busy["loader"] += load_s
            push(now + load_s, "loaded", rec)

        def start_gpu() -> None:
            nonlocal gpu_busy
            if gpu_busy or not gpu_q:
                return
            rec = gpu_q.pop(0)
            service = rec.prefill_s
            if self.m.serial_loads:  # the GPU waits for its own loads
                service = self.serve_load(rec) + rec.prefill_s
            gpu_busy = True
            self.busy["gpu"] += service
            push(now + service, "computed", rec)

        while events:
            now, _, kind, payload = heapq.heappop(events)
            if kind == "arrive":
                conv, turn = payload
                rec = TurnRecord(conv, turn, now, self.w.prompt_tokens(turn), self.w.reusable_chunks(turn), {})
                if self.m.serial_loads:
                    gpu_q.append(rec)
                    start_gpu()
                else:
                    loader_q.append(rec)
                    start_loader()
            elif kind == "loaded":
                loader_busy = False
                gpu_q.append(payload)
                start_loader()
                start_gpu()
            elif kind == "computed":
                gpu_busy = False
                rec = payload
                rec.done = now
                self.records.append(rec)
                if rec.turn < self.w.turns:
                    push(now + float(self.thinks[rec.conv, rec.turn]), "arrive", (rec.conv, rec.turn + 1))
                start_gpu()
                start_loader()
        self.makespan = now
        return self.records

    def charge(self, tier: str, seconds: float, chunks: int) -> float:
        """Modelled time of one load call: its fixed cost (measured at start) once, plus its bytes
        times the tier's cost per byte x the byte scale. The cost per byte is the median over the
        tier's last COST_WINDOW calls (this one included) of (measured time - fixed cost) / bytes:
        the daemon's own transfers, with the noise of a shared machine filtered out."""
        self.load_calls += 1
        floor = self.offload.call_floor_s
        if chunks == 0:
            return seconds  # a call that found nothing: its time as measured
        nbytes = chunks * self.offload.chunk_bytes
        window = self.cost_per_byte.setdefault(tier, deque(maxlen=COST_WINDOW))
        window.append(max(0.0, seconds - floor) / nbytes)
        self.all_costs.setdefault(tier, []).append(window[-1])
        return floor + float(np.median(window)) * nbytes * self.m.byte_scale

    def serve_load(self, rec: TurnRecord) -> float:
        """The turn reaches the loader: GPU prefix, then kvstored for the rest; the prompt becomes
        resident on the GPU and what that evicts is stored into kvstored. Returns the load time
        to charge (0 when nothing comes from kvstored)."""
        w = self.w
        keys = self.keys[rec.conv][:rec.prompt_tokens // w.chunk_tokens]
        reusable = keys[:rec.reusable_chunks]
        on_gpu = self.gpu.prefix_hits(reusable)
        hits = {t: 0 for t in TIERS}
        hits["gpu"] = on_gpu
        load_s = 0.0
        if self.offload is not None and on_gpu < len(reusable):
            res = self.offload.lookup_load(reusable[on_gpu:], rec.conv, on_gpu)
            self.lookup_s.append(res.lookup_s)
            self.shortfall += res.looked_up - res.loaded
            for tier, count in res.hits.items():
                hits[tier] = hits.get(tier, 0) + count
            load_s = res.lookup_s + sum(self.charge(*seg) for seg in res.segments)
            rec.load_seconds = res.seconds
        rec.hits = hits
        cached = sum(hits.values()) * w.chunk_tokens
        rec.prefill_s = (rec.prompt_tokens - cached) / self.m.prefill_tokens_per_s
        rec.load_s = load_s
        evicted = self.gpu.admit(keys, rec.conv)
        if self.offload is not None and evicted:
            self.offload.store(evicted)
        return load_s


def _conversation_keys(w: Workload, conv: int, namespace_id: str) -> list[bytes]:
    from kvstored_client import chunk_keys

    tokens = np.random.default_rng([w.seed, conv, 0]).integers(0, VOCAB, w.final_tokens, dtype=np.int64)
    return chunk_keys(tokens, w.chunk_tokens, namespace_id)


def summarize(config: str, sim: Simulation, wall_s: float, offload: Offload | None,
              before: dict | None, after: dict | None) -> RunResult:
    w, recs = sim.w, sim.records
    r = RunResult(config, sim.n)
    r.turns = len(recs)
    r.prompt_tokens = sum(x.prompt_tokens for x in recs)
    r.reusable_tokens = sum(x.reusable_chunks for x in recs) * w.chunk_tokens
    r.hit_tokens = {t: sum(x.hits.get(t, 0) for x in recs) * w.chunk_tokens for t in TIERS}
    r.hit_rate = {t: (v / r.reusable_tokens if r.reusable_tokens else 0.0) for t, v in r.hit_tokens.items()}
    r.hit_rate_overall = sum(r.hit_rate.values())
    r.cached_share_of_prompt = sum(r.hit_tokens.values()) / r.prompt_tokens
    r.makespan_s = sim.makespan
    r.throughput_tokens_s = r.prompt_tokens / sim.makespan
    ttft = np.array([x.done - x.arrive for x in recs])
    r.ttft_p50_s, r.ttft_p99_s = float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99))
    r.gpu_busy = sim.busy["gpu"] / sim.makespan
    r.loader_busy = sim.busy["loader"] / sim.makespan
    r.wall_s = wall_s
    if offload is not None:
        cb = offload.chunk_bytes
        secs: dict[str, float] = {}
        for x in recs:
            for t, s in x.load_seconds.items():
                secs[t] = secs.get(t, 0.0) + s
        r.loaded_bytes = {t: r.hit_tokens[t] // w.chunk_tokens * cb for t in TIERS if t != "gpu"}
        r.load_seconds = {t: secs.get(t, 0.0) for t in r.loaded_bytes}
        r.load_gib_s = {t: (r.loaded_bytes[t] / GIB / r.load_seconds[t]) for t in r.loaded_bytes
                        if r.load_seconds[t] > 0 and r.loaded_bytes[t] > 0}
        r.marginal_gib_s = {t: (1 / float(np.median(c)) / GIB if np.median(c) > 0 else float("inf"))
                            for t, c in sim.all_costs.items() if c}
        r.lookups = len(sim.lookup_s)
        r.lookup_ms_p50 = float(np.percentile(sim.lookup_s, 50) * 1e3) if sim.lookup_s else 0.0
        r.load_shortfall_chunks = sim.shortfall
        r.load_calls = sim.load_calls
        r.load_call_floor_ms = offload.call_floor_s * 1e3
        stored_bytes = offload.store_counts["stored"] * cb
        r.store = {**offload.store_counts, "seconds": offload.store_s,
                   "gib_s": stored_bytes / GIB / offload.store_s if offload.store_s else 0.0}
        r.corrupt_chunks = offload.corrupt
        if before is not None and after is not None:
            r.daemon = {name: {k: v - before.get(name, {}).get(k, 0) if k not in ("used_bytes", "chunks") else v
                               for k, v in vals.items()} for name, vals in after.items()}
    return r


# -- tiers: fs directory, S3 server ---------------------------------------------------------------


class S3Server:
    """An S3 endpoint on loopback for the RAM + fs + S3 configuration, from tests/support/s3.py:
    a throwaway Ceph radosgw (memstore OSD) when Ceph is installed, else moto_server (in RAM)."""

    def __init__(self, kind: str, memstore_bytes: int) -> None:
        self.kind = kind
        self.memstore_bytes = memstore_bytes
        self.endpoint = ""
        self.access_key = self.secret_key = ""
        self.region = "us-east-1"
        self._server: Any = None
        self._buckets = 0

    def start(self) -> "S3Server":
        sys.path.insert(0, str(REPO))
        from tests.support.s3 import MotoServer, RadosGW

        errors = []
        for kind in (["radosgw", "moto"] if self.kind == "auto" else [self.kind]):
            server = RadosGW(memstore_bytes=self.memstore_bytes) if kind == "radosgw" else MotoServer()
            try:
                ep = server.start()
            except Exception as exc:  # noqa: BLE001 - try the next kind, report all
                errors.append(f"{kind}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}")
                with contextlib.suppress(Exception):
                    server.stop()
                continue
            self._server, self.kind = server, kind
            self.endpoint, self.access_key, self.secret_key, self.region = (
                ep.url, ep.access_key, ep.secret_key, ep.region)
            return self
        raise RuntimeError("no S3 server: " + "; ".join(errors))

    def _client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=self.region)

    def new_bucket(self) -> str:
        self._buckets += 1
        name = f"kvstored-bench-{os.getpid()}-{self._buckets}"
        self._client().create_bucket(Bucket=name)
        return name

    def empty_bucket(self, name: str) -> None:
        """Delete the run's objects (radosgw keeps them in the memstore OSD, in RAM)."""
        s3 = self._client()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                s3.delete_objects(Bucket=name, Delete={"Objects": objects, "Quiet": True})
        s3.delete_bucket(Bucket=name)

    def stop(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.stop()
            self._server = None


def tier_args(config: str, sizes: Sizes, fs_root: Path, s3: S3Server | None, bucket: str) -> list[str]:
    args: list[str] = []
    if config in ("ram+fs", "ram+fs+s3"):
        fs_bytes = sizes.fs_bytes if config == "ram+fs" else sizes.s3_fs_bytes
        args += ["--tiers", f"kind=fs,root={fs_root},bytes={fs_bytes}"]
    if config == "ram+fs+s3":
        assert s3 is not None
        args += ["--tiers", f"kind=s3,bucket={bucket},endpoint_url={s3.endpoint},region={s3.region},"
                            f"access_key={s3.access_key},secret_key={s3.secret_key},bytes={sizes.s3_bytes}"]
    return args


class BenchDaemon(Daemon):
    """_common.Daemon that keeps the log's last lines when start-up fails (stop() removes it)."""

    failure_log = ""

    def stop(self, timeout_s: float = 20.0) -> int | None:
        self.failure_log = self.log_tail(8)
        return super().stop(timeout_s)


def run_one(config: str, conversations: int, w: Workload, m: Model, sizes: Sizes, workdir: Path,
            s3: S3Server | None) -> RunResult:
    t0 = time.perf_counter()
    if config == "none":
        sim = Simulation(w, m, conversations, None)
        sim.run()
        return summarize(config, sim, time.perf_counter() - t0, None, None, None)
    fs_root = Path(tempfile.mkdtemp(prefix=f"fs-{config.replace('+', '-')}-{conversations}-", dir=workdir))
    bucket = s3.new_bucket() if config == "ram+fs+s3" and s3 is not None else ""
    extra = ["--metrics-addr", "off", *tier_args(config, sizes, fs_root, s3, bucket)]
    chunk_bytes = w.chunk_tokens * m.kv_bytes_per_token
    daemon = BenchDaemon(sizes.ram_bytes, extra_args=extra)
    try:
        daemon.start()
    except Exception as exc:  # noqa: BLE001 - a tier that is not ready yet: say so, go on
        shutil.rmtree(fs_root, ignore_errors=True)
        return RunResult(config, conversations, skipped=f"daemon did not start: {exc}: {daemon.failure_log}")
    offload = None
    try:
        offload = Offload(daemon.socket, chunk_bytes, w.chunk_tokens, w.final_tokens // w.chunk_tokens, w.seed)
        before = offload.stats()
        sim = Simulation(w, m, conversations, offload)
        sim.run()
        after = offload.stats()
        return summarize(config, sim, time.perf_counter() - t0, offload, before, after)
    finally:
        if offload is not None:
            offload.close()
        daemon.stop()
        shutil.rmtree(fs_root, ignore_errors=True)
        if bucket and s3 is not None:
            with contextlib.suppress(Exception):
                s3.empty_bucket(bucket)


# -- reporting ------------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def scaling_lines(w: Workload, m: Model, sizes: Sizes, gpu_conv: float, ram_conv: float, fs_conv: float,
                  s3_fs_conv: float) -> list[str]:
    chunk_bytes = w.chunk_tokens * m.kv_bytes_per_token
    real_chunk = w.chunk_tokens * m.model_kv_bytes_per_token
    return [
        f"workload: {w.initial_tokens}-token first prompt + {w.turn_tokens} tokens per turn, {w.turns} turns "
        f"(last prompt {w.final_tokens} tokens), think time {w.think_s:g} s (uniform 0.5-1.5x), "
        f"chunks of {w.chunk_tokens} tokens, seed {w.seed}",
        f"model: {m.model_name}, {m.model_kv_bytes_per_token} KV bytes/token; prefill {m.prefill_tokens_per_s:,.0f} "
        f"tokens/s; loads {'on the GPU timeline' if m.serial_loads else 'beside compute (async loader)'}",
        f"scaled: KV bytes/token {m.model_kv_bytes_per_token} -> {m.kv_bytes_per_token} (1/{m.byte_scale:g}); "
        f"chunk {fmt_bytes(real_chunk)} -> {fmt_bytes(chunk_bytes)}; each tier's measured cost per byte "
        f"x{m.byte_scale:g} charges the full-size bytes (lookups and the fixed cost of a load call: as measured)",
        f"sized in conversations at their last turn ({w.final_tokens} tokens): GPU {gpu_conv:g} "
        f"({m.gpu_tokens:,} tokens = {fmt_bytes(m.gpu_tokens * m.model_kv_bytes_per_token)} unscaled), "
        f"RAM tier {ram_conv:g} ({fmt_bytes(sizes.ram_bytes)}), fs {fs_conv:g} ({fmt_bytes(sizes.fs_bytes)}); "
        f"in RAM + fs + S3: fs {s3_fs_conv:g} ({fmt_bytes(sizes.s3_fs_bytes)}), S3 "
        f"{'unbounded' if not sizes.s3_bytes else fmt_bytes(sizes.s3_bytes)}",
    ]


def print_results(results: list[RunResult], file=None) -> None:
    file = file or sys.stdout
    base = {r.conversations: r.throughput_tokens_s for r in results if r.config == "none" and not r.skipped}
    header = ["config", "convs", "hit gpu", "ram", "fs", "s3", "overall", "tokens/s", "vs none", "TTFT p50",
              "p99", "gpu busy", "loader", "loaded ram/fs/s3", "GiB/s ram/fs/s3 (marginal)", "wall"]
    rows = [header]
    for r in results:
        if r.skipped:
            rows.append([CONFIG_LABELS[r.config], str(r.conversations), "skipped"] + [""] * (len(header) - 3))
            continue
        ratio = r.throughput_tokens_s / base[r.conversations] if base.get(r.conversations) else None
        loaded = "/".join(fmt_bytes(r.loaded_bytes.get(t, 0)) for t in ("ram", "fs", "s3")) if r.loaded_bytes else "-"
        gib = "-"
        if r.loaded_bytes:
            gib = "/".join(f"{r.load_gib_s[t]:.2f}" if t in r.load_gib_s else "-" for t in ("ram", "fs", "s3"))
            gib += " (" + "/".join(f"{r.marginal_gib_s[t]:.2f}" if t in r.marginal_gib_s else "-"
                                   for t in ("ram", "fs", "s3")) + ")"
        rows.append([
            CONFIG_LABELS[r.config], str(r.conversations),
            *(f"{100 * r.hit_rate[t]:.1f}%" for t in TIERS), f"{100 * r.hit_rate_overall:.1f}%",
            f"{r.throughput_tokens_s:,.0f}", f"{ratio:.2f}x" if ratio else "", f"{r.ttft_p50_s:.2f} s",
            f"{r.ttft_p99_s:.2f} s", f"{100 * r.gpu_busy:.0f}%", f"{100 * r.loader_busy:.0f}%", loaded, gib,
            f"{r.wall_s:.0f} s",
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        print("  ".join(c.rjust(wd) if 1 <= j <= 15 and j != 13 else c.ljust(wd)
                        for j, (c, wd) in enumerate(zip(row, widths))).rstrip(), file=file)
        if i == 0:
            print("  ".join("-" * wd for wd in widths), file=file)
    print("hit rates: shares of the reusable tokens (the previous turn's prompt); tokens/s, TTFT, busy: modelled; "
          "loaded: scaled bytes really moved; GiB/s: their measured rate (marginal: median per-byte cost of the "
          "load calls, fixed call cost removed; what the model charges, x the byte scale)", file=file)


def daemon_lines(results: list[RunResult]) -> list[str]:
    lines = []
    for r in results:
        if r.skipped or not r.daemon or not (r.lookups or any(r.store.get(k) for k in ("stored", "already_present"))):
            continue
        parts = []
        for name, d in r.daemon.items():
            extra = [f"{k} {d[k]}" for k in ("dropped_dirty", "dropped_backpressure", "errors", "checksum_failures",
                                               "rejected_full") if d.get(k)]
            if name == "ram":  # the RAM tier counts chunks, not bytes
                parts.append(f"ram: {d['loaded_chunks']} chunks leased, {d['stored_chunks']} stored"
                             + (f", promotions {d['promotions']}" if d.get("promotions") else "")
                             + (f", write-backs {d['writebacks']}" if d.get("writebacks") else "")
                             + (f", evictions {d['evictions']}" if d.get("evictions") else "")
                             + "".join(f", {e}" for e in extra))
                continue
            parts.append(f"{name}: read {fmt_bytes(d['read_bytes'])} written {fmt_bytes(d['written_bytes'])}"
                         + (f" promotions {d['promotions']}" if d.get("promotions") else "")
                         + (f" evictions {d['evictions']}" if d.get("evictions") else "")
                         + ("".join(f", {e}" for e in extra)))
        st = r.store
        lines.append(f"{CONFIG_LABELS[r.config]:>13} {r.conversations:>4}: " + "; ".join(parts)
                     + f" | client stores {st['stored']} new, {st['already_present']} present, {st['dropped']} "
                       f"dropped, {st['gib_s']:.2f} GiB/s | lookup p50 {r.lookup_ms_p50:.2f} ms, load call floor "
                       f"{r.load_call_floor_ms:.2f} ms x {r.load_calls}"
                     + (f" | {r.load_shortfall_chunks} chunks gone between lookup and load"
                        if r.load_shortfall_chunks else "")
                     + (f" | CORRUPT {r.corrupt_chunks}" if r.corrupt_chunks else ""))
    return lines


def cost_lines(results: list[RunResult], m: Model) -> list[str]:
    """What a token served from each tier costs, relative to recomputing it: the break-even
    bandwidth (KV bytes per token x prefill rate) over the tier's measured marginal rate."""
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    lines = [f"break-even load bandwidth (KV bytes/token x prefill tokens/s): {breakeven:.2f} GiB/s -- a tier "
             f"slower than that costs more per token than recomputing"]
    for config in CONFIGS:
        rs = [r for r in results if r.config == config and not r.skipped and r.marginal_gib_s]
        if not rs:
            continue
        r = max(rs, key=lambda x: x.conversations)
        parts = [f"{t} {r.marginal_gib_s[t]:.2f} GiB/s = {breakeven / r.marginal_gib_s[t]:.2f}x a recompute"
                 for t in ("ram", "fs", "s3") if t in r.marginal_gib_s]
        lines.append(f"{CONFIG_LABELS[config]} at {r.conversations}: " + "; ".join(parts))
    return lines


def target_lines(results: list[RunResult]) -> list[tuple[str, bool | None]]:
    runs = {(r.config, r.conversations): r for r in results if not r.skipped}
    counts = sorted({r.conversations for r in results})
    if not counts:
        return []
    top = counts[-1]
    fs, none = runs.get(("ram+fs", top)), runs.get(("none", top))
    out: list[tuple[str, bool | None]] = []
    if fs is None:
        out.append((f"RAM + fs at {top} conversations: not measured", None))
        return out
    out.append((f"RAM + fs at {top} conversations: overall hit rate {100 * fs.hit_rate_overall:.1f}% of reusable "
                f"tokens (target >= {100 * TARGET_HIT:.0f}%)", fs.hit_rate_overall >= TARGET_HIT))
    if none is not None:
        ratio = fs.throughput_tokens_s / none.throughput_tokens_s
        out.append((f"RAM + fs at {top} conversations: modelled throughput {ratio:.2f}x no offload "
                    f"(target >= {TARGET_SPEEDUP:.1f}x)", ratio >= TARGET_SPEEDUP))
    return out


# -- main -----------------------------------------------------------------------------------------


def parse_counts(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = ap.add_argument_group("workload")
    g.add_argument("--initial-tokens", type=int, default=12 * 1024, help="first prompt of every conversation")
    g.add_argument("--turn-tokens", type=int, default=4 * 1024, help="tokens each turn appends to the history")
    g.add_argument("--turns", type=int, default=8, help="turns per conversation")
    g.add_argument("--think-s", type=float, default=20.0,
                   help="mean think time between turns, modelled seconds (uniform 0.5-1.5x)")
    g.add_argument("--conversations", default="16,32,64,128,192,256", help="simultaneous conversations to sweep")
    g.add_argument("--chunk-tokens", type=int, default=4096,
                   help="tokens per kvstored chunk (x --kv-bytes-per-token: 2 MiB, as in bench/compare.py)")
    g.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("modelled GPU and model")
    g.add_argument("--model-kv-bytes-per-token", type=int, default=131_072,
                   help="KV bytes per token of the modelled model (Llama-3.1-8B bf16: 128 KiB)")
    g.add_argument("--kv-bytes-per-token", type=int, default=512,
                   help="KV bytes per token that really move through kvstored (the scale)")
    g.add_argument("--prefill-tokens-per-s", type=float, default=16_000.0,
                   help="modelled prefill rate (Llama-3.1-8B on one H100: ~16 GFLOP/token of weights + ~14 "
                        "of attention at a ~26K-token average context, at ~500 TFLOP/s)")
    g.add_argument("--gpu-conversations", type=float, default=64,
                   help="GPU prefix cache capacity, in conversations at their last turn")
    g.add_argument("--gpu-tokens", type=int, default=0, help="GPU prefix cache capacity in tokens (overrides)")
    g.add_argument("--serial-loads", action="store_true",
                   help="loads on the GPU's timeline instead of beside it (a pessimistic engine)")
    g = ap.add_argument_group("kvstored tiers")
    g.add_argument("--configs", default=",".join(CONFIGS), help=f"among {', '.join(CONFIGS)}")
    g.add_argument("--ram-conversations", type=float, default=128, help="RAM tier size, in conversations")
    g.add_argument("--fs-conversations", type=float, default=512, help="fs tier size in RAM + fs, in conversations")
    g.add_argument("--s3-fs-conversations", type=float, default=128,
                   help="fs tier size in RAM + fs + S3, in conversations (smaller: S3 takes the overflow)")
    g.add_argument("--s3", default="auto", choices=("auto", "radosgw", "moto"),
                   help="S3 server: radosgw via tests/support/s3.py, moto_server, or auto (radosgw, else moto)")
    g.add_argument("--workdir", default=str(REPO / "results" / "tmp"),
                   help="fs tier roots go under here (each removed after its run)")
    g = ap.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="write the results as JSON")
    g.add_argument("--plot", metavar="PATH", help="write the chart (PNG) here")
    nt_threshold_arg(g)
    args = ap.parse_args(argv)
    apply_nt_threshold(args.nt_threshold)

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; choose among {', '.join(CONFIGS)}")
    w = Workload(args.initial_tokens, args.turn_tokens, args.turns, args.think_s, args.chunk_tokens, args.seed)
    if w.final_tokens // w.chunk_tokens < 1:
        ap.error("--chunk-tokens is larger than the last prompt")
    per_conv_tokens = w.final_tokens
    gpu_tokens = args.gpu_tokens or int(args.gpu_conversations * per_conv_tokens)
    m = Model(model_kv_bytes_per_token=args.model_kv_bytes_per_token, kv_bytes_per_token=args.kv_bytes_per_token,
              prefill_tokens_per_s=args.prefill_tokens_per_s, gpu_tokens=gpu_tokens, serial_loads=args.serial_loads)
    if gpu_tokens < w.final_tokens:
        ap.error("the GPU cache must hold at least one whole prompt")
    conv_bytes = per_conv_tokens * m.kv_bytes_per_token
    sizes = Sizes(ram_bytes=int(args.ram_conversations * conv_bytes), fs_bytes=int(args.fs_conversations * conv_bytes),
                  s3_fs_bytes=int(args.s3_fs_conversations * conv_bytes))
    counts = parse_counts(args.conversations)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    info = machine_info()
    print(f"kvstored multi-turn benchmark -- {info['cpu_model']}, {info['cpus']} CPUs, {info['mem_total_gib']} GiB, "
          f"kernel {info['kernel']}, git {info['git']}, load average {load_average():.2f}, "
          f"GLIBC_TUNABLES={info['glibc_tunables'] or '(none)'}")
    scale = scaling_lines(w, m, sizes, gpu_tokens / per_conv_tokens, args.ram_conversations, args.fs_conversations,
                          args.s3_fs_conversations)
    for line in scale:
        print("  " + line)
    max_bytes = max(counts) * w.reusable_per_conversation * m.kv_bytes_per_token
    print(f"  at {max(counts)} conversations: {fmt_bytes(max_bytes)} of reusable KV (scaled), "
          f"{max(counts) * w.tokens_per_conversation:,} prompt tokens", flush=True)

    s3 = None
    s3_note = ""
    if "ram+fs+s3" in configs:
        # radosgw keeps objects in a memstore OSD (RAM): room for the largest run's write-downs
        memstore = int(max(counts) * w.final_tokens * m.kv_bytes_per_token * 1.5) + GIB
        try:
            s3 = S3Server(args.s3, memstore).start()
            s3_note = ("S3: Ceph radosgw (memstore OSD) on loopback" if s3.kind == "radosgw"
                       else "S3: moto_server (in RAM) on loopback")
        except RuntimeError as exc:
            s3_note = f"S3 configuration skipped: {exc}"
        print("  " + s3_note, flush=True)

    results: list[RunResult] = []
    t_start = time.perf_counter()
    try:
        for n in counts:
            for config in configs:
                if config == "ram+fs+s3" and s3 is None:
                    r = RunResult(config, n, skipped=s3_note)
                else:
                    r = run_one(config, n, w, m, sizes, workdir, s3)
                results.append(r)
                status = r.skipped or (f"hit {100 * r.hit_rate_overall:.1f}%  {r.throughput_tokens_s:,.0f} tokens/s  "
                                       f"TTFT p50 {r.ttft_p50_s:.2f} s p99 {r.ttft_p99_s:.2f} s  wall {r.wall_s:.1f} s")
                print(f"  [{time.perf_counter() - t_start:6.0f} s] {CONFIG_LABELS[config]:>13} x {n:>3}: {status}",
                      flush=True)
    finally:
        if s3 is not None:
            s3.stop()
    total_s = time.perf_counter() - t_start

    print()
    print_results(results)
    print()
    print("daemon counters per run (Stats deltas; bytes are the scaled bytes):")
    for line in daemon_lines(results):
        print("  " + line)
    print()
    print("cost of a token loaded from each tier (marginal rate, at the largest count measured):")
    costs = cost_lines(results, m)
    for line in costs:
        print("  " + line)
    print()
    print("targets:")
    targets = target_lines(results)
    for text, ok in targets:
        print(f"  {'PASS' if ok else 'MISS' if ok is False else '----'}  {text}")
    print(f"sweep took {total_s:.0f} s; load average now {load_average():.2f}")

    doc = {
        "benchmark": "multiturn",
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv),
        "machine": info,
        "workload": asdict(w),
        "model": {**asdict(m), "byte_scale": m.byte_scale},
        "sizes": asdict(sizes),
        "sizes_in_conversations": {"gpu": gpu_tokens / per_conv_tokens, "ram": args.ram_conversations,
                                   "fs": args.fs_conversations, "s3_fs": args.s3_fs_conversations},
        "scaling": scale,
        "s3_server": s3_note,
        "s3_endpoint": s3.endpoint if s3 is not None else "",
        "results": [asdict(r) for r in results],
        "targets": [{"text": t, "met": ok} for t, ok in targets],
        "tier_costs": costs,
        "sweep_s": total_s,
    }
    if args.json:
        write_json(args.json, doc)
        print(f"JSON written to {args.json}")
    if args.plot:
        from plot import plot_multiturn

        plot_multiturn(doc, args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
